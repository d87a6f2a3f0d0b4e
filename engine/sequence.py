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
                 device: str | torch.device = "cpu", arrival_time: float | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.params = params
        self.block_table = BlockTable(block_size)
        self.num_computed = 0
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.output_logprobs: list[float] = []
        self.generator = make_generator(params, device)
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.num_preemptions = 0

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

    def next_generator(self) -> torch.Generator | None:
        """The generator for the next token of a seeded request, seeded by (seed, token index).

        Each draw depends only on the request's seed and the token's index, so a request samples
        the same tokens wherever its tokens are drawn: one worker, a prefill actor then a decode
        actor, or after a preemption.
        """
        if self.generator is None:
            return None
        self.generator.manual_seed((self.params.seed * 0x9E3779B1 + self.num_output_tokens) % (1 << 63))
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
