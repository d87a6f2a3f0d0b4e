"""One request's state inside a worker: tokens, KV blocks, progress and finish."""

from __future__ import annotations

import enum
import time

import torch

from pdserve.engine.block_allocator import BlockTable
from pdserve.engine.sampler import make_generator
from pdserve.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # no KV computed yet (or preempted: KV dropped, recompute from scratch)
    RUNNING = "running"  # holds blocks; prefilling or decoding
    FINISHED = "finished"


class Sequence:
    """Prompt + generated tokens, the block table holding their KV, and the sampling state.

    ``num_computed`` counts tokens whose KV is in the cache. A sequence is prefilling while
    ``num_computed < len(prompt)`` and decoding afterwards; at every point the next tokens to feed
    are ``token_ids[num_computed:]``.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, block_size: int,
                 device: str | torch.device = "cpu", arrival_time: float | None = None,
                 num_generated: int = 0) -> None:
        self.request_id: str = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt, then every sampled token
        self.params: SamplingParams = params
        self.block_table: BlockTable = BlockTable(block_size)  # the blocks holding this sequence's KV
        self.num_computed: int = 0  # leading tokens whose KV is in the cache
        self.status: SequenceStatus = SequenceStatus.WAITING
        self.finish_reason: str | None = None  # "stop", "length", "abort", "error" once finished
        self.output_logprobs: list[float] = []  # logprob of each sampled token, when asked for
        self.generator: torch.Generator | None = make_generator(params, device)  # seeded requests only
        self.arrival_time: float = arrival_time if arrival_time is not None else time.time()  # wall clock
        self.first_scheduled_time: float | None = None  # wall clock when it first got blocks and ran
        self.first_token_time: float | None = None  # wall clock of its first sampled token
        self.num_preemptions: int = 0  # times its KV was dropped to make room for others
        self.transfer_s: float | None = None  # seconds its prompt's KV took to arrive from a prefill actor
        self.transfer_bytes: int = 0  # bytes of that KV that arrived
        self.num_generated: int = num_generated  # tokens an earlier attempt generated (they end the prompt)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the KV cache (the whole context after a preemption)."""
        return len(self.token_ids) - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def start_running(self, now: float | None = None) -> None:
        """It holds blocks and runs (prefills or decodes) from now; the first time stamps
        ``first_scheduled_time`` (``now``, wall clock, defaults to the present)."""
        self.status = SequenceStatus.RUNNING
        if self.first_scheduled_time is None:
            self.first_scheduled_time = now if now is not None else time.time()

    def mark_computed(self, num_tokens: int) -> None:
        """The KV of ``token_ids[:num_tokens]`` is now in its blocks (after a step or a transfer)."""
        self.num_computed = num_tokens
        self.block_table.num_tokens = num_tokens

    def kv_received(self, transfer_s: float | None, transfer_bytes: int) -> None:
        """The prompt's KV arrived from a prefill actor: the whole prompt is computed, and the
        transfer's time and size are kept for the request's summary."""
        self.mark_computed(len(self.prompt_token_ids))
        if self.first_scheduled_time is None:
            self.first_scheduled_time = time.time()
        self.transfer_s = transfer_s
        self.transfer_bytes = transfer_bytes

    def preempt(self) -> None:
        """Back to waiting with no KV (the caller has freed its blocks): every token is recomputed
        when it runs again."""
        self.num_computed = 0
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1

    def finish(self, reason: str) -> None:
        """It ends with ``reason``; freeing its blocks is the caller's job."""
        self.finish_reason = reason
        self.status = SequenceStatus.FINISHED

    def next_generator(self) -> torch.Generator | None:
        """The generator for the next token of a seeded request, seeded by (seed, token index).

        Each draw depends only on the request's seed and the token's index, so a request samples
        the same tokens wherever its tokens are drawn: one worker, a prefill actor then a decode
        actor, after a preemption, or after a migration.
        """
        if self.generator is None:
            return None
        index = self.num_generated + self.num_output_tokens
        self.generator.manual_seed((self.params.seed * 0x9E3779B1 + index) % (1 << 63))
        return self.generator

    def append_token(self, token: int, logprob: float | None, eos_token_ids: set[int], max_model_len: int) -> str | None:
        """Record a sampled token; return the finish reason if this token ends the request."""
        self.token_ids.append(token)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if self.first_token_time is None:
            self.first_token_time = time.time()
        p = self.params
        if (not p.ignore_eos and token in eos_token_ids) or token in p.stop_token_ids:
            return "stop"
        if self.num_output_tokens >= p.max_tokens or len(self.token_ids) >= max_model_len:
            return "length"
        return None
