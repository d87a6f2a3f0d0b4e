"""The prefill worker: a Ray actor that turns prompts into KV cache and pushes it to decode actors.

Requests arrive with their destination (a decode actor's KV receiver address and the block ids it
reserved). The engine thread batches waiting prompts under a per-step token budget, chunking long
ones, and computes their KV into its own paged cache. As soon as a layer is computed, the blocks
that this step completed are handed to the transport for that layer range, so the transfer
overlaps the remaining layers and chunks. After a prompt's last chunk the engine samples token #1
and answers the router at once (the client sees it without waiting for the transfer); the final
frame carries token #1 to the decode actor, which continues from it. The prompt's blocks here are
freed once the decode side has acknowledged the whole KV (or the transfer failed).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from pdserve.decode_worker.aborts import EarlyAborts
from pdserve.decode_worker.messages import WorkerRequest, WorkerStats
from pdserve.engine.block_allocator import OutOfBlocks
from pdserve.engine.config import EngineConfig
from pdserve.engine.memory import peak_memory_bytes
from pdserve.engine.model_runner import BatchItem, ModelRunner
from pdserve.engine.sampler import sample
from pdserve.engine.sequence import Sequence
from pdserve.kv_transfer import KVSender, Transfer, TransferError, make_sender
from pdserve.kv_transfer.base import DEFAULT_FRAME_BYTES

logger = logging.getLogger(__name__)


@dataclass
class PrefillConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 16
    transport: str = "grpc"
    transfer_timeout_s: float = 30.0
    frame_bytes: int = DEFAULT_FRAME_BYTES  # pieces are grouped over layers up to about this size
    # When a chunk's KV leaves: "chunk" (its pieces go once the chunk is computed, overlapping the
    # next chunk's compute; a prompt's last chunk leaves after token #1 is handed over) or "layer"
    # (pieces go as their layers are computed, overlapping the chunk's own compute). On CPU the
    # push competes with the compute for the same cores: in alternated runs of `pdserve bench
    # transfer`, "chunk" added less to TTFT than "layer" and the decode side held the whole KV
    # sooner too, hence the default (figures in BENCHMARKS.md).
    kv_push: str = "chunk"
    # The cluster secret (``kv_transfer.auth``): signs every KV stream and frame; the decode actors
    # refuse any other. ``pdserve serve`` sets it; never logged (repr=False).
    cluster_secret: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.kv_push not in ("layer", "chunk"):
            raise ValueError(f"kv_push must be 'layer' or 'chunk', not {self.kv_push!r}")


@dataclass
class FirstToken:
    """What the router gets back from a prefill: token #1, as soon as it is sampled."""

    request_id: str
    token_id: int
    logprob: float | None
    num_prompt_tokens: int
    timings: dict[str, float]


@dataclass
class KVDestination:
    """Where a request's KV goes: a decode actor's receiver and the blocks it reserved there."""

    address: str
    block_ids: list[int]


@dataclass
class _Task:
    req: WorkerRequest
    dest: KVDestination
    seq: Sequence
    future: concurrent.futures.Future
    transfer: Transfer | None = None
    sent_blocks: int = 0  # prompt blocks already pushed (all layers)
    aborted: bool = False
    admitted_time: float | None = None


