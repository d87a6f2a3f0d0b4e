"""The ``pdserve.v1.Generation`` gRPC service: one request's life from arrival to summary.

A request is tokenized and validated (``Preprocessor``), placed on a worker (``WorkerPool``:
one colocated worker, or a decode and a prefill worker), and its deltas come back through an
incremental detokenizer and the stop-string filter. The stream ends with the finish reason,
token counts and timings. Whatever way the handler ends (client cancel, deadline, stop string,
error), the request is closed on its workers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
import uuid
from typing import AsyncIterator

import grpc

from pdserve.decode_worker.messages import WorkerRequest
from pdserve.router.detokenizer import IncrementalDetokenizer
from pdserve.router.metrics import RequestObserver, RouterMetrics
from pdserve.router.preprocess import InvalidRequest, Preprocessor
from pdserve.router.stop import StopStringMatcher
from pdserve.router.errors import NoWorkers, Overloaded, PrefillFailed, TooLarge, WorkerDied, WorkerRejected
from pdserve.router.request_parser import MalformedRequest
from pdserve.router.worker_pool import WorkerPool
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}

# Leave this much of the client's deadline to answer RESOURCE_EXHAUSTED before it expires.
_DEADLINE_MARGIN_S = 0.05

# A request up to this size (serialized) is tokenized on the loop; a larger one on a pool thread.
INLINE_PREPARE_BYTES = 8 * 1024
# Threads that tokenize large inputs: two let a small request pass one huge input being tokenized.
TOKENIZER_THREADS = 2
_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _tokenizer_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="pdserve-tokenize")
    return _pool


class RequestFailed(Exception):
    """End the RPC with ``code`` and ``message``."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class GenerationService(pb_grpc.GenerationServicer):
    """Serves ``Generate``, ``Complete`` and ``GetServerInfo`` from a pool of workers."""

    def __init__(
        self,
        pool: WorkerPool,
        preprocessor: Preprocessor,
        server_info: pb.ServerInfo,
        queue_timeout_s: float = 30.0,
        metrics: RouterMetrics | None = None,
    ):
        self.pool = pool
        self.metrics = metrics
        self.preprocessor = preprocessor
        self._info = server_info
        self.queue_timeout_s = queue_timeout_s
        self.eos_token_ids = set(pool.model_info.get("eos_token_ids") or [])

    async def Generate(self, request, context) -> AsyncIterator[pb.GenerateResponse]:
        try:
            async for response in self.run(request, context):
                yield response
        except RequestFailed as exc:
            await context.abort(exc.code, exc.message)

    async def Complete(self, request, context) -> pb.CompleteResponse:
        out = pb.CompleteResponse()
        try:
            async for r in self.run(request, context):
                out.request_id = r.request_id
                out.text += r.text
                out.token_ids.extend(r.token_ids)
                out.logprobs.extend(r.logprobs)
                if r.finish_reason:
                    out.finish_reason = r.finish_reason
                    out.usage.CopyFrom(r.usage)
                    out.timings.CopyFrom(r.timings)
        except RequestFailed as exc:
            await context.abort(exc.code, exc.message)
        return out

    async def GetServerInfo(self, request, context) -> pb.ServerInfo:
        info = pb.ServerInfo()
        info.CopyFrom(self._info)
        info.num_decode_workers = self.pool.num_alive
        info.num_prefill_workers = self.pool.num_prefill_alive
        return info

    # ---- one request -----------------------------------------------------------------------

    def _queue_timeout(self, context) -> float:
        remaining = context.time_remaining()
        if remaining is None:
            return self.queue_timeout_s
        return max(0.0, min(self.queue_timeout_s, remaining - _DEADLINE_MARGIN_S))

    async def run(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:
        """One request's responses: the request path of both front ends (gRPC here, HTTP in
        ``openai_api``). Raises ``RequestFailed`` with the status to answer. ``context`` needs
        only ``time_remaining()``. Every response goes past the request's observer, and however
        the request ends (summary, error status, cancel, deadline) it is counted once."""
        obs = RequestObserver(self.metrics)
        responses = self._serve(request, context, obs)
        try:
            async for response in responses:
                obs.response(response)
                yield response
        except RequestFailed as exc:
            obs.failed(exc.code.name, exc.message)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            obs.failed("DEADLINE_EXCEEDED" if _deadline_passed(context) else "CANCELLED")
            raise
        except Exception as exc:
            obs.failed("UNKNOWN", repr(exc))
            raise
        finally:
            await responses.aclose()  # closes the request on its workers now, not when collected

    async def _serve(self, request: pb.GenerateRequest, context,
                     obs: RequestObserver) -> AsyncIterator[pb.GenerateResponse]:
        t_arrival = time.monotonic()
        if isinstance(request, MalformedRequest):
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            prepared = await self._prepare(request)
        except InvalidRequest as exc:
            raise RequestFailed(getattr(grpc.StatusCode, exc.code), str(exc)) from None
        request_id = uuid.uuid4().hex
        shown_id = prepared.client_request_id or request_id
        obs.started(shown_id, len(prepared.prompt_token_ids))
        # Workers measure their queue from `arrival_time` (wall clock, comparable across processes).
        t_created = time.monotonic()
        worker_request = WorkerRequest(
            request_id=request_id,
            prompt_token_ids=prepared.prompt_token_ids,
            params=prepared.params,
            arrival_time=time.time(),
        )
        try:
            stream = await self.pool.submit(worker_request, timeout=self._queue_timeout(context))
        except (Overloaded, NoWorkers, WorkerRejected, TooLarge) as exc:
            raise _failure(exc) from None
        t_placed = time.monotonic()

        detok = IncrementalDetokenizer(self.preprocessor.tokenizer, prepared.prompt_token_ids)
        stopper = StopStringMatcher(prepared.stop)
        t_first: float | None = None
        try:
            while True:
                try:
                    delta = await stream.next()
                except (WorkerDied, NoWorkers, Overloaded, WorkerRejected, PrefillFailed, TooLarge) as exc:
                    raise _failure(exc, running=True) from None
                if delta.finish_reason == "error":
                    raise RequestFailed(
                        grpc.StatusCode.INTERNAL,
                        f"the worker failed on this request: {delta.error or 'unknown error'}",
                    )
                if delta.token_ids and t_first is None:
                    t_first = time.monotonic()
                response = pb.GenerateResponse(request_id=shown_id)
                pieces: list[str] = []
                for i, token in enumerate(delta.token_ids):
                    response.token_ids.append(token)
                    if delta.logprobs:
                        response.logprobs.append(delta.logprobs[i])
                    if self._is_stop_token(token, prepared.params):
                        detok.num_output_tokens += 1
                        break
                    visible, stopped = stopper.feed(detok.add(token))
                    pieces.append(visible)
                    if stopped:
                        break
                finish = None
                if stopper.stopped:
                    finish = "stop"
                    stream.close()  # aborts it on the worker: frees its blocks now
                elif delta.finish_reason is not None:
                    visible, _ = stopper.feed(detok.flush())
                    pieces.append(visible)
                    pieces.append(stopper.flush())
                    finish = "stop" if stopper.stopped else delta.finish_reason
                response.text = "".join(pieces)
                if finish is not None:
                    response.finish_reason = FINISH_REASONS.get(finish, pb.FINISH_REASON_ABORT)
                    response.usage.prompt_tokens = len(prepared.prompt_token_ids)
                    response.usage.completion_tokens = detok.num_output_tokens
                    obs.worker_timings = stream.phase_timings(delta)
                    obs.kv_transfer_bytes = delta.kv_transfer_bytes
                    self._fill_timings(
                        response.timings, stream.phase_timings(delta), t_arrival, t_created, t_placed,
                        t_first, time.monotonic(),
                    )
                    yield response
                    return
                if response.token_ids or response.text:
                    yield response
        finally:
            stream.close()

    async def _prepare(self, request: pb.GenerateRequest):
        """Tokenize and validate. A large input (a long prompt, a long chat to render) is handled on
        a thread of the tokenizer pool, so the loop keeps streaming other requests meanwhile (the
        tokenizer releases the GIL; template rendering yields it); a small one costs less inline
        than the thread hop."""
        if request.ByteSize() <= INLINE_PREPARE_BYTES:
            return self.preprocessor.prepare(request)
        return await asyncio.get_running_loop().run_in_executor(_tokenizer_pool(), self.preprocessor.prepare, request)

    def _is_stop_token(self, token: int, params) -> bool:
        """Whether ``token`` ends the request as a stop token: like vLLM, its id is returned but
        its text is not (EOS tokens are special and decode to nothing anyway). It is the last
        token of its request; in disaggregated mode it can be token #1, whose delta comes from
        the prefill worker before the decode worker's final one."""
        return token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids)

    @staticmethod
    def _fill_timings(
        out: pb.Timings,
        worker: dict[str, float],
        t_arrival: float,
        t_created: float,
        t_placed: float,
        t_first: float | None,
        t_end: float,
    ) -> None:
        """Per-phase timings: the workers' own where they reported them, the router's otherwise.

        A worker measures its queue from the request's creation (``t_created``), placement
        included. Workers report their phases on their last delta (in disaggregated mode the
        prefill worker's queue and prefill come with token #1); a request ended by a stop string
        is aborted before the last delta, so what is missing is measured from the router.
        """
        out.e2e_s = t_end - t_arrival
        out.ttft_s = (t_first if t_first is not None else t_end) - t_arrival
        if "queued" in worker:
            out.queued_s = (t_created - t_arrival) + worker["queued"]
        else:
            out.queued_s = t_placed - t_arrival
        out.transfer_s = worker.get("transfer", 0.0)
        out.prefill_s = worker.get("prefill", max(0.0, out.ttft_s - out.queued_s - out.transfer_s))
        out.decode_s = worker.get("decode", max(0.0, out.e2e_s - out.ttft_s))


def _deadline_passed(context) -> bool:
    try:
        remaining = context.time_remaining()
    except Exception:  # the RPC is already torn down
        return False
    return remaining is not None and remaining <= 0


def _failure(exc: BaseException, running: bool = False) -> RequestFailed:
    """The gRPC status for a request the pool could not place or finish."""
    if isinstance(exc, TooLarge):
        return RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, Overloaded):
        return RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    if isinstance(exc, (NoWorkers, WorkerDied)):
        suffix = "; the request did not complete" if running else ""
        return RequestFailed(grpc.StatusCode.UNAVAILABLE, f"{exc}{suffix}")
    return RequestFailed(grpc.StatusCode.INTERNAL, str(exc))  # WorkerRejected, PrefillFailed
