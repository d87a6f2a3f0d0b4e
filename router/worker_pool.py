"""The router's worker actors: membership, placement, the long polls, worker death and scaling.

One ``next_outputs()`` call is kept in flight per (decode or colocated) worker, a long poll; every
delta it returns goes to the ``RequestStream`` of its request, and moves the request's state
(``request_state``). A worker whose actor dies fails the requests it had accepted with
``WorkerDied`` and leaves the pool. Placement asks ``placement.choose_worker`` with the load each
worker last reported plus what the router sent it since; requests that find no room wait in
``admission``.

Colocated mode: ``add_request`` on a worker, which prefills and decodes. Disaggregated mode (the
pool also has prefill workers): ``disaggregated.DisaggregatedFlow`` runs the reservation on a
decode worker and the prefill on a prefill worker; the decode worker's deltas come through the
same long poll.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Awaitable, Callable

from ray.exceptions import RayActorError

from pdserve.decode_worker.messages import RequestDelta, WorkerRequest, WorkerStats
from pdserve.router.admission import Admission
from pdserve.router.errors import NoWorkers, Overloaded, TooLarge, WorkerDied, WorkerRejected, actor_reason
from pdserve.router.placement import WorkerLoad, blocks_needed, choose_worker, fits_at_all
from pdserve.router.request_state import InvalidTransition, RequestState as S
from pdserve.router.request_stream import RequestStream

logger = logging.getLogger(__name__)

# The keys on which every worker of a pool must agree (disaggregated: block_size too, since KV
# blocks travel between workers).
_SAME_MODEL_KEYS = ("model", "max_model_len", "vocab_size")


async def awaitable(ref):
    """A coroutine awaiting a Ray ``ObjectRef``, for ``asyncio.wait_for``."""
    return await ref


@dataclass
class Worker:
    """One worker actor as the router sees it: its last stats and what was sent to it since."""

    name: str
    actor: Any  # ray.actor.ActorHandle
    info: dict
    stats: WorkerStats
    role: str = "colocated"  # "colocated", "decode" or "prefill"
    kv_address: str | None = None  # decode role: where prefill workers push KV
    inflight: set[str] = field(default_factory=set)  # request ids the router has on it
    # Requests sent since `stats` was taken, which those stats may not count yet:
    # request id -> (prompt tokens, KV blocks it will need).
    unseen: dict[str, tuple[int, int]] = field(default_factory=dict)
    alive: bool = True
    poll_task: asyncio.Task | None = None
    draining: bool = False  # being scaled away: no new requests, running ones finish

    def load(self, max_inflight: int) -> WorkerLoad:
        """The worker's last stats plus the requests sent to it since."""
        s = self.stats
        return WorkerLoad(
            name=self.name,
            queued_prompt_tokens=s.queued_prompt_tokens + sum(t for t, _ in self.unseen.values()),
            num_running=s.num_running,
            free_blocks=s.free_blocks - sum(b for _, b in self.unseen.values()),
            total_blocks=s.total_blocks,
            block_size=s.block_size,
            inflight=len(self.inflight),
            max_inflight=max_inflight,
        )


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
        migration_limit: int = 3,
        migration_timeout_s: float = 30.0,
        start_worker: Callable[[str], Awaitable[list]] | None = None,
    ):
        if not actors:
            raise ValueError("a worker pool needs at least one worker actor")
        if prefill_actors is not None and not prefill_actors:
            raise ValueError("a disaggregated worker pool needs at least one prefill worker actor")
        self._actors = list(actors)
        self._prefill_actors = list(prefill_actors or [])
        self.disaggregated = prefill_actors is not None
        self.max_inflight_per_worker = max_inflight_per_worker
        self.admission = Admission(max_waiting, max_inflight_per_worker)
        self.stats_ttl_s = stats_ttl_s
        self.stats_timeout_s = stats_timeout_s
        self._on_change = on_change
        self._workers: list[Worker] = []  # colocated or decode workers: the ones polled
        self._prefill: list[Worker] = []
        self._streams: dict[str, RequestStream] = {}  # by the request's id on its polled worker
        self._stats_time = 0.0
        self._stats_lock = asyncio.Lock()
        self._background: set[asyncio.Task] = set()
        self._flow = None  # disaggregated.DisaggregatedFlow, made in start()
        self.model_info: dict = {}
        # Failure: a request whose worker fails it moves to another at most `migration_limit`
        # times, each waiting at most `migration_timeout_s` for room; with `start_worker` (a
        # coroutine function: role -> started actors), a dead worker is replaced.
        self.migration_limit = migration_limit
        self.migration_timeout_s = migration_timeout_s
        self.start_worker = start_worker
        self._replacing: dict[str, int] = {}  # role -> replacements under way
        self.observer: Any = None  # RouterMetrics: migrated(), replaced()

    @property
    def polled_role(self) -> str:
        """The role of the workers whose long polls bring tokens: "decode" or "colocated"."""
        return "decode" if self.disaggregated else "colocated"

    # ---- membership ------------------------------------------------------------------------

    async def start(self) -> None:
        """Ask every worker for its model and load, check they agree, start the long polls."""
        if self.disaggregated:
            from pdserve.router.disaggregated import DisaggregatedFlow

            self._flow = DisaggregatedFlow(self)
        self.model_info = {}
        await self._join(self._actors, self.polled_role)
        if self._prefill_actors:
            await self._join(self._prefill_actors, "prefill")
        self._stats_time = time.monotonic()
        self._changed()

    async def add_workers(self, actors: list, role: str) -> list[str]:
        """Bring started actors of ``role`` into placement; returns their names. Their model
        must be the pool's, and decode workers need a KV receiver."""
        if role not in ("prefill", self.polled_role) or (role == "prefill" and not self.disaggregated):
            raise ValueError(f"a {'disaggregated' if self.disaggregated else 'colocated'} pool has no {role} workers")
        names = await self._join(actors, role)
        await self.admission.notify()  # requests waiting for room may fit now
        self._changed()
        return names

    async def _join(self, actors: list, role: str) -> list[str]:
        infos = await asyncio.gather(*(a.model_info.remote() for a in actors))
        stats = await asyncio.gather(*(a.stats.remote() for a in actors))
        keys = _SAME_MODEL_KEYS + (("block_size",) if self.disaggregated else ())
        if not self.model_info:
            self.model_info = dict(infos[0])
        for info in infos:
            if any(info.get(k) != self.model_info.get(k) for k in keys):
                raise ValueError(f"workers serve different models: {self.model_info} vs {info}")
        addresses: list = [None] * len(actors)
        if role == "decode":
            addresses = await asyncio.gather(*(a.kv_address.remote() for a in actors))
            if None in addresses:
                raise ValueError("a decode worker has no KV receiver: start decode workers with role='decode'")
        taken = {w.name for w in self._workers + self._prefill}
        names = []
        for actor, info, st, address in zip(actors, infos, stats, addresses):
            name = st.name or f"worker-{len(taken)}"
            while name in taken:
                name = f"{name}+"
            taken.add(name)
            w = Worker(name, actor, info, st, role=role, kv_address=address)
            if role == "prefill":
                self._prefill.append(w)
            else:
                self._workers.append(w)
                w.poll_task = asyncio.create_task(self._poll(w), name=f"poll-{w.name}")
            names.append(name)
        return names

    async def close(self) -> None:
        """Stop the long polls and fail what is still running (the actors stay up)."""
        tasks = [w.poll_task for w in self._workers if w.poll_task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in list(self._streams.values()):
            stream.fail(NoWorkers("the server is shutting down"))
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

    def serving(self, role: str) -> list[Worker]:
        """Live workers of ``role`` ("prefill", or the polled role) that take new requests."""
        workers = self._prefill if role == "prefill" else self._workers
        return [w for w in workers if w.alive and not w.draining]

    def num_serving(self, role: str) -> int:
        return len(self.serving(role))

    def loads(self) -> list[WorkerLoad]:
        return [w.load(self.max_inflight_per_worker) for w in self._workers if w.alive]

    def worker_snapshot(self) -> list[tuple[str, str, bool, WorkerStats]]:
        """``(role, name, alive, last stats)`` of every worker, prefill workers included (metrics)."""
        return [(w.role, w.name, w.alive, w.stats) for w in self._workers + self._prefill]

    @property
    def num_waiting(self) -> int:
        """Requests waiting in the router for a worker with room."""
        return self.admission.num_waiting

    # ---- stats -----------------------------------------------------------------------------

    async def refresh_stats(self) -> None:
        """Ask every live worker for its stats now, whatever their age (a metrics scrape)."""
        self.invalidate_stats()
        await self._refresh_stats()

    def invalidate_stats(self) -> None:
        """Make the next placement ask the workers for fresh stats."""
        self._stats_time = 0.0

    async def _refresh_stats(self) -> None:
        if time.monotonic() - self._stats_time < self.stats_ttl_s:
            return
        async with self._stats_lock:
            if time.monotonic() - self._stats_time < self.stats_ttl_s:
                return
            alive = [w for w in self._workers + self._prefill if w.alive]
            sent_before = {w.name: list(w.unseen) for w in alive}  # what the new stats will count
            results = await asyncio.gather(
                *(asyncio.wait_for(awaitable(w.actor.stats.remote()), self.stats_timeout_s) for w in alive),
                return_exceptions=True,
            )
            for w, res in zip(alive, results):
                if isinstance(res, RayActorError):
                    self.mark_dead(w, res)
                elif isinstance(res, BaseException):  # slow or failing: place on the last stats
                    logger.warning("stats() failed on %s: %r", w.name, res)
                else:
                    w.stats = res
                    for rid in sent_before[w.name]:
                        w.unseen.pop(rid, None)
            self._stats_time = time.monotonic()

    # ---- requests --------------------------------------------------------------------------

    async def submit(self, request: WorkerRequest, timeout: float | None) -> RequestStream:
        """Place ``request`` and return its stream.

        Waits up to ``timeout`` seconds (``None``: no limit) for a worker with room; raises
        ``Overloaded`` when none had room in time, ``NoWorkers`` when the pool is empty. In
        disaggregated mode it returns once the decode worker has reserved the prompt's blocks;
        the prefill runs in the background and its token #1 is the stream's first delta.
        """
        if self._flow is not None:
            return await self._flow.submit(request, timeout)
        stream = RequestStream(self.close_stream, request)
        await self._start_colocated(stream, request, None if timeout is None else time.monotonic() + timeout)
        return stream

    async def _start_colocated(self, stream: RequestStream, request: WorkerRequest, deadline: float | None) -> None:
        """Hand ``request`` (``stream``'s current attempt) to a colocated worker with room."""
        num_tokens = len(request.prompt_token_ids) + request.params.max_tokens
        while True:
            worker = await self.place(num_tokens, deadline)
            # Register before sending: the first delta may come back before the call returns.
            self.register(stream, worker, len(request.prompt_token_ids), num_tokens)
            stream.advance(S.DECODING)
            try:
                await worker.actor.add_request.remote(request)
            except RayActorError as exc:
                self.forget(stream)
                self.mark_dead(worker, exc)
                if stream.state is not S.DECODING:
                    return  # the worker's death reached the stream first: it migrates, or failed
                stream.advance(S.WAITING)
                continue  # try another worker
            except asyncio.CancelledError:
                if stream.state is S.DECODING:  # still this attempt's (a migration moved it on)
                    stream.close()
                raise
            except Exception as exc:
                self.forget(stream)
                stream.advance(S.FAILED)
                raise WorkerRejected(f"worker {worker.name} rejected the request: {actor_reason(exc)}") from exc
            return

    async def place(self, num_tokens: int, deadline: float | None) -> Worker:
        """A (decode or colocated) worker with room for ``num_tokens`` (prompt + max_tokens),
        waiting in ``admission`` until one has room or ``deadline`` passes (``Overloaded``)."""
        while True:
            await self._refresh_stats()
            alive = self.serving(self.polled_role)
            if not alive and self.replacing(self.polled_role):
                await self.admission.wait(deadline, "no worker came back for as long as the request could wait; "
                                          "retry later", poll_s=0.5)
                continue
            if not alive:
                raise NoWorkers("no worker is available" if not self.disaggregated
                                else "no decode worker is available")
            loads = [w.load(self.max_inflight_per_worker) for w in alive]
            if not any(fits_at_all(l, num_tokens) for l in loads):
                largest = max(l.total_blocks * l.block_size for l in loads)
                raise TooLarge(
                    f"the request needs room for {num_tokens} tokens (prompt + max_tokens) but "
                    f"the largest worker's KV cache holds {largest} tokens"
                )
            name = choose_worker(loads, num_tokens)
            if name is not None:
                return next(w for w in alive if w.name == name)
            await self.admission.wait(
                deadline,
                f"every worker stayed at its limit of {self.max_inflight_per_worker} "
                "requests for as long as the request could wait; retry later",
            )

    def register(self, stream: RequestStream, worker: Worker, prompt_tokens: int, num_tokens: int) -> None:
        """Route ``worker``'s deltas for ``stream.request_id`` to ``stream``, and count what the
        request will take there until the worker's next stats show it."""
        stream.worker = worker
        self._streams[stream.request_id] = stream
        worker.inflight.add(stream.request_id)
        worker.unseen[stream.request_id] = (prompt_tokens, blocks_needed(num_tokens, worker.stats.block_size))

    def is_registered(self, stream: RequestStream) -> bool:
        """Whether ``stream``'s worker still holds it (its deltas still come to it)."""
        return self._streams.get(stream.request_id) is stream

    def forget(self, stream: RequestStream, notify: bool = True) -> None:
        """Stop routing deltas to ``stream`` and take it off its worker's count; ``notify``
        wakes requests waiting for room."""
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
        if stream.worker is not None:
            stream.worker.unseen.pop(stream.request_id, None)  # gone from the worker: stats won't count it
        if stream.worker is not None and stream.request_id in stream.worker.inflight:
            stream.worker.inflight.discard(stream.request_id)
            if notify:
                self.spawn(self.admission.notify())

    def close_stream(self, stream: RequestStream) -> None:
        """``RequestStream.close``: a request the consumer is done with. Unless it had ended, it
        is aborted on its workers (the calls are sent now, even from a handler being cancelled;
        only their answers are awaited later)."""
        for task in (stream.prefill_task, stream.migration_task):
            if task is not None and not task.done():
                task.cancel()  # aborts the prefill if it is waiting for one
        if stream.ended:
            self.forget(stream)
            return
        stream.advance(S.ABORTED)
        self._release(stream)

    def _release(self, stream: RequestStream) -> None:
        """Abort ``stream``'s request on the workers that may still hold it."""
        registered = self.is_registered(stream)
        self.forget(stream)
        p = stream.prefill_worker
        if stream.prefill_task is not None and stream.prefill_task.done() and p is not None and p.alive:
            self.abort(p, stream.request_id)  # it may still be sending the KV
        if registered and stream.worker.alive:
            self.abort(stream.worker, stream.request_id)

    def abort(self, w: Worker, request_id: str) -> asyncio.Task:
        """Abort a request on a worker. The call is sent now, even from a task being cancelled;
        the returned task awaits its answer."""
        return self.spawn(self._abort_done(w, request_id, w.actor.abort.remote(request_id)))

    async def _abort_done(self, w: Worker, request_id: str, ref) -> None:
        try:
            await ref
        except RayActorError:
            pass  # the worker is gone, and its blocks with it
        except Exception:
            logger.exception("abort(%s) failed on %s", request_id, w.name)

    async def abort_after(self, ref, w: Worker, request_id: str) -> None:
        """Once the call ``ref`` (which may have given ``request_id`` blocks on ``w``) answers,
        abort the request there."""
        try:
            await ref
        except Exception:
            return  # nothing was reserved
        await self.abort(w, request_id)

    # ---- the long poll ---------------------------------------------------------------------

    async def _poll(self, w: Worker) -> None:
        while w.alive:
            try:
                deltas = await w.actor.next_outputs.remote()
            except asyncio.CancelledError:
                raise
            except RayActorError as exc:
                self.mark_dead(w, exc)
                return
            except Exception as exc:  # a bug in the worker: it can no longer serve
                logger.exception("next_outputs() failed on %s", w.name)
                self.mark_dead(w, exc)
                return
            if not deltas:
                await asyncio.sleep(0.001)  # a worker that answers empty at once must not spin us
                continue
            for d in deltas:
                stream = self._streams.get(d.request_id)
                if stream is None:
                    continue  # closed by the router (stop string, client gone)
                try:
                    self._route(stream, d)
                except InvalidTransition:  # a bug: fail this request, keep polling for the others
                    logger.exception("request %s on %s", d.request_id, w.name)
                    self._release(stream)
                    stream.fail(WorkerRejected(f"internal error in the router's request states on {w.name}"))

    def _route(self, stream: RequestStream, d: RequestDelta) -> None:
        """A delta from ``stream``'s polled worker: queue it and move the request's state."""
        transferring = stream.state in (S.PREFILLING, S.PUSHING)
        if d.finish_reason == "error" and transferring:
            # The decode worker failed the request before a token of its own: the KV transfer
            # failed. The flow finds out whether the prefill worker died, and ends the request.
            self.forget(stream)
            self.spawn(self._flow.explain_transfer_failure(stream, d))
            return
        stream.push(d)
        if d.finish_reason is not None:
            self.forget(stream)
            stream.advance(S.FAILED if d.finish_reason == "error" else S.DONE)
        elif d.token_ids and transferring:
            stream.advance(S.DECODING)

    # ---- worker death and scaling ----------------------------------------------------------

    def mark_dead(self, w: Worker, exc: BaseException) -> None:
        """``w``'s actor is gone: it leaves placement, the requests it had accepted migrate to
        healthy workers (``migrate``), and, when the pool can start workers, a new one of the
        same role replaces it. (Requests still being handed to it learn it from their own calls
        and go elsewhere; so do a prefill worker's requests.)"""
        if not w.alive:
            return
        w.alive = False
        logger.error("%s worker %s died: %s", w.role, w.name, exc)
        if w.role != "prefill":
            for rid in list(w.inflight):
                stream = self._streams.get(rid)
                if stream is not None and stream.state not in (S.WAITING, S.MIGRATING):
                    del self._streams[rid]
                    self.migrate(stream, f"worker {w.name} died while serving this request")
        w.inflight.clear()
        if w.poll_task is not None and w.poll_task is not asyncio.current_task():
            w.poll_task.cancel()
        if self.start_worker is not None and not w.draining:
            self._replacing[w.role] = self._replacing.get(w.role, 0) + 1
            self.spawn(self._replace(w))
        self.spawn(self.admission.notify())
        self._changed()

    def replacing(self, role: str) -> bool:
        """Whether a dead worker of ``role`` is being replaced (requests may wait for it)."""
        return self._replacing.get(role, 0) > 0

    async def _replace(self, dead: Worker) -> None:
        """Start a worker of ``dead``'s role in its place; it joins placement when its model is loaded."""
        t0 = time.monotonic()
        try:
            actors = await self.start_worker(dead.role)
            names = await self.add_workers(actors, dead.role)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.error("could not replace %s worker %s: %s", dead.role, dead.name, exc)
            return
        finally:
            self._replacing[dead.role] -= 1
        workers = self._prefill if dead.role == "prefill" else self._workers
        if dead in workers:
            workers.remove(dead)
        seconds = time.monotonic() - t0
        logger.warning("replaced dead %s worker %s with %s in %.1f s", dead.role, dead.name, ", ".join(names), seconds)
        if self.observer is not None:
            self.observer.replaced(dead.role, seconds)
        self._changed()

    # ---- migration -------------------------------------------------------------------------

    def migrate(self, stream: RequestStream, cause: str) -> None:
        """``stream``'s worker failed it (``cause``): continue the request on healthy workers from
        the tokens already streamed, which are prefilled again after its prompt. After
        ``migration_limit`` migrations it fails with ``WorkerDied`` naming the cause."""
        if stream.ended or stream.state is S.MIGRATING:
            return
        current = asyncio.current_task()
        for task in (stream.prefill_task, stream.migration_task):
            if task is not None and not task.done() and task is not current:
                task.cancel()  # the old attempt's prefill (its cancel aborts it on the prefill worker)
        self._release(stream)
        if stream.migrations >= self.migration_limit:
            stream.fail(WorkerDied(f"{cause}; the request was moved {stream.migrations} time(s) already "
                                   f"(--migration-limit {self.migration_limit})"))
            return
        stream.migrations += 1
        stream.advance(S.MIGRATING)
        if self.observer is not None:
            self.observer.migrated()
        stream.migration_task = self.spawn(self._resume(stream, cause))

    async def _resume(self, stream: RequestStream, cause: str) -> None:
        """The next attempt of a migrating request: prompt + tokens streamed so far, for the rest
        of its ``max_tokens``, on whichever worker placement picks."""
        first = stream.request
        done = list(stream.delivered)
        n = len(first.prompt_token_ids) + len(done)
        remaining = min(first.params.max_tokens - len(done), int(self.model_info.get("max_model_len", n + 1)) - n)
        if remaining <= 0 or self._ends_with_stop(done, first):
            # Every token was out; only the worker's last word was lost.
            stream.push(RequestDelta(stream.request_id, [], finish_reason="length" if remaining <= 0 else "stop",
                                     num_prompt_tokens=len(first.prompt_token_ids), num_output_tokens=len(done)))
            stream.advance(S.DONE)
            return
        request = replace(first, request_id=f"{first.request_id}~m{stream.migrations}",
                          prompt_token_ids=first.prompt_token_ids + done,
                          params=replace(first.params, max_tokens=remaining), num_generated=len(done))
        stream.restart(request.request_id)
        logger.warning("request %s: %s; continuing on another worker after %d streamed token(s) (migration %d)",
                       first.request_id, cause, len(done), stream.migrations)
        try:
            if self._flow is not None:
                await self._flow.resume(stream, request, self.migration_timeout_s)
            else:
                await self._start_colocated(stream, request, time.monotonic() + self.migration_timeout_s)
        except (NoWorkers, Overloaded, TooLarge, WorkerRejected) as exc:
            self._release(stream)
            stream.fail(WorkerDied(f"{cause}; moving it to another worker failed: {exc}"))

    def _ends_with_stop(self, done: list[int], request: WorkerRequest) -> bool:
        """Whether the last streamed token ended the request (EOS or a stop token id)."""
        if not done:
            return False
        eos = set(self.model_info.get("eos_token_ids") or [])
        return done[-1] in request.params.stop_token_ids or (not request.params.ignore_eos and done[-1] in eos)

    async def remove_workers(self, role: str, count: int, drain_timeout_s: float | None) -> tuple[list, list[str], int]:
        """Drain ``count`` workers of ``role`` (the least loaded) and take them out of the pool.

        Draining workers get no new requests; the call waits until their running requests have
        finished (for a prefill worker: until every KV cache it computed has reached its decode
        worker) or ``drain_timeout_s`` has passed, when what still runs on them fails with
        ``WorkerDied``. Returns ``(actors, names, number of requests cut)``: stopping the actors
        is the caller's job.
        """
        workers = self._prefill if role == "prefill" else self._workers
        chosen = sorted(self.serving(role), key=lambda w: len(w.inflight))[:count]
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
            for stream in self._held_by(w):
                cut += 1
                self._release(stream)  # frees its blocks on the workers that are staying
                stream.fail(WorkerDied(f"worker {w.name} was scaled away before this request finished "
                                       f"(its drain timed out after {drain_timeout_s} s)"))
            w.alive = False  # retired: a late RayActorError is not news
            if w.poll_task is not None:
                w.poll_task.cancel()
        await asyncio.gather(*(w.poll_task for w in chosen if w.poll_task is not None), return_exceptions=True)
        for w in chosen:
            workers.remove(w)
        self._changed()
        return [w.actor for w in chosen], [w.name for w in chosen], cut

    def _held_by(self, w: Worker) -> list[RequestStream]:
        """Unfinished requests that need ``w``: it is their polled worker, or their prefill
        worker and their KV cache may not all have left it."""
        return [s for s in self._streams.values() if not s.ended and (
            s.worker is w or (s.prefill_worker is w and s.state in (S.PREFILLING, S.PUSHING)))]

    async def _still_busy(self, w: Worker) -> bool:
        if w.role != "prefill":
            return bool(w.inflight)
        if w.inflight or self._held_by(w):
            return True
        try:  # the router's view is clear; the worker's own queue settles it
            st = await asyncio.wait_for(awaitable(w.actor.stats.remote()), self.stats_timeout_s)
        except RayActorError:
            return False
        except Exception:
            return True
        return st.num_running > 0 or st.num_waiting > 0

    # ---- bookkeeping -----------------------------------------------------------------------

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self.can_serve)

    def spawn(self, coro) -> asyncio.Task:
        """Run ``coro`` in the background, kept alive until it ends and cancelled on ``close``."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task
