"""Workloads: what each request of a load test asks for (its prompt and its output length).

A workload is a list of ``RequestSpec``s, drawn from a seeded generator so that the same seed
gives the same requests on every run and for every request rate (arrival times are drawn
separately, in ``arrivals.py``, so a rate sweep replays the same requests faster or slower).

Kinds:
- ``fixed``: every prompt and every output has the same length;
- ``uniform``: prompt and output lengths drawn uniformly from ranges;
- ``mixed``: short prompts, plus a share of long ones (the case where a colocated worker's
  prefill of a long prompt stalls the decodes that share its batch);
- ``chat``: chat messages from a built-in set of questions, rendered by the server's template;
- ``trace``: a replay of a JSONL file, one request per line, arrival times included.

Synthetic prompts are token ids (``token_ids`` input), drawn per request from its own seed, so
a prompt has exactly the length asked for whatever the tokenizer; outputs run to their length
when ``ignore_eos`` is set (the load test's default).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

WORKLOADS = ("fixed", "uniform", "mixed", "chat", "trace")

# Questions for the chat workload: short user turns of different kinds, answered at any length.
CHAT_QUESTIONS = (
    "What is the difference between a process and a thread?",
    "Give me three ideas for a rainy Sunday afternoon.",
    "Explain what a hash table is to a ten-year-old.",
    "Write a short poem about a lighthouse keeper.",
    "How do I keep basil alive on a windowsill?",
    "Summarize the water cycle in a few sentences.",
    "What should I pack for a two-day hike in the mountains?",
    "Why is the sky blue during the day and red at sunset?",
    "Suggest a name for a small bakery that sells sourdough bread.",
    "What are the pros and cons of working from home?",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Describe how a bicycle gear system works.",
    "List five habits that help people sleep better.",
    "What is a prime number? Give a few examples.",
    "Write a polite email asking a colleague to review my report.",
    "How does compound interest work?",
)


class WorkloadError(ValueError):
    """A workload that cannot be built from what the user gave (the message says what to fix)."""


@dataclass(frozen=True)
class LengthRange:
    """Token lengths drawn uniformly from ``[low, high]`` (both included); ``low == high`` is fixed."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise WorkloadError(f"a length range needs 1 <= low <= high, got {self.low}:{self.high}")

    @classmethod
    def parse(cls, text: str) -> "LengthRange":
        """``"128"`` (fixed) or ``"64:512"`` (uniform)."""
        parts = text.split(":")
        try:
            values = [int(p) for p in parts]
        except ValueError:
            raise WorkloadError(f"not a token length or range: {text!r} (use e.g. 128 or 64:512)") from None
        if len(values) == 1:
            return cls(values[0], values[0])
        if len(values) == 2:
            return cls(values[0], values[1])
        raise WorkloadError(f"not a token length or range: {text!r} (use e.g. 128 or 64:512)")

    @property
    def is_fixed(self) -> bool:
        return self.low == self.high

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(self.low, self.high + 1, size=n)

    def __str__(self) -> str:
        return str(self.low) if self.is_fixed else f"{self.low}:{self.high}"


