"""The router's end of one request: its state, and its deltas in the order the client sees them."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from pdserve.decode_worker.messages import RequestDelta, WorkerRequest
from pdserve.router.request_state import RequestState, check_transition

if TYPE_CHECKING:
    from pdserve.router.worker_pool import Worker

logger = logging.getLogger(__name__)


class RequestStream:
    """One request in the pool: its ``state``, the workers that hold it, and a queue of deltas.

    ``worker`` is the (decode or colocated) worker whose long poll brings the request's deltas and
    ``request_id`` its id there. In disaggregated mode token #1 comes from the prefill worker's
    reply instead, and the decode worker's deltas (tokens #2.., or the end of a one-token request)
    can overtake that reply: they are held back until token #1 is in the queue. Errors are never
    held.

    The consumer (``router.service``) calls ``next`` and ``close``; the pool feeds the stream with
    ``push``, ``deliver_first`` and ``fail`` and moves its state with ``advance``.
    """

    def __init__(self, on_close: Any, request: WorkerRequest, *, disaggregated: bool = False):
        self._on_close = on_close  # the pool's close_stream
        self.request = request  # as the client sent it: a migration derives its next attempt from it
        self.request_id = request.request_id  # the current attempt's id on its workers
        self.state = RequestState.WAITING
        self.worker: Worker | None = None
        self.disaggregated = disaggregated
        self._queue: asyncio.Queue[RequestDelta | BaseException] = asyncio.Queue()
        self._held: list[RequestDelta] | None = [] if disaggregated else None
        self.delivered: list[int] = []  # token ids queued for the consumer, in order, every attempt
        self.migrations = 0  # attempts started after a worker failed it
        self.migration_task: asyncio.Task | None = None
        # Disaggregated mode only:
        self.prefill_worker: Worker | None = None
        self.prefill_task: asyncio.Task | None = None
        self.prefill_timings: dict[str, float] = {}  # queued, prefill: measured by the prefill worker

    @property
    def ended(self) -> bool:
        """Whether the request is in an end state (it holds nothing on any worker)."""
        return self.state.ended

    # ---- the consumer's side --------------------------------------------------------------

    async def next(self) -> RequestDelta:
        """The next delta; raises the pool's exception (``WorkerDied`` ...) if the request failed."""
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def phase_timings(self, last: RequestDelta) -> dict[str, float]:
        """Worker-side phases of the request that ``last`` ended: the decode (or colocated)
        worker's from its final delta, the prefill worker's queue and prefill over them."""
        return {**last.timings, **self.prefill_timings}

    def close(self) -> None:
        """The consumer is done with the request: unless it ended, abort it on its workers
        (freeing its blocks). Safe to call more than once."""
        self._on_close(self)

    # ---- the pool's side ------------------------------------------------------------------

    def advance(self, new: RequestState) -> None:
        """Move to ``new``; ``InvalidTransition`` if ``request_state.TRANSITIONS`` forbids it."""
        check_transition(self.state, new)
        logger.debug("request %s: %s -> %s", self.request_id, self.state.value, new.value)
        self.state = new

    def push(self, delta: RequestDelta) -> None:
        """A delta from the decode (or colocated) worker: queued, or held until token #1 is."""
        if self._held is not None:
            self._held.append(delta)
        else:
            self._deliver(delta)

    def _deliver(self, delta: RequestDelta) -> None:
        self.delivered += delta.token_ids
        self._queue.put_nowait(delta)

    def fail(self, exc: BaseException) -> None:
        """End the request with ``exc`` for the consumer (never held back). The caller has freed
        what the request held on the workers."""
        self._queue.put_nowait(exc)
        if not self.ended:
            self.advance(RequestState.FAILED)

    def deliver_first(self, delta: RequestDelta, timings: dict[str, float]) -> None:
        """Token #1 is in (from the prefill worker): queue it, then what the decode worker sent
        meanwhile."""
        self.prefill_timings = dict(timings)
        self._deliver(delta)
        held, self._held = self._held or [], None
        for item in held:
            self._deliver(item)

    def restart(self, request_id: str) -> None:
        """A new attempt under a new id (its prefill worker died before token #1, or a migration):
        whatever the old attempt's workers sent and the consumer has not got is dropped."""
        self.request_id = request_id
        self._held = [] if self.disaggregated else None
