"""The router's view of its worker actors: placement, admission and the delta streams.

One ``next_outputs()`` call is kept in flight per worker (a long poll); every delta it returns
is routed to the queue of its request. A worker whose actor dies fails its requests with
``WorkerDied`` and leaves the pool. Placement asks ``placement.choose_worker`` with the load
each worker last reported plus what the router sent it since.

Both modes share that one delta path. Colocated: ``add_request`` on a worker, which prefills and
decodes. Disaggregated (the pool also has prefill workers): the decode worker D reserves the
prompt's KV blocks (``reserve_kv``), a prefill worker P computes the prompt and pushes its KV into
them, and P's reply (token #1) enters the request's stream ahead of D's deltas (tokens #2..),
which are held back until it has (see ``RequestStream``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ray.exceptions import RayActorError

from pdserve.decode_worker.messages import RequestDelta, WorkerRequest, WorkerStats
from pdserve.engine.block_allocator import OutOfBlocks
from pdserve.router.placement import (
    WorkerLoad,
    blocks_needed,
    choose_prefill_worker,
    choose_worker,
    fits_at_all,
)

logger = logging.getLogger(__name__)


class NoWorkers(RuntimeError):
    """No live worker is left in the pool."""


class Overloaded(RuntimeError):
    """No worker could take the request within the time allowed (or it can never fit)."""


class WorkerDied(RuntimeError):
    """The worker serving a request died before the request finished."""


class WorkerRejected(RuntimeError):
    """The worker raised on ``add_request``: a bug or a check the router does not know."""


class PrefillFailed(RuntimeError):
    """The prefill worker raised on the request (it is alive; the request cannot go on)."""


async def _awaitable(ref):
    return await ref


def _reason(exc: BaseException) -> str:
    """The message of an exception raised in an actor, without Ray's traceback around it."""
    return str(getattr(exc, "cause", None) or exc)


@dataclass
class _Worker:
    name: str
    actor: Any  # ray.actor.ActorHandle
    info: dict
    stats: WorkerStats
    role: str = "colocated"  # "colocated", "decode" or "prefill"
    kv_address: str | None = None  # decode role: where prefill workers push KV
    inflight: set[str] = field(default_factory=set)
    sent_tokens: int = 0  # prompt tokens sent since `stats` was taken
    sent_blocks: int = 0  # KV blocks those requests will need
    alive: bool = True
    poll_task: asyncio.Task | None = None
    draining: bool = False  # being scaled away: no new requests, running ones finish

    def load(self, max_inflight: int) -> WorkerLoad:
        s = self.stats
        return WorkerLoad(
            name=self.name,
            queued_prompt_tokens=s.queued_prompt_tokens + self.sent_tokens,
            num_running=s.num_running,
            free_blocks=s.free_blocks - self.sent_blocks,
            total_blocks=s.total_blocks,
            block_size=s.block_size,
            inflight=len(self.inflight),
            max_inflight=max_inflight,
        )


class RequestStream:
    """The router's end of one request: its deltas, in order.

    ``worker`` is the worker whose long poll brings the deltas and ``request_id`` the request's id
    there. In disaggregated mode token #1 comes from the prefill worker's reply instead, and the
    decode worker's deltas (tokens #2.., or the end of a one-token request) can overtake that
    reply: they are held back until token #1 is in the queue. Errors are never held.
    """

    def __init__(self, pool: "WorkerPool", worker: _Worker, request_id: str, awaiting_first: bool = False):
        self._pool = pool
        self.worker = worker
        self.request_id = request_id
        self._queue: asyncio.Queue[RequestDelta | BaseException] = asyncio.Queue()
        self._held: list[RequestDelta | BaseException] | None = [] if awaiting_first else None
        self.finished = False  # the consumer has seen the end of the request
        self.closed = False
        # Disaggregated mode only:
        self.prefill_worker: _Worker | None = None
        self.prefill_task: asyncio.Task | None = None
        self.prefill_timings: dict[str, float] = {}  # queued, prefill: measured by the prefill worker
        self.decode_started = False  # the decode worker has sent a token of its own

    async def next(self) -> RequestDelta:
        """The next delta; raises ``WorkerDied`` if the worker died meanwhile."""
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finish_reason is not None:
            self.finished = True
        return item

    def phase_timings(self, last: RequestDelta) -> dict[str, float]:
        """Worker-side phases of the request that ``last`` ended: the decode (or colocated)
        worker's from its final delta, the prefill worker's queue and prefill over them."""
        return {**last.timings, **self.prefill_timings}

    def close(self) -> None:
        """Forget the request; abort it on the workers (freeing its blocks) unless it finished."""
        if not self.closed:
            self.closed = True
            self._pool._close(self)

    # ---- fed by the pool -------------------------------------------------------------------

    def _push(self, item: RequestDelta | BaseException) -> None:
        if self._held is not None:
            self._held.append(item)
        else:
            self._queue.put_nowait(item)

    def _fail(self, exc: BaseException) -> None:
        self._queue.put_nowait(exc)

    def _deliver_first(self, delta: RequestDelta, timings: dict[str, float]) -> None:
        """Token #1 is in: queue it, then what the decode worker sent meanwhile."""
        self.prefill_timings = dict(timings)
        self._queue.put_nowait(delta)
        held, self._held = self._held or [], None
        for item in held:
            self._queue.put_nowait(item)

    def _restart(self, request_id: str) -> None:
        """A new attempt under a new id: what the old one's decode worker sent is dropped."""
        self.request_id = request_id
        self._held = []
        self.decode_started = False


