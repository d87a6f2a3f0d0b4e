"""Plain data that crosses the boundary between the router and the worker actors.

These objects travel as Ray call arguments and return values, so they hold only small
Python values (token ids, numbers, strings), never tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.sampling_params import SamplingParams


@dataclass
class WorkerRequest:
    """A tokenized, validated request handed to a worker."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0  # time.time() when the router accepted it
    # A migrated request (its first worker died): how many tokens earlier attempts generated and
    # streamed. They end ``prompt_token_ids``, prefilled again; seeded draws continue after them.
    num_generated: int = 0


@dataclass
class RequestDelta:
    """What one engine step produced for one request.

    ``finish_reason`` is ``None`` while the request runs, then one of ``"stop"`` (EOS or a stop
    token), ``"length"`` (max_tokens or the context limit), ``"abort"`` (cancelled) or
    ``"error"`` (``error`` says why). ``timings`` is filled on the last delta only, with the
    worker-side phases in seconds: ``queued``, ``prefill``, ``decode`` (and ``transfer`` when the KV
    came from a prefill actor).
    """

    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    kv_transfer_bytes: int = 0  # last delta, KV from a prefill actor: the bytes that arrived


@dataclass
class WorkerStats:
    """A worker's load, as the router's placement policy reads it."""

    name: str
    role: str  # "colocated", "decode" or "prefill"
    num_running: int
    num_waiting: int
    queued_prompt_tokens: int
    free_blocks: int
    total_blocks: int
    block_size: int
    device: str = "cpu"  # "cpu" or "cuda": where the model runs
    peak_memory_bytes: int = 0  # CUDA: max_memory_allocated; CPU: the process's peak RSS


@dataclass
class EngineCounters:
    """Cumulative work of one worker's engine since it started (benchmarks, metrics).

    A step "with prefill" feeds at least one prompt chunk (or a recomputation after preemption);
    a decode step feeds one token per decoding sequence and nothing else. Times are the wall
    seconds of those steps (schedule, forward, sample).
    """

    num_steps: int = 0
    num_preemptions: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    decode_tokens_in_prefill_steps: int = 0
    prefill_step_s: float = 0.0
    decode_step_s: float = 0.0