@dataclass
class RequestSpec:
    """One request of a workload: exactly one input, the output length, and (for traces) its arrival."""

    index: int
    output_tokens: int
    prompt_tokens: int | None = None  # synthetic prompt: this many random token ids
    prompt: str | None = None  # plain text
    messages: list[dict] | None = None  # chat messages
    label: str = ""  # a class of requests, e.g. "short"/"long" in the mixed workload
    arrival_s: float | None = None  # traces only: seconds after the start
    seed: int = 0  # draws this request's token ids

    def inputs(self, vocab_size: int) -> dict:
        """The input keyword argument of ``AsyncClient.generate`` for this request."""
        if self.prompt_tokens is not None:
            rng = np.random.default_rng([self.seed, self.index])
            return {"token_ids": rng.integers(0, vocab_size, size=self.prompt_tokens).tolist()}
        if self.messages is not None:
            return {"messages": self.messages}
        return {"prompt": self.prompt}

    def to_json(self) -> dict:
        out = {"index": self.index, "label": self.label, "output_tokens": self.output_tokens}
        for key in ("prompt_tokens", "prompt", "messages", "arrival_s"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


@dataclass
class WorkloadConfig:
    """Everything that defines a workload; ``build_workload`` turns it into requests."""

    kind: str = "uniform"
    num_requests: int = 100
    prompt_tokens: LengthRange = field(default_factory=lambda: LengthRange(32, 256))
    output_tokens: LengthRange = field(default_factory=lambda: LengthRange(16, 128))
    long_prompt_tokens: LengthRange = field(default_factory=lambda: LengthRange(1024, 2048))
    long_share: float = 0.2
    trace: str | None = None
    seed: int = 0

    def describe(self) -> str:
        if self.kind == "trace":
            return f"trace {self.trace}"
        text = f"{self.kind}, {self.num_requests} requests"
        if self.kind != "chat":
            text += f", prompts {self.prompt_tokens} tokens"
        if self.kind == "mixed":
            text += f" ({self.long_share:.0%} long: {self.long_prompt_tokens} tokens)"
        return text + f", outputs {self.output_tokens} tokens, seed {self.seed}"


def build_workload(config: WorkloadConfig) -> list[RequestSpec]:
    """The requests of ``config``; the same config gives the same requests."""
    kind = config.kind
    if kind not in WORKLOADS:
        raise WorkloadError(f"unknown workload {kind!r}; choose from {', '.join(WORKLOADS)}")
    if kind == "trace":
        if not config.trace:
            raise WorkloadError("the trace workload needs a file: --trace FILE.jsonl")
        return load_trace(config.trace)
    n = config.num_requests
    if n < 1:
        raise WorkloadError(f"the number of requests must be >= 1, got {n}")
    rng = np.random.default_rng(config.seed)
    outputs = config.output_tokens.draw(rng, n)
    if kind == "fixed":
        if not (config.prompt_tokens.is_fixed and config.output_tokens.is_fixed):
            raise WorkloadError("the fixed workload takes single lengths (e.g. --prompt-tokens 128 "
                                "--output-tokens 64); use --workload uniform for ranges")
    if kind in ("fixed", "uniform"):
        prompts = config.prompt_tokens.draw(rng, n)
        return [RequestSpec(i, int(outputs[i]), prompt_tokens=int(prompts[i]), seed=config.seed) for i in range(n)]
    if kind == "mixed":
        if not 0 <= config.long_share <= 1:
            raise WorkloadError(f"the share of long prompts must be in [0, 1], got {config.long_share}")
        # Exactly round(share * n) long prompts at seeded random positions, so a short run still
        # has the share it asked for.
        num_long = int(round(config.long_share * n))
        is_long = np.zeros(n, dtype=bool)
        is_long[rng.choice(n, size=num_long, replace=False)] = True
        short = config.prompt_tokens.draw(rng, n)
        long = config.long_prompt_tokens.draw(rng, n)
        return [RequestSpec(i, int(outputs[i]), prompt_tokens=int(long[i] if is_long[i] else short[i]),
                            label="long" if is_long[i] else "short", seed=config.seed) for i in range(n)]
    # chat
    picks = rng.integers(0, len(CHAT_QUESTIONS), size=n)
    return [RequestSpec(i, int(outputs[i]), messages=[{"role": "user", "content": CHAT_QUESTIONS[k]}],
                        label="chat", seed=config.seed) for i, k in enumerate(picks)]


# ---- traces ------------------------------------------------------------------------------------

TRACE_FIELDS = {"arrival_s", "prompt_tokens", "prompt", "messages", "output_tokens", "label"}


def load_trace(path: str | Path) -> list[RequestSpec]:
    """Requests from a JSONL trace, ordered by arrival.

    Each line is an object with ``arrival_s`` (seconds after the start, >= 0), exactly one of
    ``prompt_tokens`` (an integer >= 1: a random prompt of that many tokens), ``prompt`` (text) or
    ``messages`` (a list of ``{role, content}``), ``output_tokens`` (an integer >= 1) and optionally
    ``label`` (a string). Blank lines are skipped. Any other content raises ``WorkloadError``
    naming the file, the line and the problem.
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise WorkloadError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    specs = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise WorkloadError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        specs.append(_trace_spec(obj, where, len(specs)))
    if not specs:
        raise WorkloadError(f"trace {path} has no requests")
    specs.sort(key=lambda s: s.arrival_s)
    for i, s in enumerate(specs):
        s.index = i
    return specs


def _trace_spec(obj: dict, where: str, index: int) -> RequestSpec:
    unknown = set(obj) - TRACE_FIELDS
    if unknown:
        raise WorkloadError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}; "
                            f"allowed: {', '.join(sorted(TRACE_FIELDS))}")
    arrival = obj.get("arrival_s")
    if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not math.isfinite(arrival) or arrival < 0:
        raise WorkloadError(f"{where}: arrival_s must be a number of seconds >= 0, got {arrival!r}")
    output = obj.get("output_tokens")
    if not _is_count(output):
        raise WorkloadError(f"{where}: output_tokens must be an integer >= 1, got {output!r}")
    inputs = [k for k in ("prompt_tokens", "prompt", "messages") if k in obj]
    if len(inputs) != 1:
        raise WorkloadError(f"{where}: give exactly one of prompt_tokens, prompt or messages (got "
                            f"{', '.join(inputs) or 'none'})")
    spec = RequestSpec(index, output, arrival_s=float(arrival), label=str(obj.get("label", "")))
    value = obj[inputs[0]]
    if inputs[0] == "prompt_tokens":
        if not _is_count(value):
            raise WorkloadError(f"{where}: prompt_tokens must be an integer >= 1, got {value!r}")
        spec.prompt_tokens = value
    elif inputs[0] == "prompt":
        if not isinstance(value, str) or not value:
            raise WorkloadError(f"{where}: prompt must be a non-empty string")
        spec.prompt = value
    else:
        if not isinstance(value, list) or not value or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value
        ):
            raise WorkloadError(f"{where}: messages must be a non-empty list of {{\"role\": ..., \"content\": ...}}")
        spec.messages = value
    return spec


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
