"""Continuous batching: decide, every step, which sequences run and with how many tokens.

Policy only: the scheduler moves sequences between queues and reserves KV blocks; it never
touches tensors (the worker's ModelRunner executes what ``schedule()`` returns).

Each step, in priority order and under ``max_num_batched_tokens`` / ``max_num_seqs``:
1. running sequences that are decoding get one token each (inter-token latency comes first);
2. running sequences still prefilling get their next prompt chunk;
3. waiting sequences are admitted, oldest first, when the blocks for their first chunk can be
   reserved; the rest of their prompt follows in later steps (chunked prefill).
When a running sequence needs a block and none is free, the most recently admitted running
sequence is preempted: its blocks are freed and it goes back to the front of the waiting queue,
to be recomputed from its tokens later (the output is unchanged, only delayed).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdserve.engine.block_allocator import BlockAllocator, OutOfBlocks
from pdserve.engine.sequence import Sequence


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # feed token_ids[num_computed : num_computed + num_tokens]


@dataclass
class SchedulerOutput:
    """What runs this step, as plain data that can be logged and tested."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write block copies

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, max_model_len: int) -> None:
        self.config = config
        self.allocator = allocator
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last one is preempted first

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose KV is already in its (reserved) blocks: it decodes from the next step."""
        seq.start_running()
        self.running.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def num_waiting_tokens(self) -> int:
        return sum(s.num_pending for s in self.waiting) + sum(
            s.num_pending for s in self.running if s.num_pending > 1
        )

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        seq.block_table.release(self.allocator)
        seq.preempt()
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _reserve(self, seq: Sequence, n: int, out: SchedulerOutput, may_preempt: bool) -> bool:
        """Reserve blocks for ``n`` more tokens of ``seq``, or return False.

        With ``may_preempt`` (``seq`` is running), running sequences not scheduled this step are
        preempted, most recently admitted first, until the blocks are free; when that is ``seq``
        itself, it is preempted and False is returned.
        """
        while True:
            try:
                out.copies.extend(seq.block_table.reserve(self.allocator, seq.num_computed + n))
                return True
            except OutOfBlocks:
                if not may_preempt:
                    return False
                scheduled = {id(x.seq) for x in out.scheduled}
                victim = [s for s in self.running if s is seq or id(s) not in scheduled][-1]
                self._preempt(victim, out)
                if victim is seq:
                    return False

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # 1 + 2: running sequences, decodes before prefill chunks.
        for seq in sorted(self.running, key=lambda s: s.num_pending > 1):
            if seq not in self.running:  # preempted while making room for an earlier one
                continue
            if budget <= 0:
                break
            n = min(seq.num_pending, budget)
            if not self._reserve(seq, n, out, may_preempt=True):
                continue  # it was the most recently admitted one left: it yielded itself
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        if out.preempted:
            return out  # memory is short: let the survivors run before admitting anyone
        # 3: admit waiting sequences (never by preempting running ones).
        while self.waiting and budget > 0 and len(out.scheduled) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if len(self.running) >= self.config.max_num_seqs:
                break
            n = min(seq.num_pending, budget)
            if not self._reserve(seq, n, out, may_preempt=False):
                break
            self.waiting.popleft()
            seq.start_running()
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return out

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence (finished or aborted) and free its blocks."""
        seq.finish(reason)
        seq.block_table.release(self.allocator)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
