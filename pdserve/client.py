"""Python client for a pdserve server, synchronous (``Client``) and asyncio (``AsyncClient``).

>>> with Client("127.0.0.1:50051") as client:
...     for chunk in client.generate("Once upon a time", max_tokens=32, temperature=0):
...         print(chunk.text, end="", flush=True)

Results are plain dataclasses; each keeps the protobuf it came from in ``raw``. Errors raise
``RequestError`` with the gRPC status code and the server's message. Leaving a stream early
(``break``, ``cancel()``, or the ``with`` block) cancels the request on the server, which frees
everything it held.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Iterator, Sequence

import grpc
import grpc.aio

from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc

DEFAULT_TARGET = "127.0.0.1:50051"
API_KEY_ENV = "PDSERVE_API_KEY"  # the key a client sends when none is passed

_FINISH = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
}


class RequestError(Exception):
    """A request failed: ``code`` is the gRPC status, ``message`` the server's explanation."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc(cls, exc: grpc.RpcError) -> "RequestError":
        return cls(exc.code(), exc.details() or "")


@dataclass
class Timings:
    """Server-side phases of one request, in seconds."""

    queued_s: float
    prefill_s: float
    transfer_s: float
    ttft_s: float
    decode_s: float
    e2e_s: float

    @classmethod
    def from_pb(cls, t: pb.Timings) -> "Timings":
        return cls(t.queued_s, t.prefill_s, t.transfer_s, t.ttft_s, t.decode_s, t.e2e_s)


@dataclass
class Chunk:
    """One streamed response: new tokens and their text; the last one also the summary."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort" on the last chunk
    prompt_tokens: int | None = None  # last chunk only
    completion_tokens: int | None = None  # last chunk only
    timings: Timings | None = None  # last chunk only
    raw: pb.GenerateResponse | None = field(default=None, repr=False)

    @classmethod
    def from_pb(cls, r: pb.GenerateResponse) -> "Chunk":
        last = r.finish_reason != pb.FINISH_REASON_UNSPECIFIED
        return cls(
            request_id=r.request_id,
            text=r.text,
            token_ids=list(r.token_ids),
            logprobs=list(r.logprobs) if r.logprobs else None,
            finish_reason=_FINISH.get(r.finish_reason) if last else None,
            prompt_tokens=r.usage.prompt_tokens if last else None,
            completion_tokens=r.usage.completion_tokens if last else None,
            timings=Timings.from_pb(r.timings) if last else None,
            raw=r,
        )


@dataclass
class Completion:
    """A whole answer."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    timings: Timings
    raw: pb.CompleteResponse | None = field(default=None, repr=False)

    @classmethod
    def from_pb(cls, r: pb.CompleteResponse) -> "Completion":
        return cls(
            request_id=r.request_id,
            text=r.text,
            token_ids=list(r.token_ids),
            logprobs=list(r.logprobs) if r.logprobs else None,
            finish_reason=_FINISH.get(r.finish_reason, "unknown"),
            prompt_tokens=r.usage.prompt_tokens,
            completion_tokens=r.usage.completion_tokens,
            timings=Timings.from_pb(r.timings),
            raw=r,
        )


@dataclass
class ServerInfo:
    model: str
    max_model_len: int
    mode: str
    num_prefill_workers: int
    num_decode_workers: int
    transport: str
    vocab_size: int
    version: str
    raw: pb.ServerInfo | None = field(default=None, repr=False)

    @classmethod
    def from_pb(cls, r: pb.ServerInfo) -> "ServerInfo":
        return cls(
            r.model, r.max_model_len, r.mode, r.num_prefill_workers, r.num_decode_workers,
            r.transport, r.vocab_size, r.version, raw=r,
        )


def build_request(
    prompt: str | None = None,
    *,
    messages: Sequence[dict] | None = None,
    token_ids: Sequence[int] | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    logprobs: bool = False,
    request_id: str = "",
) -> pb.GenerateRequest:
    """A ``GenerateRequest`` from exactly one input (prompt, messages or token_ids).

    Parameters left at ``None`` stay unset, so the server applies its documented defaults.
    """
    given = [x is not None for x in (prompt, messages, token_ids)]
    if sum(given) != 1:
        raise ValueError("give exactly one of prompt, messages or token_ids")
    req = pb.GenerateRequest(request_id=request_id)
    if prompt is not None:
        req.prompt = prompt
    elif messages is not None:
        req.messages.messages.extend(
            pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages
        )
        req.messages.SetInParent()  # an empty list is still "messages" (and rejected as such)
    else:
        req.token_ids.ids.extend(token_ids)
        req.token_ids.SetInParent()
    s = req.sampling
    for name, value in (
        ("max_tokens", max_tokens), ("temperature", temperature), ("top_p", top_p),
        ("top_k", top_k), ("seed", seed),
    ):
        if value is not None:
            setattr(s, name, value)
    s.stop.extend(stop)
    s.stop_token_ids.extend(stop_token_ids)
    s.ignore_eos = ignore_eos
    s.logprobs = logprobs
    return req


