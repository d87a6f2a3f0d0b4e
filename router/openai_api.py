"""The OpenAI-compatible HTTP front end: ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``/health`` and ``/metrics``, for the ``openai`` client and outside load tools.

It is a second door onto the same request path as the gRPC API, not a second pipeline: each HTTP
request becomes a ``pdserve.v1.GenerateRequest`` and runs through ``GenerationService.run``, so
validation, placement, streaming, stop strings, metrics and the per-request log line are the
gRPC path's. This module only translates JSON to that request, its responses to OpenAI's JSON
(server-sent events when ``"stream": true``), and gRPC statuses to HTTP ones.

FastAPI on uvicorn, on the router's own asyncio loop (the pool's queues and conditions live on
that loop); docs/api.md says why this stack and lists what is supported.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
import uuid
from typing import Any, AsyncIterator

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdserve.router.auth import bearer_key_matches
from pdserve.router.service import GenerationService, RequestFailed
from pdserve.v1 import generation_pb2 as pb

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 1024 * 1024  # the gRPC API's message limit, so both doors take the same requests

# gRPC status -> (HTTP status, OpenAI error type)
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}

# Fields that change what is generated and that pdserve cannot honour: refused, never ignored.
# name -> the values that mean "off" (what pdserve does anyway).
_UNSUPPORTED = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "min_p": (0, 0.0),
    "min_tokens": (0,),
    "logit_bias": ({},),
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none",),
    "function_call": ("none",),
    "parallel_tool_calls": (False, True),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
}


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    @classmethod
    def from_failure(cls, exc: RequestFailed) -> "ApiError":
        status, type_ = HTTP_STATUS.get(exc.code, (500, "internal_error"))
        # The gRPC messages name fields as the proto nests them; HTTP clients send them flat.
        return cls(status, exc.message.replace("sampling.", ""), type_, code=exc.code.name.lower())

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


class _Context:
    """What ``GenerationService.run`` asks of a gRPC context: HTTP requests have no deadline."""

    def time_remaining(self) -> float | None:
        return None


# ---- request translation ------------------------------------------------------------------


def _field(body: dict, name: str, types: tuple, what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in types:  # JSON true is not a number here
        raise ApiError(400, f"{name} must be {what}; got {json.dumps(value)}", param=name)
    if not isinstance(value, types):
        raise ApiError(400, f"{name} must be {what}; got {json.dumps(value)[:80]}", param=name)
    return value


def _not_unicode(value: Any, path: str = "") -> str | None:
    """The path of the first string in a JSON value that UTF-8 cannot encode (JSON lets a body
    escape a lone surrogate, which protobuf strings refuse), or ``None``."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "the body"
    elif isinstance(value, dict):
        for k, v in value.items():
            found = _not_unicode(k, path or "the body") if isinstance(k, str) else None
            found = found or _not_unicode(v, f"{path}.{k}" if path else str(k))
            if found:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _not_unicode(v, f"{path}[{i}]")
            if found:
                return found
    return None


def _check_unsupported(body: dict) -> None:
    for name, off in _UNSUPPORTED.items():
        if name in body and body[name] is not None and body[name] not in off:
            raise ApiError(400, f"{name} is not supported by pdserve (only {json.dumps(off[0]) if off else 'unset'}); "
                           "see docs/api.md", param=name)
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise ApiError(400, "response_format: only {\"type\": \"text\"} is supported (no structured output yet)",
                       param="response_format")


