"""The decode worker: a Ray actor that runs continuous batching over one ModelRunner.

All engine state (runner, KV pool, allocator, scheduler, sequences) is owned by one engine
thread. Ray calls never touch it directly: they post commands to the engine thread's inbox and,
when they need an answer, wait for it. Step outputs collect in an outbox that the router drains
with ``next_outputs()`` (a long poll), so one Ray call carries all tokens of one or more steps.

Two ways in:
- ``add_request``: a raw prompt; this actor prefills it in chunks mixed into decode steps
  (colocated mode);
- ``reserve_kv`` -> ``write_kv`` (per piece, from a KV transport) -> ``complete_kv``: the prompt's
  KV was computed elsewhere (disaggregated mode); blocks are reserved first, then filled, then the
  request joins the batch from the first token the prefill side sampled.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from pdserve.decode_worker.aborts import EarlyAborts
from pdserve.decode_worker.messages import EngineCounters, RequestDelta, WorkerRequest, WorkerStats
from pdserve.decode_worker.scheduler import Scheduler, SchedulerConfig
from pdserve.engine.config import EngineConfig
from pdserve.engine.memory import peak_memory_bytes
from pdserve.engine.model_runner import BatchItem, ModelRunner
from pdserve.engine.sampler import sample
from pdserve.engine.sequence import Sequence
from pdserve.kv_transfer import start_receiver

logger = logging.getLogger(__name__)


class RequestAborted(RuntimeError):
    """The request was aborted before it reached this worker; nothing was started or reserved."""


@dataclass
class Reservation:
    """Blocks held for a request whose KV is on its way: reserved -> receiving -> started or released.

    Transport threads write into the blocks under ``lock``; the engine thread releases them under
    the same lock, so no write lands in a block after it went back to the free list.
    """

    seq: Sequence
    deadline: float
    opened: bool = False  # a transfer stream for it has opened
    lock: threading.Lock = field(default_factory=threading.Lock)
    released: bool = False
    covered: set = field(default_factory=set)  # distinct (layer, block) pairs written so far
    bytes_received: int = 0  # KV payload written so far (metrics)

    @property
    def pieces(self) -> int:
        return len(self.covered)


@dataclass
class WorkerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    role: str = "colocated"
    transport: str = "grpc"  # how KV arrives in the decode role
    # A reservation waits for its transfer to open (the request sits in a prefill queue meanwhile)
    # at most kv_reserve_timeout_s; the router aborts it sooner when the client goes away, the
    # deadline passes or the prefill worker dies, so this only guards against a lost router.
    kv_reserve_timeout_s: float = 300.0
    # Once the transfer is open, no progress (no piece written, no completion) for kv_lease_s
    # releases the blocks: a stalled transfer.
    kv_lease_s: float = 30.0
    # Decode role: the cluster secret (``kv_transfer.auth``); the KV receiver accepts only streams
    # and frames signed with it. ``pdserve serve`` sets it; never logged (repr=False).
    cluster_secret: bytes | None = field(default=None, repr=False)


class EngineLoop:
    """The engine thread: scheduler + runner + sampler, stepping while there is work.

    Usable without Ray (tests and the offline benchmark drive it directly); ``DecodeWorker`` wraps
    it as an actor.
    """

    def __init__(self, config: WorkerConfig, name: str = "worker-0") -> None:
        self.config = config
        self.name = name
        self.runner = ModelRunner(config.engine)
        self.scheduler = Scheduler(config.scheduler, self.runner.allocator, self.runner.max_model_len)
        self.seqs: dict[str, Sequence] = {}
        self.reserved: dict[str, Reservation] = {}
        self.early_aborts = EarlyAborts()  # aborts that overtook their request
        self._inbox: deque[Callable[[], None]] = deque()
        self._outbox: list[RequestDelta] = []
        self._cv = threading.Condition()
        self._out_cv = threading.Condition()
        self._stop = False
        self.counters = EngineCounters()
        self._thread = threading.Thread(target=self._run, name=f"{name}-engine", daemon=True)
        self._thread.start()

    # ---- called from any thread ----------------------------------------------------------------

    def call(self, fn: Callable[[], Any], wait: bool = True) -> Any:
        """Run ``fn`` on the engine thread between steps; return its result (or raise its error)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def task() -> None:
            try:
                fut.set_result(fn())
            except BaseException as exc:  # handed back to the caller
                fut.set_exception(exc)

        with self._cv:
            self._inbox.append(task)
            self._cv.notify()
        return fut.result() if wait else fut

    def take_outputs(self, timeout: float | None = None) -> list[RequestDelta]:
        """Everything produced since the last call; waits up to ``timeout`` for something."""
        with self._out_cv:
            if not self._outbox and timeout:
                self._out_cv.wait(timeout)
            out, self._outbox = self._outbox, []
        return out

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=10)

    # ---- engine thread ---------------------------------------------------------------------------

    def _emit(self, deltas: list[RequestDelta]) -> None:
        if deltas:
            with self._out_cv:
                self._outbox.extend(deltas)
                self._out_cv.notify_all()

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cv:
                while not self._inbox and not self.scheduler.has_work and not self._stop:
                    self._cv.wait(timeout=1.0 if self.reserved else None)
                    if self.reserved:
                        break
                if self._stop:
                    return
                tasks = list(self._inbox)
                self._inbox.clear()
            for task in tasks:
                task()
            self._expire_leases()
            if self.scheduler.has_work:
                self._step()

    def _step(self) -> None:
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        self.counters.num_preemptions += len(out.preempted)
        if out.is_empty:
            if self.scheduler.waiting and not self.scheduler.running and not self.reserved:
                # Nothing runs or holds blocks, and the head of the queue cannot get any: it never will.
                # (Blocks held by KV reservations come back when those start, abort or expire.)
                seq = self.scheduler.waiting[0]
                self._finish(seq, "error", error=f"request needs more KV blocks than the pool's "
                             f"{self.runner.allocator.num_blocks}; lower max_tokens or raise --kv-memory")
            else:
                time.sleep(0.001)
            return
        self.runner.kv.copy_blocks(out.copies)
        items, sampled = [], []
        num_decode = 0
        for sch in out.scheduled:
            s = sch.seq
            start = s.num_computed
            end = start + sch.num_tokens
            done_prefill = end == len(s.token_ids)
            num_decode += sch.num_tokens == 1 and done_prefill and start >= s.num_prompt_tokens
            items.append(BatchItem(s.token_ids[start:end], start, s.block_table.blocks, sample=done_prefill))
            s.mark_computed(end)
            if done_prefill:
                sampled.append(s)
        try:
            logits = self.runner.execute(items)
            tokens, logprobs, failed = (sample(logits, [s.params for s in sampled], [s.next_generator() for s in sampled])
                                        if sampled else ([], None, {}))
        except Exception as exc:  # a bug or a device error: fail this step's requests, keep serving
            logger.exception("step failed")
            for sch in out.scheduled:
                self._finish(sch.seq, "error", error=f"engine step failed: {exc}")
            return
        self._count_step(out.num_tokens, num_decode, time.perf_counter() - t0)
        deltas = []
        for j, s in enumerate(sampled):
            # Each sequence on its own: a failure here ends this sequence only, never its batch-mates.
            if j in failed:
                logger.warning("request %s: %s", s.request_id, failed[j])
                self._finish(s, "error", error=failed[j])
                continue
            lp = logprobs[j] if logprobs else None
            try:
                reason = s.append_token(tokens[j], lp, self.runner.eos_token_ids, self.runner.max_model_len)
            except Exception as exc:  # a bug in one sequence's stop checks
                logger.exception("request %s: stop checks failed", s.request_id)
                self._finish(s, "error", error=f"stop checks failed: {exc}")
                continue
            delta = RequestDelta(s.request_id, [tokens[j]], [lp] if s.params.logprobs else None)
            if reason:
                self._finish(s, reason, delta=delta)
            else:
                deltas.append(delta)
        self._emit(deltas)

    def _count_step(self, num_tokens: int, num_decode: int, seconds: float) -> None:
        c = self.counters
        c.num_steps += 1
        c.decode_tokens += num_decode
        c.prefill_tokens += num_tokens - num_decode
        if num_tokens > num_decode:
            c.prefill_step_s += seconds
            c.decode_tokens_in_prefill_steps += num_decode
        else:
            c.decode_step_s += seconds

    def _finish(self, seq: Sequence, reason: str, error: str | None = None, delta: RequestDelta | None = None) -> None:
        self.scheduler.finish(seq, reason)
        self.seqs.pop(seq.request_id, None)
        now = time.time()
        sched = seq.first_scheduled_time or now
        first = seq.first_token_time or now
        timings = {"queued": sched - seq.arrival_time, "prefill": max(0.0, first - sched), "decode": now - first}
        if seq.transfer_s is not None:
            timings["transfer"] = seq.transfer_s
        delta = delta or RequestDelta(seq.request_id, [])
        delta.finish_reason = reason
        delta.error = error
        delta.num_prompt_tokens = seq.num_prompt_tokens
        delta.num_output_tokens = seq.num_output_tokens
        delta.timings = timings
        delta.kv_transfer_bytes = seq.transfer_bytes
        self._emit([delta])

    def _expire_leases(self) -> None:
        now = time.time()
        for rid, r in list(self.reserved.items()):
            if now <= r.deadline:
                continue
            if r.opened:
                error = (f"KV transfer stalled: no data for {self.config.kv_lease_s:g} s "
                         "(its lease, kv_lease_s); blocks released")
            else:
                error = (f"KV transfer did not open within the reservation's lease of "
                         f"{self.config.kv_reserve_timeout_s:g} s (kv_reserve_timeout_s); blocks released")
            self._fail_reservation(rid, error)

    def _release_reservation(self, request_id: str) -> Reservation | None:
        r = self.reserved.pop(request_id, None)
        if r is not None:
            with r.lock:
                r.released = True
                r.seq.block_table.release(self.runner.allocator)
        return r

    def _fail_reservation(self, request_id: str, error: str, reason: str = "error") -> None:
        r = self._release_reservation(request_id)
        if r is not None:
            logger.warning("request %s: %s", request_id, error)
            self._emit([RequestDelta(request_id, [], finish_reason=reason, error=error,
                                     num_prompt_tokens=r.seq.num_prompt_tokens)])

    # ---- commands (run on the engine thread via call()) -----------------------------------------

    def _check_fits(self, num_tokens: int) -> None:
        blocks = -(-num_tokens // self.runner.block_size)
        if blocks > self.runner.allocator.num_blocks:
            raise ValueError(
                f"request needs up to {num_tokens} tokens of KV ({blocks} blocks) but this worker's "
                f"pool holds {self.runner.allocator.num_blocks} blocks; lower max_tokens or raise --kv-memory"
            )

    def _add(self, req: WorkerRequest) -> None:
        if self.early_aborts.take(req.request_id):  # its abort overtook it: never start it
            self._emit([RequestDelta(req.request_id, [], finish_reason="abort",
                                     error="aborted before the request reached the worker")])
            return
        if req.request_id in self.seqs or req.request_id in self.reserved:
            raise ValueError(f"request id {req.request_id!r} is already in use on this worker")
        total = min(len(req.prompt_token_ids) + req.params.max_tokens, self.runner.max_model_len)
        self._check_fits(total)
        seq = Sequence(req.request_id, req.prompt_token_ids, req.params, self.runner.block_size,
                       self.runner.device, arrival_time=req.arrival_time or time.time(),
                       num_generated=req.num_generated)
        self.seqs[req.request_id] = seq
        self.scheduler.add(seq)

    def _abort(self, request_id: str) -> None:
        if request_id in self.reserved:
            self._fail_reservation(request_id, "aborted", reason="abort")
            return
        seq = self.seqs.get(request_id)
        if seq is None:
            self.early_aborts.remember(request_id)  # its request may still be on its way
        elif not seq.is_finished:
            self._finish(seq, "abort")

    def _reserve(self, req: WorkerRequest) -> list[int]:
        if self.early_aborts.take(req.request_id):
            raise RequestAborted(f"request {req.request_id!r} was aborted before its reservation arrived")
        if req.request_id in self.seqs or req.request_id in self.reserved:
            raise ValueError(f"request id {req.request_id!r} is already in use on this worker")
        total = min(len(req.prompt_token_ids) + req.params.max_tokens, self.runner.max_model_len)
        self._check_fits(total)
        seq = Sequence(req.request_id, req.prompt_token_ids, req.params, self.runner.block_size,
                       self.runner.device, arrival_time=req.arrival_time or time.time(),
                       num_generated=req.num_generated)
        seq.block_table.reserve(self.runner.allocator, len(req.prompt_token_ids))  # OutOfBlocks propagates
        self.reserved[req.request_id] = Reservation(seq, time.time() + self.config.kv_reserve_timeout_s)
        return list(seq.block_table.blocks)

    def _start(self, request_id: str, first_token: int, first_logprob: float | None, transfer_s: float | None) -> None:
        r = self.reserved.pop(request_id, None)
        if r is None:
            raise KeyError(f"no KV reservation for request {request_id!r} (expired or aborted)")
        seq = r.seq
        seq.kv_received(transfer_s, r.bytes_received)
        self.seqs[request_id] = seq
        reason = seq.append_token(first_token, first_logprob, self.runner.eos_token_ids, self.runner.max_model_len)
        # Token #1 already reached the client through the prefill side: no delta for it here.
        if reason:
            self._finish(seq, reason)
        else:
            self.scheduler.add_running(seq)

    def stats(self) -> WorkerStats:
        a = self.runner.allocator
        return WorkerStats(
            name=self.name, role=self.config.role,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            queued_prompt_tokens=self.scheduler.num_waiting_tokens(),
            free_blocks=a.num_free, total_blocks=a.num_blocks, block_size=self.runner.block_size,
            device=self.runner.device.type, peak_memory_bytes=peak_memory_bytes(self.runner.device),
        )

    # ---- public, thread-safe -------------------------------------------------------------------

    def add_request(self, req: WorkerRequest) -> None:
        self.call(lambda: self._add(req))

    def abort(self, request_id: str) -> None:
        self.call(lambda: self._abort(request_id))

    def reserve_kv(self, req: WorkerRequest) -> list[int]:
        return self.call(lambda: self._reserve(req))

    # ---- KVSink: called by transport threads ---------------------------------------------------

    def open_kv(self, request_id: str) -> None:
        """A transfer stream for a reserved request opened: from now on the lease bounds stalls
        of the transfer (renewed by every piece), not the time the request waited in a prefill queue."""
        r = self.reserved.get(request_id)
        if r is None:
            raise KeyError(f"no KV reservation for request {request_id!r} (expired, aborted or unknown)")
        r.opened = True
        r.deadline = time.time() + self.config.kv_lease_s

    def write_kv(self, request_id: str, layers: range, block_ids: list[int], data: torch.Tensor) -> None:
        """Write a piece of a reserved request's KV into its ``block_ids`` for ``layers``."""
        r = self.reserved.get(request_id)
        if r is None:
            raise KeyError(f"no KV reservation for request {request_id!r} (expired, aborted or unknown)")
        owned = r.seq.block_table.blocks
        if not set(block_ids) <= set(owned):
            raise ValueError(f"blocks {sorted(set(block_ids) - set(owned))} are not reserved for {request_id!r}")
        with r.lock:
            if r.released:
                raise KeyError(f"the KV reservation of {request_id!r} was released")
            self.runner.kv.import_blocks(block_ids, layers, data)
            r.covered.update((layer, b) for layer in layers for b in block_ids)  # a duplicate adds nothing
            r.bytes_received += data.numel() * data.element_size()
            r.opened = True
            r.deadline = time.time() + self.config.kv_lease_s  # progress renews the lease

    def complete_kv(self, request_id: str, first_token: int, first_logprob: float | None, transfer_s: float) -> None:
        """Every piece arrived (checked): the request joins the running batch from ``first_token``,
        which the prefill side sampled and already sent to the client."""
        r = self.reserved.get(request_id)
        if r is None:
            raise KeyError(f"no KV reservation for request {request_id!r} (expired, aborted or unknown)")
        expected = self.runner.model.num_layers * len(r.seq.block_table.blocks)
        if r.pieces != expected:
            raise ValueError(f"incomplete KV for {request_id!r}: {r.pieces} of {expected} layer-blocks arrived")
        self.call(lambda: self._start(request_id, first_token, first_logprob, transfer_s))

    def fail_kv(self, request_id: str, error: str) -> None:
        self.call(lambda: self._fail_reservation(request_id, error))

    def get_stats(self) -> WorkerStats:
        return self.call(self.stats)

    def get_counters(self) -> EngineCounters:
        return self.call(lambda: dataclasses.replace(self.counters))


class DecodeWorker:
    """Ray actor class around ``EngineLoop`` (created with ``ray.remote`` in ``start_workers``)."""

    def __init__(self, config: WorkerConfig, name: str) -> None:
        logging.basicConfig(level=logging.INFO)
        self.loop = EngineLoop(config, name)
        self.name = name
        self.receiver = None
        if config.role == "decode":
            self.receiver = start_receiver(self.loop, config.transport, self.loop.runner.device,
                                           config.kv_lease_s, secret=config.cluster_secret)

    def kv_address(self) -> str | None:
        """Where prefill actors push KV for this actor (decode role only)."""
        return self.receiver.address if self.receiver is not None else None

    def ready(self) -> str:
        return self.name

    def add_request(self, req: WorkerRequest) -> None:
        self.loop.add_request(req)

    def abort(self, request_id: str) -> None:
        self.loop.abort(request_id)

    def next_outputs(self, timeout: float = 1.0) -> list[RequestDelta]:
        return self.loop.take_outputs(timeout)

    def stats(self) -> WorkerStats:
        return self.loop.get_stats()

    def model_info(self) -> dict:
        r = self.loop.runner
        return {
            "model": r.config.model,
            "model_dir": str(r.model_dir),
            "max_model_len": r.max_model_len,
            "vocab_size": r.vocab_size,
            "eos_token_ids": sorted(r.eos_token_ids),
            "block_size": r.block_size,
            "num_blocks": r.allocator.num_blocks,
        }

    def reserve_kv(self, req: WorkerRequest) -> list[int]:
        return self.loop.reserve_kv(req)

    def counters(self) -> EngineCounters:
        return self.loop.get_counters()


def start_workers(
    config: EngineConfig | WorkerConfig,
    num_workers: int = 1,
    num_cpus: float = 1,
    num_gpus: float = 0,
    resources: dict[str, float] | None = None,
    name_prefix: str = "pdserve-decode",
    role: str = "colocated",
) -> list:
    """Start ``num_workers`` worker actors with the declared resources; wait until each has loaded
    its model. Returns the actor handles."""
    import ray

    wc = config if isinstance(config, WorkerConfig) else WorkerConfig(engine=config)
    wc.role = role
    if num_gpus and wc.engine.device == "cpu":
        wc.engine.device = "cuda"
    actor_cls = ray.remote(DecodeWorker)
    handles = [
        actor_cls.options(
            name=f"{name_prefix}-{i}", num_cpus=num_cpus, num_gpus=num_gpus, resources=resources or {},
            max_concurrency=16,
        ).remote(wc, f"{name_prefix}-{i}")
        for i in range(num_workers)
    ]
    ray.get([h.ready.remote() for h in handles])
    return handles
