"""The disaggregated flow of one request: reserve on a decode worker, prefill on a prefill worker.

1. ``submit`` places the request on a decode worker D, which reserves blocks for the prompt's KV
   cache (``reserve_kv``): ``WAITING`` -> ``RESERVED``. A full D is tried again as requests finish,
   until the request's queue timeout.
2. In the background a prefill worker P gets the request and D's address and block ids
   (``PREFILLING``); P computes the prompt, pushes its KV cache into D's blocks and answers with
   token #1, which becomes the stream's first delta (``PUSHING``).
3. D continues from token #1 once the whole KV cache has landed; its first token of its own moves
   the request to ``DECODING`` (the pool's long poll does that).

Failures: P dying before it answers means a fresh reservation under a new id and another P
(``PREFILLING`` -> ``WAITING``); P raising fails the request (``PrefillFailed``); D failing the
transfer after token #1 fails it with D's error, or ``WorkerDied`` when P died meanwhile. Every
failure frees the reservation before the client hears of it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from ray.exceptions import RayActorError

from pdserve.decode_worker.messages import RequestDelta, WorkerRequest
from pdserve.engine.block_allocator import OutOfBlocks
from pdserve.router.errors import (
    NoWorkers,
    Overloaded,
    PrefillFailed,
    TooLarge,
    WorkerDied,
    WorkerRejected,
    actor_reason,
)
from pdserve.router.placement import choose_prefill_worker
from pdserve.router.request_state import RequestState as S
from pdserve.router.request_stream import RequestStream

from pdserve.router.worker_pool import awaitable

if TYPE_CHECKING:
    from pdserve.router.worker_pool import Worker, WorkerPool


logger = logging.getLogger(__name__)


class DisaggregatedFlow:
    """Runs requests through a decode worker's reservation and a prefill worker's prefill.

    It decides nothing about placement (``placement``) and owns no worker (``WorkerPool``): it
    sequences the calls and moves each request's state.
    """

    def __init__(self, pool: "WorkerPool"):
        # Imported here: the prefill worker's module loads the engine (torch), which a router
        # that never runs in disaggregated mode does not need.
        from pdserve.decode_worker.worker import RequestAborted
        from pdserve.prefill_worker.worker import KVDestination

        self.pool = pool
        self._destination = KVDestination
        self._aborted = RequestAborted

    async def submit(self, request: WorkerRequest, timeout: float | None) -> RequestStream:
        """Reserve the prompt's blocks on a decode worker, start the prefill in the background
        and return the stream (token #1 will be its first delta)."""
        if not self.pool.replacing("prefill"):
            self.choose_prefill(request)  # fail now, not after reserving, when no prefill worker can take it
        deadline = None if timeout is None else time.monotonic() + timeout
        stream = RequestStream(self.pool.close_stream, request, disaggregated=True)
        blocks = await self._reserve(stream, request, deadline)
        stream.prefill_task = self.pool.spawn(self._run_prefill(stream, request, blocks, timeout))
        return stream

    async def resume(self, stream: RequestStream, request: WorkerRequest, timeout: float | None) -> None:
        """A migrating request's next attempt (``request``: prompt + tokens streamed so far):
        reserve, then prefill; its token #1 is the stream's next token."""
        deadline = None if timeout is None else time.monotonic() + timeout
        blocks = await self._reserve(stream, request, deadline)
        await self._run_prefill(stream, request, blocks, timeout)

    def choose_prefill(self, request: WorkerRequest) -> "Worker":
        """The prefill worker for ``request`` (``placement.choose_prefill_worker``)."""
        alive = self.pool.serving("prefill")
        if not alive:
            raise NoWorkers("no prefill worker is available")
        n = len(request.prompt_token_ids)
        name = choose_prefill_worker([w.load(self.pool.max_inflight_per_worker) for w in alive], n)
        if name is None:
            largest = max(w.stats.total_blocks * w.stats.block_size for w in alive)
            raise TooLarge(f"the prompt is {n} tokens but the largest prefill worker's KV cache holds "
                             f"{largest} tokens")
        return next(w for w in alive if w.name == name)

    async def _reserve(self, stream: RequestStream, request: WorkerRequest, deadline: float | None) -> list[int]:
        """Reserve the prompt's KV blocks on a decode worker and register ``stream`` there.

        A worker whose pool is full now (``OutOfBlocks``) is tried again, on fresh stats, as
        requests finish, until ``deadline`` (then ``Overloaded``); a dead one leaves the pool.
        """
        pool = self.pool
        num_tokens = len(request.prompt_token_ids) + request.params.max_tokens
        while True:
            worker = await pool.place(num_tokens, deadline)
            pool.register(stream, worker, 0, num_tokens)  # a decode worker prefills nothing
            ref = worker.actor.reserve_kv.remote(request)
            try:
                blocks = await ref
            except RayActorError as exc:
                pool.forget(stream)
                pool.mark_dead(worker, exc)
                continue
            except asyncio.CancelledError:
                pool.forget(stream)
                if stream.state is S.WAITING:  # (a migration that cancels it has moved it on)
                    stream.advance(S.ABORTED)
                # The reservation may land after this: release it once the call has answered.
                pool.spawn(pool.abort_after(ref, worker, request.request_id))
                raise
            except OutOfBlocks:
                pool.forget(stream, notify=False)  # no capacity came free: do not wake ourselves
                pool.invalidate_stats()  # place the retry on fresh stats
                await pool.admission.wait(
                    deadline,
                    "no decode worker had free KV blocks for the prompt for as long as the request "
                    "could wait; retry later",
                    poll_s=0.25,
                )
                continue
            except ValueError as exc:  # the worker says it can never hold the request
                pool.forget(stream)
                raise TooLarge(actor_reason(exc)) from None
            except Exception as exc:
                pool.forget(stream)
                if isinstance(exc, self._aborted):  # the router's own abort overtook the reservation
                    raise asyncio.CancelledError(f"request {request.request_id} was aborted") from None
                raise WorkerRejected(f"decode worker {worker.name} could not reserve KV blocks: "
                                     f"{actor_reason(exc)}") from exc
            stream.advance(S.RESERVED)
            return blocks

    async def _run_prefill(self, stream: RequestStream, request: WorkerRequest, blocks: list[int],
                           timeout: float | None) -> None:
        """Get token #1 from a prefill worker and put it at the head of ``stream``.

        A prefill worker that dies before answering is replaced: the decode worker's reservation
        is aborted and made afresh (under a new id, so nothing of the old attempt can reach the
        new one) and another prefill worker gets the request. Every failure frees the reservation.
        """
        pool = self.pool
        base_id = request.request_id
        for attempt in itertools.count(1):
            if stream.ended:  # the decode worker died, or the server is closing
                return
            decode = stream.worker
            try:
                prefill = await self._wait_for_prefill(request, timeout)
            except (NoWorkers, Overloaded, TooLarge) as exc:
                await self._fail_reserved(stream, exc)
                return
            stream.prefill_worker = prefill
            stream.advance(S.PREFILLING)
            prefill.inflight.add(request.request_id)
            prefill.unseen[request.request_id] = (len(request.prompt_token_ids), 0)
            try:
                first = await prefill.actor.prefill.remote(request, self._destination(decode.kv_address, blocks))
            except asyncio.CancelledError:
                pool.abort(prefill, request.request_id)
                raise
            except RayActorError as exc:
                pool.mark_dead(prefill, exc)
            except Exception as exc:
                await self._fail_reserved(stream, PrefillFailed(
                    f"prefill worker {prefill.name} failed on this request: {actor_reason(exc)}"))
                return
            else:
                stream.deliver_first(
                    RequestDelta(request.request_id, [first.token_id],
                                 [first.logprob] if request.params.logprobs else None),
                    first.timings,
                )
                if stream.state is S.PREFILLING:
                    stream.advance(S.PUSHING)
                return
            finally:
                prefill.inflight.discard(request.request_id)
                prefill.unseen.pop(request.request_id, None)

            # The prefill worker died before answering.
            if stream.state is not S.PREFILLING:
                # The decode worker got token #1 with the KV cache and went on, but the client
                # never got token #1 (it was in the dead worker's answer): start over elsewhere.
                cause = f"prefill worker {prefill.name} died before it reported token #1"
                if stream.ended:
                    await self._fail_reserved(stream, WorkerDied(cause))
                else:
                    pool.migrate(stream, cause)
                return
            logger.warning("request %s: prefill worker %s died; retrying on another", stream.request_id, prefill.name)
            stream.advance(S.WAITING)
            if pool.is_registered(stream):
                pool.forget(stream)
                await pool.abort(decode, stream.request_id)
            if pool.num_prefill_alive == 0 and not pool.replacing("prefill"):
                stream.fail(WorkerDied(f"prefill worker {prefill.name} died while serving this request "
                                       "and no prefill worker is left"))
                return
            request = replace(request, request_id=f"{base_id}~{attempt}")
            stream.restart(request.request_id)
            try:
                blocks = await self._reserve(stream, request, None if timeout is None else time.monotonic() + timeout)
            except (NoWorkers, Overloaded, TooLarge, WorkerRejected) as exc:
                stream.fail(exc)
                return

    async def _wait_for_prefill(self, request: WorkerRequest, timeout: float | None) -> "Worker":
        """``choose_prefill``, waiting (up to ``timeout``) while a dead prefill worker is being
        replaced and none is left."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return self.choose_prefill(request)
            except NoWorkers:
                if not self.pool.replacing("prefill"):
                    raise
            await self.pool.admission.wait(deadline, "no prefill worker came back for as long as the request "
                                           "could wait; retry later", poll_s=0.5)

    async def _fail_reserved(self, stream: RequestStream, exc: BaseException) -> None:
        """End a request whose prefill failed: its reservation goes back, then the client gets
        ``exc`` (so an error the client sees means the blocks are already free)."""
        if self.pool.is_registered(stream):
            self.pool.forget(stream)
            await self.pool.abort(stream.worker, stream.request_id)
        # Even an ended request gets it: what ended it may be held behind the token #1 that
        # will now never come.
        stream.fail(exc)

    async def explain_transfer_failure(self, stream: RequestStream, delta: RequestDelta) -> None:
        """The decode worker failed a request before decoding a token of its own: the KV
        transfer failed. If token #1 had not come out and the prefill worker died, its own call
        retries it; otherwise the request migrates (prompt and token #1 are prefilled again),
        the cause naming the prefill worker's death or the decode worker's error."""
        pool = self.pool
        prefill = stream.prefill_worker
        attempt = stream.request_id
        dead = prefill is not None and not prefill.alive
        if prefill is not None and prefill.alive:
            try:
                await asyncio.wait_for(awaitable(prefill.actor.ready.remote()), pool.stats_timeout_s)
            except RayActorError as exc:
                dead = True
                pool.mark_dead(prefill, exc)
            except Exception:
                pass  # slow: report the decode worker's error as it is
        if stream.request_id != attempt or stream.ended:
            return  # retried meanwhile (this failure was the old attempt's), or already over
        if dead and stream.state is S.PREFILLING:
            return  # token #1 never came out: _run_prefill sees the death and retries
        if dead:
            pool.migrate(stream, f"prefill worker {prefill.name} died while sending this request's KV cache")
        else:
            pool.migrate(stream, f"the KV transfer failed: {delta.error or 'unknown error'}")