_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
    ("grpc.max_send_message_length", 16 * 1024 * 1024),
    # gRPC's default reconnect backoff grows to two minutes; a client waiting for a server that
    # is still loading its model should notice it within a second or two.
    ("grpc.max_reconnect_backoff_ms", 2000),
]


def call_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The gRPC metadata that carries an API key (``authorization: Bearer KEY``); none without one."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def open_channel(target: str, tls_ca: str | bytes | None = None, aio: bool = False, options=None):
    """A gRPC channel to ``target``; over TLS when ``tls_ca`` (the PEM of the CA that signed the
    server's certificate: a file path, or its bytes) is given."""
    mod = grpc.aio if aio else grpc
    options = _CHANNEL_OPTIONS if options is None else options
    if tls_ca is None:
        return mod.insecure_channel(target, options=options)
    root = tls_ca if isinstance(tls_ca, bytes) else Path(tls_ca).read_bytes()
    return mod.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=root), options=options)


class ResponseStream:
    """Iterate to get ``Chunk``s; ``cancel()`` (or leaving the ``with`` block) stops the request."""

    def __init__(self, call):
        self._call = call

    def __iter__(self) -> Iterator[Chunk]:
        try:
            for r in self._call:
                yield Chunk.from_pb(r)
        except grpc.RpcError as exc:
            raise RequestError.from_rpc(exc) from None
        finally:
            self._call.cancel()  # a no-op once the stream has ended

    def cancel(self) -> None:
        self._call.cancel()

    def __enter__(self) -> "ResponseStream":
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


class Client:
    """Blocking client. ``timeout`` (seconds) is the default deadline of every call; ``api_key``
    is sent with every call (default ``$PDSERVE_API_KEY``); ``tls_ca`` (a PEM file or its bytes)
    makes the channel TLS, trusting that CA."""

    def __init__(self, target: str = DEFAULT_TARGET, *, timeout: float | None = None,
                 api_key: str | None = None, tls_ca: str | bytes | None = None):
        self.target = target
        self.timeout = timeout
        self._metadata = call_metadata(api_key or os.environ.get(API_KEY_ENV))
        self._channel = open_channel(target, tls_ca)
        self._stub = pb_grpc.GenerationStub(self._channel)

    def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs) -> ResponseStream:
        """Stream the answer; keyword arguments as in ``build_request``."""
        req = build_request(prompt, **kwargs)
        return ResponseStream(self._stub.Generate(req, timeout=timeout or self.timeout, metadata=self._metadata))

    def complete(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs) -> Completion:
        """The whole answer at once; keyword arguments as in ``build_request``."""
        req = build_request(prompt, **kwargs)
        try:
            return Completion.from_pb(self._stub.Complete(req, timeout=timeout or self.timeout,
                                                          metadata=self._metadata))
        except grpc.RpcError as exc:
            raise RequestError.from_rpc(exc) from None

    def server_info(self, *, timeout: float | None = None) -> ServerInfo:
        try:
            r = self._stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=timeout or self.timeout,
                                         metadata=self._metadata)
        except grpc.RpcError as exc:
            raise RequestError.from_rpc(exc) from None
        return ServerInfo.from_pb(r)

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until the channel connects (raises ``RequestError`` UNAVAILABLE otherwise)."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, f"no server at {self.target}") from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncResponseStream:
    """``async for`` to get ``Chunk``s; ``cancel()`` (or leaving ``async with``) stops it."""

    def __init__(self, call):
        self._call = call

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        try:
            async for r in self._call:
                yield Chunk.from_pb(r)
        except grpc.RpcError as exc:
            raise RequestError.from_rpc(exc) from None
        finally:
            self._call.cancel()

    def cancel(self) -> None:
        self._call.cancel()

    async def __aenter__(self) -> "AsyncResponseStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.cancel()


class AsyncClient:
    """asyncio client; the same calls and arguments as ``Client``, awaited. Create it inside a
    running loop."""

    def __init__(self, target: str = DEFAULT_TARGET, *, timeout: float | None = None,
                 api_key: str | None = None, tls_ca: str | bytes | None = None):
        self.target = target
        self.timeout = timeout
        self._metadata = call_metadata(api_key or os.environ.get(API_KEY_ENV))
        self._channel = open_channel(target, tls_ca, aio=True)
        self._stub = pb_grpc.GenerationStub(self._channel)

    def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs) -> AsyncResponseStream:
        req = build_request(prompt, **kwargs)
        return AsyncResponseStream(self._stub.Generate(req, timeout=timeout or self.timeout,
                                                       metadata=self._metadata))

    async def complete(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs) -> Completion:
        req = build_request(prompt, **kwargs)
        try:
            return Completion.from_pb(await self._stub.Complete(req, timeout=timeout or self.timeout,
                                                                metadata=self._metadata))
        except grpc.RpcError as exc:
            raise RequestError.from_rpc(exc) from None

    async def server_info(self, *, timeout: float | None = None) -> ServerInfo:
        try:
            r = await self._stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=timeout or self.timeout,
                                               metadata=self._metadata)
        except grpc.RpcError as exc:
            raise RequestError.from_rpc(exc) from None
        return ServerInfo.from_pb(r)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