class WorkerPool:
    """Worker actors behind the router, with placement and admission control.

    ``actors`` are the colocated workers or, when ``prefill_actors`` is given (disaggregated
    mode), the decode workers. ``max_inflight_per_worker`` caps the requests the router keeps on
    one (colocated or decode) worker; a request that finds every worker at the cap waits (at most
    ``max_waiting`` requests wait) until one finishes or its time runs out.
    """

    def __init__(
        self,
        actors: list,
        *,
        prefill_actors: list | None = None,
        max_inflight_per_worker: int = 256,
        max_waiting: int = 1024,
        stats_ttl_s: float = 0.05,
        stats_timeout_s: float = 2.0,
        on_change: Callable[[bool], None] | None = None,
    ):
        if not actors:
            raise ValueError("a worker pool needs at least one worker actor")
        if prefill_actors is not None and not prefill_actors:
            raise ValueError("a disaggregated worker pool needs at least one prefill worker actor")
        self._actors = list(actors)
        self._prefill_actors = list(prefill_actors or [])
        self.disaggregated = prefill_actors is not None
        self.max_inflight_per_worker = max_inflight_per_worker
        self.max_waiting = max_waiting
        self.stats_ttl_s = stats_ttl_s
        self.stats_timeout_s = stats_timeout_s
        self._on_change = on_change
        self._workers: list[_Worker] = []  # colocated or decode workers: the ones polled
        self._prefill: list[_Worker] = []
        self._streams: dict[str, RequestStream] = {}
        self._capacity = asyncio.Condition()
        self._num_waiting = 0
        self._stats_time = 0.0
        self._stats_lock = asyncio.Lock()
        self._background: set[asyncio.Task] = set()
        self._kv_destination: Any = None  # prefill_worker.worker.KVDestination, imported in start()
        self.model_info: dict = {}

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Ask every worker for its model and load, check they agree, start the long polls."""
        actors = self._actors + self._prefill_actors
        infos = await asyncio.gather(*(a.model_info.remote() for a in actors))
        stats = await asyncio.gather(*(a.stats.remote() for a in actors))
        keys = ("model", "max_model_len", "vocab_size") + (("block_size",) if self.disaggregated else ())
        for info in infos[1:]:
            if any(info.get(k) != infos[0].get(k) for k in keys):
                raise ValueError(f"workers serve different models: {infos[0]} vs {info}")
        self.model_info = dict(infos[0])
        role = "decode" if self.disaggregated else "colocated"
        addresses: list = [None] * len(self._actors)
        if self.disaggregated:
            from pdserve.prefill_worker.worker import KVDestination

            self._kv_destination = KVDestination
            addresses = await asyncio.gather(*(a.kv_address.remote() for a in self._actors))
            if None in addresses:
                raise ValueError("a decode worker has no KV receiver: start decode workers with role='decode'")
        seen: set[str] = set()
        for i, (actor, info, st) in enumerate(zip(actors, infos, stats)):
            name = st.name or f"worker-{i}"
            if name in seen:
                name = f"{name}-{i}"
            seen.add(name)
            if i < len(self._actors):
                self._workers.append(_Worker(name, actor, info, st, role=role, kv_address=addresses[i]))
            else:
                self._prefill.append(_Worker(name, actor, info, st, role="prefill"))
        self._stats_time = time.monotonic()
        for w in self._workers:
            w.poll_task = asyncio.create_task(self._poll(w), name=f"poll-{w.name}")
        self._changed()

    async def close(self) -> None:
        """Stop the long polls and fail what is still running (the actors stay up)."""
        tasks = [w.poll_task for w in self._workers if w.poll_task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in list(self._streams.values()):
            stream._fail(NoWorkers("the server is shutting down"))
        for t in list(self._background):
            t.cancel()

    @property
    def num_alive(self) -> int:
        """Live colocated workers, or live decode workers in disaggregated mode."""
        return sum(w.alive for w in self._workers)

    @property
    def num_prefill_alive(self) -> int:
        return sum(w.alive for w in self._prefill)

    @property
    def can_serve(self) -> bool:
        """Whether a request could be served now: a live worker of every role the mode needs."""
        return self.num_alive > 0 and (not self.disaggregated or self.num_prefill_alive > 0)

    def worker_names(self) -> list[str]:
        return [w.name for w in self._workers if w.alive]

    def prefill_worker_names(self) -> list[str]:
        return [w.name for w in self._prefill if w.alive]

    def loads(self) -> list[WorkerLoad]:
        return [w.load(self.max_inflight_per_worker) for w in self._workers if w.alive]

    def worker_snapshot(self) -> list[tuple[str, str, bool, WorkerStats]]:
        """``(role, name, alive, last stats)`` of every worker, prefill workers included (metrics)."""
        return [(w.role, w.name, w.alive, w.stats) for w in self._workers + self._prefill]

    @property
    def num_waiting(self) -> int:
        """Requests waiting in the router for a worker with room."""
        return self._num_waiting

    async def refresh_stats(self) -> None:
        """Ask every live worker for its stats now, whatever their age (a metrics scrape)."""
        self._stats_time = 0.0
        await self._refresh_stats()

    # ---- requests --------------------------------------------------------------------------

    async def submit(self, request: WorkerRequest, timeout: float | None) -> RequestStream:
        """Place ``request`` and return its stream.

        Waits up to ``timeout`` seconds (``None``: no limit) for a worker with room; raises
        ``Overloaded`` when none had room in time, ``NoWorkers`` when the pool is empty. In
        disaggregated mode it returns once the decode worker has reserved the prompt's blocks;
        the prefill runs in the background and its token #1 is the stream's first delta.
        """
        if self.disaggregated:
            return await self._submit_disaggregated(request, timeout)
        num_tokens = len(request.prompt_token_ids) + request.params.max_tokens
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            worker = await self._place(num_tokens, deadline)
            stream = RequestStream(self, worker, request.request_id)
            # Register before sending: the first delta may come back before the call returns.
            self._register(stream, worker, len(request.prompt_token_ids), num_tokens)
            try:
                await worker.actor.add_request.remote(request)
            except RayActorError as exc:
                self._forget(stream)
                self._mark_dead(worker, exc)
                continue  # try another worker
            except asyncio.CancelledError:
                stream.close()
                raise
            except Exception as exc:
                self._forget(stream)
                raise WorkerRejected(f"worker {worker.name} rejected the request: {_reason(exc)}") from exc
            return stream

    def _register(self, stream: RequestStream, worker: _Worker, prompt_tokens: int, num_tokens: int) -> None:
        stream.worker = worker
        self._streams[stream.request_id] = stream
        worker.inflight.add(stream.request_id)
        worker.sent_tokens += prompt_tokens
        worker.sent_blocks += blocks_needed(num_tokens, worker.stats.block_size)

    async def _place(self, num_tokens: int, deadline: float | None) -> _Worker:
        while True:
            await self._refresh_stats()
            alive = [w for w in self._workers if w.alive and not w.draining]
            if not alive:
                raise NoWorkers("no worker is available" if not self.disaggregated
                                else "no decode worker is available")
            loads = [w.load(self.max_inflight_per_worker) for w in alive]
            if not any(fits_at_all(l, num_tokens) for l in loads):
                largest = max(l.total_blocks * l.block_size for l in loads)
                raise Overloaded(
                    f"the request needs room for {num_tokens} tokens (prompt + max_tokens) but "
                    f"the largest worker's KV cache holds {largest} tokens"
                )
            name = choose_worker(loads, num_tokens)
            if name is not None:
                return next(w for w in alive if w.name == name)
            await self._wait_for_capacity(
                deadline,
                f"every worker stayed at its limit of {self.max_inflight_per_worker} "
                "requests for as long as the request could wait; retry later",
            )

    async def _wait_for_capacity(self, deadline: float | None, timeout_message: str, poll_s: float | None = None) -> None:
        """Wait until a request finishes somewhere (or ``poll_s`` passes); ``Overloaded`` when
        the wait queue is full or ``deadline`` has passed."""
        if self._num_waiting >= self.max_waiting:
            raise Overloaded(
                f"every worker is at its limit of {self.max_inflight_per_worker} requests and "
                f"{self._num_waiting} requests are already waiting; retry later"
            )
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise Overloaded(timeout_message)
        if poll_s is not None:
            remaining = poll_s if remaining is None else min(remaining, poll_s)
        self._num_waiting += 1
        try:
            async with self._capacity:
                await asyncio.wait_for(self._capacity.wait(), remaining)
        except asyncio.TimeoutError:
            pass  # the caller looks again; past the deadline the check above raises
        finally:
            self._num_waiting -= 1

    async def _refresh_stats(self) -> None:
        if time.monotonic() - self._stats_time < self.stats_ttl_s:
            return
        async with self._stats_lock:
            if time.monotonic() - self._stats_time < self.stats_ttl_s:
                return
            alive = [w for w in self._workers + self._prefill if w.alive]
            sent_before = {w.name: (w.sent_tokens, w.sent_blocks) for w in alive}
            results = await asyncio.gather(
                *(asyncio.wait_for(_awaitable(w.actor.stats.remote()), self.stats_timeout_s) for w in alive),
                return_exceptions=True,
            )
            for w, res in zip(alive, results):
                if isinstance(res, RayActorError):
                    self._mark_dead(w, res)
                elif isinstance(res, BaseException):  # slow or failing: place on the last stats
                    logger.warning("stats() failed on %s: %r", w.name, res)
                else:
                    w.stats = res
                    tokens, blocks = sent_before[w.name]
                    w.sent_tokens -= tokens
                    w.sent_blocks -= blocks
            self._stats_time = time.monotonic()

    # ---- disaggregated: reserve on a decode worker, prefill on a prefill worker ---------------

    async def _submit_disaggregated(self, request: WorkerRequest, timeout: float | None) -> RequestStream:
        self._choose_prefill(request)  # fail now (not after reserving) when no prefill worker can take it
        deadline = None if timeout is None else time.monotonic() + timeout
        stream = RequestStream(self, None, request.request_id, awaiting_first=True)  # type: ignore[arg-type]
        blocks = await self._reserve(stream, request, deadline)
        stream.prefill_task = self._spawn(self._run_prefill(stream, request, blocks, timeout))
        return stream

    def _choose_prefill(self, request: WorkerRequest) -> _Worker:
        alive = [w for w in self._prefill if w.alive and not w.draining]
        if not alive:
            raise NoWorkers("no prefill worker is available")
        n = len(request.prompt_token_ids)
        name = choose_prefill_worker([w.load(self.max_inflight_per_worker) for w in alive], n)
        if name is None:
            largest = max(w.stats.total_blocks * w.stats.block_size for w in alive)
            raise Overloaded(f"the prompt is {n} tokens but the largest prefill worker's KV cache holds "
                             f"{largest} tokens")
        return next(w for w in alive if w.name == name)

    async def _reserve(self, stream: RequestStream, request: WorkerRequest, deadline: float | None) -> list[int]:
        """Reserve the prompt's KV blocks on a decode worker and register ``stream`` there.

        A worker whose pool is full now (``OutOfBlocks``) is tried again, on fresh stats, as
        requests finish, until ``deadline`` (then ``Overloaded``); a dead one leaves the pool.
        """
        num_tokens = len(request.prompt_token_ids) + request.params.max_tokens
        while True:
            worker = await self._place(num_tokens, deadline)
            self._register(stream, worker, 0, num_tokens)  # a decode worker prefills nothing
            ref = worker.actor.reserve_kv.remote(request)
            try:
                return await ref
            except RayActorError as exc:
                self._forget(stream)
                self._mark_dead(worker, exc)
            except asyncio.CancelledError:
                self._forget(stream)
                # The reservation may land after this: release it once the call has answered.
                self._spawn(self._abort_after(ref, worker, request.request_id))
                raise
            except OutOfBlocks:
                self._forget(stream, notify=False)  # no capacity came free: do not wake ourselves
                self._stats_time = 0.0  # place the retry on fresh stats
                await self._wait_for_capacity(
                    deadline,
                    "no decode worker had free KV blocks for the prompt for as long as the request "
                    "could wait; retry later",
                    poll_s=0.25,
                )
            except ValueError as exc:  # the worker says it can never hold the request
                self._forget(stream)
                raise Overloaded(_reason(exc)) from None
            except Exception as exc:
                self._forget(stream)
                raise WorkerRejected(f"decode worker {worker.name} could not reserve KV blocks: {_reason(exc)}") from exc

    async def _run_prefill(self, stream: RequestStream, request: WorkerRequest, blocks: list[int],
                       timeout: float | None) -> None:
        """Get token #1 from a prefill worker and put it at the head of ``stream``.

        A prefill worker that dies is replaced: the decode worker's reservation is aborted and
        made afresh (under a new id, so nothing of the old attempt can reach the new one) and
        another prefill worker gets the request. Every failure frees the reservation.
        """
        base_id = request.request_id
        for attempt in itertools.count(1):
            decode = stream.worker
            try:
                prefill = self._choose_prefill(request)
            except (NoWorkers, Overloaded) as exc:
                await self._fail_reserved(stream, exc)
                return
            stream.prefill_worker = prefill
            prefill.inflight.add(request.request_id)
            prefill.sent_tokens += len(request.prompt_token_ids)
            try:
                dest = self._kv_destination(decode.kv_address, blocks)
                first = await prefill.actor.prefill.remote(request, dest)
            except asyncio.CancelledError:
                self._abort(prefill, request.request_id)
                raise
            except RayActorError as exc:
                self._mark_dead(prefill, exc)
            except Exception as exc:
                await self._fail_reserved(stream, PrefillFailed(
                    f"prefill worker {prefill.name} failed on this request: {_reason(exc)}"))
                return
            else:
                stream._deliver_first(
                    RequestDelta(request.request_id, [first.token_id],
                                 [first.logprob] if request.params.logprobs else None),
                    first.timings,
                )
                return
            finally:
                prefill.inflight.discard(request.request_id)

            # The prefill worker died before answering: start over on a fresh reservation.
            logger.warning("request %s: prefill worker %s died; retrying on another", stream.request_id, prefill.name)
            if self._streams.get(stream.request_id) is stream:
                self._forget(stream)
                await self._abort(decode, stream.request_id)
            if self.num_prefill_alive == 0:
                stream._fail(WorkerDied(f"prefill worker {prefill.name} died while serving this request "
                                        "and no prefill worker is left"))
                return
            request = dataclasses.replace(request, request_id=f"{base_id}~{attempt}")
            stream._restart(request.request_id)
            try:
                blocks = await self._reserve(stream, request, None if timeout is None else time.monotonic() + timeout)
            except (NoWorkers, Overloaded, WorkerRejected) as exc:
                stream._fail(exc)
                return

    async def _fail_reserved(self, stream: RequestStream, exc: BaseException) -> None:
        """End a request whose prefill failed: its reservation goes back, then the client gets
        ``exc`` (so an error the client sees means the blocks are already free)."""
        if self._streams.get(stream.request_id) is stream:
            self._forget(stream)
            await self._abort(stream.worker, stream.request_id)
        stream._fail(exc)

    async def _explain_transfer_failure(self, stream: RequestStream, delta: RequestDelta) -> None:
        """The decode worker failed a request before decoding any token of its own: the KV
        transfer failed. If the prefill worker died meanwhile, say so (the client may retry)."""
        prefill = stream.prefill_worker
        attempt = stream.request_id
        dead: BaseException | None = None
        if prefill is not None and prefill.alive:
            try:
                await asyncio.wait_for(_awaitable(prefill.actor.ready.remote()), self.stats_timeout_s)
            except RayActorError as exc:
                dead = exc
                self._mark_dead(prefill, exc)
            except Exception:
                pass  # slow: report the decode worker's error as it is
        elif prefill is not None:
            dead = RuntimeError("dead")
        if stream.request_id != attempt:
            return  # the request was retried meanwhile: this failure is the old attempt's
        if dead is not None:
            stream._push(WorkerDied(f"prefill worker {prefill.name} died while sending this request's KV cache"))
        else:
            stream._push(delta)

    # ---- runtime scaling (router/scaling.py decides; these act) -----------------------------

    def num_serving(self, role: str) -> int:
        """Live workers of ``role`` ("prefill", or the polled role) that take new requests."""
        workers = self._prefill if role == "prefill" else self._workers
        return sum(w.alive and not w.draining for w in workers)

    async def add_workers(self, actors: list, role: str) -> list[str]:
        """Bring started actors of ``role`` into placement; returns their names. Their model
        must be the pool's, and decode workers need a KV receiver."""
        polled = "decode" if self.disaggregated else "colocated"
        if role not in ("prefill", polled) or (role == "prefill" and not self.disaggregated):
            raise ValueError(f"a {'disaggregated' if self.disaggregated else 'colocated'} pool has no {role} workers")
        infos = await asyncio.gather(*(a.model_info.remote() for a in actors))
        stats = await asyncio.gather(*(a.stats.remote() for a in actors))
        keys = ("model", "max_model_len", "vocab_size") + (("block_size",) if self.disaggregated else ())
        for info in infos:
            if any(info.get(k) != self.model_info.get(k) for k in keys):
                raise ValueError(f"the new worker serves another model: {info} vs {self.model_info}")
        addresses: list = [None] * len(actors)
        if role == "decode":
            addresses = await asyncio.gather(*(a.kv_address.remote() for a in actors))
            if None in addresses:
                raise ValueError("a new decode worker has no KV receiver (start it with role='decode')")
        taken = {w.name for w in self._workers + self._prefill}
        names = []
        for actor, info, st, address in zip(actors, infos, stats, addresses):
            name = st.name or f"worker-{len(taken)}"
            while name in taken:
                name = f"{name}+"
            taken.add(name)
            w = _Worker(name, actor, info, st, role=role, kv_address=address)
            if role == "prefill":
                self._prefill.append(w)
            else:
                self._workers.append(w)
                w.poll_task = asyncio.create_task(self._poll(w), name=f"poll-{w.name}")
            names.append(name)
        await self._notify_capacity()  # requests waiting for room may fit now
        self._changed()
        return names

    async def remove_workers(self, role: str, count: int, drain_timeout_s: float | None) -> tuple[list, list[str], int]:
        """Drain ``count`` workers of ``role`` (the least loaded) and take them out of the pool.

        Draining workers get no new requests; the call waits until their running requests have
        finished (for a prefill worker: until every KV cache it computed has reached its decode
        worker) or ``drain_timeout_s`` has passed, when what still runs on them fails with
        ``WorkerDied``. Returns ``(actors, names, number of requests cut)``: stopping the actors
        is the caller's job.
        """
        workers = self._prefill if role == "prefill" else self._workers
        candidates = sorted((w for w in workers if w.alive and not w.draining), key=lambda w: len(w.inflight))
        chosen = candidates[:count]
        for w in chosen:
            w.draining = True
        deadline = None if drain_timeout_s is None else time.monotonic() + drain_timeout_s
        while True:
            busy = [w for w in chosen if w.alive and await self._still_busy(w)]
            if not busy or (deadline is not None and time.monotonic() >= deadline):
                break
            await asyncio.sleep(0.05)
        cut = 0
        for w in chosen:
            streams = [s for s in self._streams.values() if s.worker is w or
                       (s.prefill_worker is w and not s.decode_started)]
            for stream in streams:
                cut += 1
                stream._fail(WorkerDied(f"worker {w.name} was scaled away before this request finished "
                                        f"(its drain timed out after {drain_timeout_s} s)"))
                stream.close()  # frees its blocks on the workers that are staying
            w.alive = False  # retired: a late RayActorError is not news
            if w.poll_task is not None:
                w.poll_task.cancel()
        await asyncio.gather(*(w.poll_task for w in chosen if w.poll_task is not None), return_exceptions=True)
        for w in chosen:
            workers.remove(w)
        self._changed()
        return [w.actor for w in chosen], [w.name for w in chosen], cut

    async def _still_busy(self, w: _Worker) -> bool:
        if w.role != "prefill":
            return bool(w.inflight)
        if w.inflight or any(s.prefill_worker is w and not s.decode_started for s in self._streams.values()):
            return True
        try:  # the router's view is clear; the worker's own queue settles it
            st = await asyncio.wait_for(_awaitable(w.actor.stats.remote()), self.stats_timeout_s)
        except RayActorError:
            return False
        except Exception:
            return True
        return st.num_running > 0 or st.num_waiting > 0

    # ---- the long poll ---------------------------------------------------------------------

    async def _poll(self, w: _Worker) -> None:
        while w.alive:
            try:
                deltas = await w.actor.next_outputs.remote()
            except asyncio.CancelledError:
                raise
            except RayActorError as exc:
                self._mark_dead(w, exc)
                return
            except Exception as exc:  # a bug in the worker: it can no longer serve
                logger.exception("next_outputs() failed on %s", w.name)
                self._mark_dead(w, exc)
                return
            if not deltas:
                await asyncio.sleep(0.001)  # a worker that answers empty at once must not spin us
                continue
            for d in deltas:
                stream = self._streams.get(d.request_id)
                if stream is None:
                    continue  # closed by the router (stop string, client gone)
                if d.token_ids:
                    stream.decode_started = True
                if d.finish_reason == "error" and stream.prefill_worker is not None and not stream.decode_started:
                    self._spawn(self._explain_transfer_failure(stream, d))
                else:
                    stream._push(d)
                if d.finish_reason is not None:
                    self._forget(stream)

    # ---- bookkeeping -----------------------------------------------------------------------

    def _close(self, stream: RequestStream) -> None:
        was_registered = self._streams.get(stream.request_id) is stream
        self._forget(stream)
        # Submit aborts now, even from a handler being cancelled; only the answers are awaited later.
        if stream.prefill_task is not None:
            p = stream.prefill_worker
            if not stream.prefill_task.done():
                stream.prefill_task.cancel()  # aborts the prefill if it is waiting for one
            elif not stream.finished and p is not None and p.alive:
                self._abort(p, stream.request_id)  # it may still be sending the KV
        if was_registered and not stream.finished and stream.worker.alive:
            self._abort(stream.worker, stream.request_id)

    def _forget(self, stream: RequestStream, notify: bool = True) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
        if stream.worker is not None and stream.request_id in stream.worker.inflight:
            stream.worker.inflight.discard(stream.request_id)
            if notify:
                self._spawn(self._notify_capacity())

    def _abort(self, w: _Worker, request_id: str) -> asyncio.Task:
        """Abort a request on a worker. The call is sent now, even from a task being cancelled;
        the returned task awaits its answer."""
        return self._spawn(self._abort_done(w, request_id, w.actor.abort.remote(request_id)))

    async def _abort_done(self, w: _Worker, request_id: str, ref) -> None:
        try:
            await ref
        except RayActorError:
            pass  # the worker is gone, and its blocks with it
        except Exception:
            logger.exception("abort(%s) failed on %s", request_id, w.name)

    async def _abort_after(self, ref, w: _Worker, request_id: str) -> None:
        try:
            await ref
        except Exception:
            return  # nothing was reserved
        await self._abort(w, request_id)

    async def _notify_capacity(self) -> None:
        async with self._capacity:
            self._capacity.notify_all()

    def _mark_dead(self, w: _Worker, exc: BaseException) -> None:
        if not w.alive:
            return
        w.alive = False
        logger.error("%s worker %s died: %s", w.role, w.name, exc)
        if w.role != "prefill":  # a prefill worker's requests learn it from their own calls
            for rid in list(w.inflight):
                stream = self._streams.pop(rid, None)
                if stream is not None:
                    stream._fail(WorkerDied(f"worker {w.name} died while serving this request"))
        w.inflight.clear()
        if w.poll_task is not None and w.poll_task is not asyncio.current_task():
            w.poll_task.cancel()
        self._spawn(self._notify_capacity())
        self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self.can_serve)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task