def _sampling(body: dict, chat: bool) -> pb.SamplingParams:
    s = pb.SamplingParams()
    max_tokens = _field(body, "max_completion_tokens", (int,), "an integer") if chat else None
    if max_tokens is None:
        max_tokens = _field(body, "max_tokens", (int,), "an integer")
    if max_tokens is not None:
        if not 1 <= max_tokens <= 2**31 - 1:
            raise ApiError(400, f"max_tokens must be >= 1; got {max_tokens}", param="max_tokens")
        s.max_tokens = max_tokens
    for name in ("temperature", "top_p"):
        value = _field(body, name, (int, float), "a number")
        if value is not None:
            setattr(s, name, float(value))
    top_k = _field(body, "top_k", (int,), "an integer (-1 or 0 disables it)")
    if top_k is not None:
        if top_k < -1 or top_k > 2**31 - 1:
            raise ApiError(400, f"top_k must be -1, 0 (both disable it) or a positive integer; got {top_k}", param="top_k")
        s.top_k = max(0, top_k)
    seed = _field(body, "seed", (int,), "an integer")
    if seed is not None:
        if not -(2**63) <= seed < 2**63:
            raise ApiError(400, "seed must fit in 64 bits", param="seed")
        s.seed = seed
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(x, str) for x in stops):
            raise ApiError(400, "stop must be a string or a list of strings", param="stop")
        s.stop.extend(stops)
    ids = _field(body, "stop_token_ids", (list,), "a list of token ids")
    if ids is not None:
        s.stop_token_ids.extend(_token_ids(ids, "stop_token_ids"))
    ignore_eos = _field(body, "ignore_eos", (bool,), "true or false")
    s.ignore_eos = bool(ignore_eos)
    if chat:
        if _field(body, "logprobs", (bool,), "true or false"):
            s.logprobs = True
        top = _field(body, "top_logprobs", (int,), "an integer")
        if top:
            raise ApiError(400, "top_logprobs > 0 is not supported: pdserve returns the chosen tokens' "
                           "logprobs only (logprobs: true)", param="top_logprobs")
    else:
        n = _field(body, "logprobs", (int,), "an integer")
        if n is not None:
            if n != 0:
                raise ApiError(400, "logprobs > 0 (alternatives per position) is not supported: logprobs: 0 "
                               "returns the chosen tokens' logprobs", param="logprobs")
            s.logprobs = True
    return s


def _token_ids(values: list, name: str) -> list[int]:
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in values):
        raise ApiError(400, f"{name} must hold integers only", param=name)
    if any(not -(2**31) <= t < 2**31 for t in values):
        raise ApiError(400, f"{name} holds a value outside the vocabulary", param=name)
    return values


def completion_request(body: dict) -> pb.GenerateRequest:
    """A ``/v1/completions`` body as the gRPC API's request; ``ApiError`` 400 if it cannot be."""
    _check_unsupported(body)
    req = pb.GenerateRequest(sampling=_sampling(body, chat=False))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        req.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        req.token_ids.ids.extend(_token_ids(prompt, "prompt"))
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(400, f"prompt holds {len(prompt)} prompts; pdserve takes one prompt per request "
                       "(send the others as separate requests)", param="prompt")
    else:
        raise ApiError(400, "prompt must be a string or a list of token ids", param="prompt")
    return req


def chat_request(body: dict) -> pb.GenerateRequest:
    """A ``/v1/chat/completions`` body as the gRPC API's request; ``ApiError`` 400 if it cannot be."""
    _check_unsupported(body)
    req = pb.GenerateRequest(sampling=_sampling(body, chat=True))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    req.messages.SetInParent()
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string role", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(p["text"] for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", param="messages")
        req.messages.messages.add(role=m["role"], content=content)
    return req


# ---- response translation -----------------------------------------------------------------


def timings_json(t: pb.Timings) -> dict:
    """The ``pdserve_timings`` extension: server-side phases of the request, in seconds."""
    return {"queued_s": t.queued_s, "prefill_s": t.prefill_s, "transfer_s": t.transfer_s,
            "ttft_s": t.ttft_s, "decode_s": t.decode_s, "e2e_s": t.e2e_s}


def usage_json(r: pb.GenerateResponse) -> dict:
    p, c = r.usage.prompt_tokens, r.usage.completion_tokens
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