class PrefillEngine:
    """Engine thread of a prefill actor (usable without Ray in tests)."""

    def __init__(self, config: PrefillConfig, name: str = "prefill-0", sender: KVSender | None = None) -> None:
        self.config = config
        self.name = name
        self.runner = ModelRunner(config.engine)
        self.sender = sender or make_sender(config.transport, config.engine.device, config.transfer_timeout_s,
                                            secret=config.cluster_secret)
        self.waiting: deque[_Task] = deque()
        self.running: list[_Task] = []
        self.tasks: dict[str, _Task] = {}
        self.early_aborts = EarlyAborts()  # aborts that overtook their request
        self._inbox: deque = deque()
        self._cv = threading.Condition()
        self._stop = False
        self.num_transfers = 0
        self.bytes_sent = 0
        # Finishing a transfer waits for the decode side's acknowledgement: not on the engine thread.
        self._finishers = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"{name}-finish")
        self._thread = threading.Thread(target=self._run, name=f"{name}-engine", daemon=True)
        self._thread.start()

    # ---- any thread ----------------------------------------------------------------------------

    def _post(self, fn) -> None:
        with self._cv:
            self._inbox.append(fn)
            self._cv.notify()

    def submit(self, req: WorkerRequest, dest: KVDestination) -> concurrent.futures.Future:
        """Queue a prefill; the future resolves to ``FirstToken`` (or raises)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._post(lambda: self._add(req, dest, fut))
        return fut

    def abort(self, request_id: str) -> None:
        self._post(lambda: self._abort(request_id))

    def stats(self) -> WorkerStats:
        a = self.runner.allocator
        queued = sum(len(t.seq.token_ids) - t.seq.num_computed for t in list(self.waiting) + list(self.running))
        return WorkerStats(self.name, "prefill", len(self.running), len(self.waiting), queued,
                           a.num_free, a.num_blocks, self.runner.block_size, device=self.runner.device.type,
                           peak_memory_bytes=peak_memory_bytes(self.runner.device))

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=10)
        self._finishers.shutdown(wait=False, cancel_futures=True)
        self.sender.close()

    # ---- engine thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cv:
                while not self._inbox and not self.waiting and not self.running and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                tasks = list(self._inbox)
                self._inbox.clear()
            for fn in tasks:
                fn()
            if self.waiting or self.running:
                try:
                    self._step()
                except Exception as exc:  # keep serving; fail what was in the step
                    logger.exception("prefill step failed")
                    for t in list(self.running):
                        self._fail(t, f"prefill step failed: {exc}")

    def _add(self, req: WorkerRequest, dest: KVDestination, fut: concurrent.futures.Future) -> None:
        bs = self.runner.block_size
        need = -(-len(req.prompt_token_ids) // bs)
        if self.early_aborts.take(req.request_id):  # its abort overtook it: never start it
            fut.set_exception(concurrent.futures.CancelledError("aborted before the request reached the worker"))
        elif req.request_id in self.tasks:
            fut.set_exception(ValueError(f"request id {req.request_id!r} is already being prefilled here"))
        elif len(dest.block_ids) != need:
            fut.set_exception(ValueError(
                f"destination reserved {len(dest.block_ids)} blocks for a {len(req.prompt_token_ids)}-token "
                f"prompt that needs {need} (prefill and decode must use the same block size)"))
        elif need > self.runner.allocator.num_blocks:
            fut.set_exception(ValueError(
                f"prompt needs {need} KV blocks; this prefill worker's pool holds {self.runner.allocator.num_blocks}"))
        else:
            seq = Sequence(req.request_id, req.prompt_token_ids, req.params, bs, self.runner.device,
                           arrival_time=req.arrival_time or time.time(), num_generated=req.num_generated)
            task = _Task(req, dest, seq, fut)
            self.tasks[req.request_id] = task
            self.waiting.append(task)

    def _abort(self, request_id: str) -> None:
        t = self.tasks.get(request_id)
        if t is not None:
            self._fail(t, "aborted", aborted=True)
        else:
            self.early_aborts.remember(request_id)  # its request may still be on its way

    def _release(self, t: _Task) -> None:
        self.tasks.pop(t.req.request_id, None)
        if t in self.running:
            self.running.remove(t)
        if t in self.waiting:
            self.waiting.remove(t)
        t.seq.block_table.release(self.runner.allocator)

    def _fail(self, t: _Task, error: str, aborted: bool = False) -> None:
        t.aborted = aborted
        if t.transfer is not None:
            t.transfer.abort(error)
        self._release(t)
        if not t.future.done():
            t.future.set_exception(RuntimeError(error) if not aborted else concurrent.futures.CancelledError(error))

    def _admit(self, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            t = self.waiting[0]
            try:
                t.seq.block_table.reserve(self.runner.allocator, len(t.seq.token_ids))
            except OutOfBlocks:
                return  # blocks come back as transfers finish
            self.waiting.popleft()
            t.admitted_time = time.time()
            t.seq.start_running(t.admitted_time)
            try:
                t.transfer = self.sender.open(t.req.request_id, t.dest.address, self.runner.model.num_layers,
                                              len(t.dest.block_ids), self.config.transfer_timeout_s)
            except Exception as exc:
                self._fail(t, f"cannot reach the decode actor at {t.dest.address}: {exc}")
                continue
            self.running.append(t)
            budget -= len(t.seq.token_ids)

    def _step(self) -> None:
        # Admit only what this step's budget can start on: a prompt admitted early would hold its
        # blocks and an open transfer (whose deadline runs) while it waits behind the others.
        queued = sum(len(t.seq.token_ids) - t.seq.num_computed for t in self.running)
        self._admit(self.config.max_num_batched_tokens - queued)
        budget = self.config.max_num_batched_tokens
        bs = self.runner.block_size
        items, plan, finals = [], [], []
        for t in self.running:
            if budget <= 0:
                break
            s = t.seq
            start = s.num_computed
            end = min(len(s.token_ids), start + budget)
            final = end == len(s.token_ids)
            items.append(BatchItem(s.token_ids[start:end], start, s.block_table.blocks, sample=final))
            budget -= end - start
            s.mark_computed(end)
            upto = -(-end // bs) if final else end // bs  # blocks complete after this chunk
            if upto > t.sent_blocks:
                plan.append((t, t.sent_blocks, upto))
                t.sent_blocks = upto
            if final:
                finals.append(t)
        if not items:
            return
        hook = self._make_hook(plan)
        by_layer = self.config.kv_push == "layer"
        logits = self.runner.execute(items, layer_hook=hook if by_layer else None)
        ends, failed_tasks = [], []
        if finals:
            tokens, logprobs, failed = sample(logits, [t.seq.params for t in finals],
                                              [t.seq.next_generator() for t in finals])
            now = time.time()
            for j, t in enumerate(finals):
                if j in failed:  # this prompt only: the others of the step go on
                    failed_tasks.append((t, failed[j]))
                    continue
                lp = logprobs[j] if logprobs else None
                t.future.set_result(FirstToken(
                    t.req.request_id, tokens[j], lp if t.seq.params.logprobs else None, len(t.seq.token_ids),
                    {"queued": (t.admitted_time or now) - t.seq.arrival_time, "prefill": now - (t.admitted_time or now)},
                ))
                self.running.remove(t)
                ends.append((t, tokens[j], lp if t.seq.params.logprobs else None))
        for t, error in failed_tasks:  # before the pushes below, so none of its blocks is sent
            logger.warning("request %s: %s", t.req.request_id, error)
            t.future.set_exception(RuntimeError(error))
            self._fail(t, error, aborted=True)  # aborted: the push hook skips it
        if hook is not None and not by_layer:  # the same pieces, once the whole chunk is computed
            for layer in range(self.runner.model.num_layers):
                hook(layer)
        for t, token, lp in ends:  # after every piece of the request is queued
            self._finishers.submit(self._finish_transfer, t, token, lp)

    def _make_hook(self, plan: list[tuple[_Task, int, int]]):
        """A layer hook that pushes each planned block range, grouping layers into ~frame_bytes pieces."""
        if not plan:
            return None
        kv = self.runner.kv
        num_layers = self.runner.model.num_layers
        per_block_layer = kv.k[0, 0].numel() * kv.k.element_size() * 2
        groups = []
        for t, b0, b1 in plan:
            per_layer = per_block_layer * (b1 - b0)
            groups.append(max(1, min(num_layers, self.config.frame_bytes // max(1, per_layer))))
        first_unsent = [0] * len(plan)

        def hook(layer: int) -> None:
            for j, (t, b0, b1) in enumerate(plan):
                lo = first_unsent[j]
                if t.aborted or t.transfer is None:
                    continue
                if layer + 1 - lo >= groups[j] or layer == num_layers - 1:
                    src = t.seq.block_table.blocks[b0:b1]
                    data = kv.export_blocks(src, range(lo, layer + 1))
                    try:
                        t.transfer.send(range(lo, layer + 1), t.dest.block_ids[b0:b1], data)
                    except TransferError as exc:
                        logger.warning("request %s: %s", t.req.request_id, exc)
                    first_unsent[j] = layer + 1

        return hook

    def _finish_transfer(self, t: _Task, token: int, logprob: float | None) -> None:
        try:
            nbytes = t.transfer.finish(token, logprob)
            self.num_transfers += 1
            self.bytes_sent += nbytes
        except TransferError as exc:
            logger.warning("request %s: %s", t.req.request_id, exc)
        finally:
            self._post(lambda: self._release(t))


class PrefillWorker:
    """Ray actor class around ``PrefillEngine`` (created with ``ray.remote`` in ``start_prefill_workers``)."""

    def __init__(self, config: PrefillConfig, name: str) -> None:
        logging.basicConfig(level=logging.INFO)
        self.engine = PrefillEngine(config, name)
        self.name = name

    def ready(self) -> str:
        return self.name

    def prefill(self, req: WorkerRequest, dest: KVDestination) -> FirstToken:
        """Blocks (in one of the actor's threads) until token #1 is sampled; raises on failure."""
        fut = self.engine.submit(req, dest)
        try:
            return fut.result()
        except concurrent.futures.CancelledError:
            raise RuntimeError(f"request {req.request_id} was aborted") from None

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def stats(self) -> WorkerStats:
        return self.engine.stats()

    def model_info(self) -> dict:
        r = self.engine.runner
        return {"model": r.config.model, "model_dir": str(r.model_dir), "max_model_len": r.max_model_len,
                "vocab_size": r.vocab_size, "eos_token_ids": sorted(r.eos_token_ids),
                "block_size": r.block_size, "num_blocks": r.allocator.num_blocks}

    def transfer_stats(self) -> dict:
        return {"transfers": self.engine.num_transfers, "bytes_sent": self.engine.bytes_sent}


def start_prefill_workers(
    config: EngineConfig | PrefillConfig,
    num_workers: int = 1,
    num_cpus: float = 1,
    num_gpus: float = 0,
    resources: dict[str, float] | None = None,
    name_prefix: str = "pdserve-prefill",
) -> list:
    """Start prefill actors with the declared resources; wait until each has loaded its model."""
    import ray

    pc = config if isinstance(config, PrefillConfig) else PrefillConfig(engine=config)
    if num_gpus and pc.engine.device == "cpu":
        pc.engine.device = "cuda"
    cls = ray.remote(PrefillWorker)
    handles = [
        cls.options(name=f"{name_prefix}-{i}", num_cpus=num_cpus, num_gpus=num_gpus, resources=resources or {},
                    max_concurrency=64).remote(pc, f"{name_prefix}-{i}")
        for i in range(num_workers)
    ]
    ray.get([h.ready.remote() for h in handles])
    return handles