class _Choice:
    """One choice's text and logprobs, built up from the gRPC responses."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer = tokenizer
        self.chat = chat
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None

    def add(self, r: pb.GenerateResponse) -> None:
        self.text += r.text
        self.token_ids += r.token_ids
        self.logprobs += r.logprobs
        if r.finish_reason:
            self.finish_reason = FINISH_REASONS.get(r.finish_reason, "stop")

    def logprobs_json(self, r: pb.GenerateResponse | None = None) -> dict | None:
        """The logprobs of ``r``'s tokens (all tokens so far without ``r``), in the endpoint's shape."""
        ids, lps = (list(r.token_ids), list(r.logprobs)) if r is not None else (self.token_ids, self.logprobs)
        if not lps:
            return None
        tokens = [self.tokenizer.decode([t]) for t in ids]
        if self.chat:
            return {"content": [{"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []}
                                for tok, lp in zip(tokens, lps)]}
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": None, "text_offset": None}


class OpenAIFrontEnd:
    """The FastAPI app over a ``GenerationService``, and its uvicorn server on the router's loop."""

    def __init__(self, service: GenerationService, tokenizer, model: str, *, api_key: str | None = None,
                 metrics=None, can_serve=lambda: True, max_model_len: int | None = None):
        self.service = service
        self.tokenizer = tokenizer
        self.model = model
        self.max_model_len = max_model_len
        self.api_key = api_key
        self.metrics = metrics
        self.can_serve = can_serve
        self.created = int(time.time())
        self.app = self._build_app()
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None
        self.port: int | None = None

    # ---- serving ------------------------------------------------------------------------

    async def start(self, host: str, port: int, ssl_certfile: str | None = None, ssl_keyfile: str | None = None) -> int:
        """Listen on ``host:port`` (0: a free port) and serve on the running loop; returns the port."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            raise HttpPortInUse(f"cannot serve HTTP on {host}:{port} (is the port in use?)") from exc
        sock.listen(1024)
        sock.setblocking(False)
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False,
                                ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile, timeout_graceful_shutdown=1)
        self._server = _Server(config)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        self.port = sock.getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 10)
        self._server = self._task = None

    # ---- the app ------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)

        @app.middleware("http")
        async def guard(request: Request, call_next):
            length = request.headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
                return ApiError(413, f"the request body is {length} bytes; at most {MAX_BODY_BYTES} are "
                                "accepted").response()
            if self.api_key is not None and request.url.path != "/health":
                if not bearer_key_matches(request.headers.get("authorization"), self.api_key):
                    return ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                    "authentication_error", code="invalid_api_key").response()
            return await call_next(request)

        @app.exception_handler(404)
        async def not_found(request: Request, exc):
            return ApiError(404, f"no route {request.method} {request.url.path}; see docs/api.md",
                            "not_found_error").response()

        @app.exception_handler(405)
        async def wrong_method(request: Request, exc):
            return ApiError(405, f"{request.method} is not allowed on {request.url.path}",
                            "invalid_request_error").response()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200 if self.can_serve() else 503)

        @app.get("/metrics")
        async def metrics() -> Response:
            # generate_latest asks the workers for fresh stats through this loop: off the loop.
            data = await asyncio.to_thread(generate_latest, self.metrics.registry) if self.metrics else b""
            return Response(data, media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [self._model_card()]}

        @app.get("/v1/models/{model:path}")
        async def model(model: str):
            if model != self.model:
                return self._unknown_model(model).response()
            return self._model_card()

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._handle(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await self._handle(request, chat=True)

        return app

    def _model_card(self) -> dict:
        # "root" and "max_model_len": vLLM's fields, which `vllm bench serve` and others read.
        return {"id": self.model, "object": "model", "created": self.created, "owned_by": "pdserve",
                "root": self.model, "max_model_len": self.max_model_len}

    def _unknown_model(self, name: str) -> ApiError:
        return ApiError(404, f"the model {name!r} does not exist here; this server serves {self.model!r} "
                        "(GET /v1/models)", "not_found_error", param="model", code="model_not_found")

    async def _handle(self, request: Request, chat: bool):
        try:
            try:
                body = json.loads(await request.body())
            except ValueError as exc:
                raise ApiError(400, f"the body is not valid JSON: {exc}") from None
            if not isinstance(body, dict):
                raise ApiError(400, "the body must be a JSON object")
            bad = _not_unicode(body)
            if bad is not None:
                raise ApiError(400, f"{bad} is not valid Unicode text: it holds a lone surrogate "
                               "(an escape such as \\ud800 with no pair)", param=bad.split("[")[0].split(".")[0])
            name = body.get("model")
            if name not in (None, "", self.model):
                raise self._unknown_model(str(name))
            grpc_request = chat_request(body) if chat else completion_request(body)
            stream = _field(body, "stream", (bool,), "true or false")
            options = _field(body, "stream_options", (dict,), "an object") or {}
            include_usage = bool(stream and options.get("include_usage"))
            with_ids = bool(_field(body, "return_token_ids", (bool,), "true or false"))
            rid = request.headers.get("x-request-id")
            if rid:
                grpc_request.request_id = rid
            responses = self.service.run(grpc_request, _Context())
            # The first response (or the request's refusal) before any byte is sent, so that a bad
            # or refused request gets its HTTP status and not a 200 with an error inside.
            try:
                first = await responses.__anext__()
            except RequestFailed as exc:
                raise ApiError.from_failure(exc) from None
            except StopAsyncIteration:
                raise ApiError(500, "the request ended without a response", "internal_error") from None
        except ApiError as exc:
            return exc.response()
        kind = "chat.completion" if chat else "text_completion"
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{first.request_id or uuid.uuid4().hex}"
        if stream:
            return StreamingResponse(self._stream(responses, first, rid, kind, chat, include_usage, with_ids),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self._unary(responses, first, rid, kind, chat, with_ids)

    async def _unary(self, responses: AsyncIterator[pb.GenerateResponse], first: pb.GenerateResponse,
                     rid: str, kind: str, chat: bool, with_ids: bool):
        choice = _Choice(self.tokenizer, chat)
        last = first
        try:
            choice.add(first)
            async for r in responses:
                choice.add(r)
                last = r
        except RequestFailed as exc:
            return ApiError.from_failure(exc).response()
        finally:
            await responses.aclose()
        out_choice: dict[str, Any] = {"index": 0, "logprobs": choice.logprobs_json(),
                                      "finish_reason": choice.finish_reason}
        if chat:
            out_choice["message"] = {"role": "assistant", "content": choice.text}
        else:
            out_choice["text"] = choice.text
        if with_ids:
            out_choice["token_ids"] = choice.token_ids
        return {"id": rid, "object": kind, "created": int(time.time()), "model": self.model,
                "choices": [out_choice], "usage": usage_json(last), "pdserve_timings": timings_json(last.timings)}

    async def _stream(self, responses: AsyncIterator[pb.GenerateResponse], first: pb.GenerateResponse,
                      rid: str, kind: str, chat: bool, include_usage: bool,
                      with_ids: bool) -> AsyncIterator[bytes]:
        """Server-sent events: one chunk per gRPC response, then (with ``include_usage``) a
        usage chunk, then ``[DONE]``. ``pdserve_timings`` rides on the last chunk. A client that
        goes away cancels this generator, which closes the request on its workers."""
        chunk_kind = f"{kind}.chunk" if chat else kind
        created = int(time.time())
        choice = _Choice(self.tokenizer, chat)

        def event(payload: dict) -> bytes:
            return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

        def chunk(r: pb.GenerateResponse, role: bool) -> dict:
            c: dict[str, Any] = {"index": 0, "logprobs": choice.logprobs_json(r),
                                 "finish_reason": FINISH_REASONS.get(r.finish_reason, "stop") if r.finish_reason else None}
            if chat:
                c["delta"] = ({"role": "assistant"} if role else {}) | ({"content": r.text} if r.text or role else {})
            else:
                c["text"] = r.text
            if with_ids:
                c["token_ids"] = list(r.token_ids)
            out = {"id": rid, "object": chunk_kind, "created": created, "model": self.model, "choices": [c]}
            if include_usage:
                out["usage"] = None
            return out

        try:
            r, role = first, True
            while True:
                choice.add(r)
                payload = chunk(r, role)
                role = False
                if r.finish_reason and not include_usage:
                    payload["usage"] = usage_json(r)  # vLLM's habit: usage on the last chunk
                    payload["pdserve_timings"] = timings_json(r.timings)
                yield event(payload)
                if r.finish_reason:
                    if include_usage:
                        yield event({"id": rid, "object": chunk_kind, "created": created, "model": self.model,
                                     "choices": [], "usage": usage_json(r), "pdserve_timings": timings_json(r.timings)})
                    break
                try:
                    r = await responses.__anext__()
                except StopAsyncIteration:
                    break
        except RequestFailed as exc:  # after the headers: the error goes in the stream
            yield event(ApiError.from_failure(exc).body())
        finally:
            await responses.aclose()
        yield b"data: [DONE]\n\n"


class HttpPortInUse(OSError):
    """The HTTP API's address could not be bound."""


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handlers: ``pdserve serve`` owns SIGINT and SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield
