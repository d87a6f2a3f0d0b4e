"""Per-request sampling parameters: one small dataclass, validated in one place."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# A temperature below this samples as greedy: dividing logits by a smaller one overflows float32
# (or makes the distribution a one-hot anyway), as in vLLM's _SAMPLING_EPS.
SAMPLING_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to pick the next tokens of one request.

    ``temperature`` below ``SAMPLING_EPS`` (0 included) means greedy. ``top_k == 0`` and
    ``top_p == 1`` disable those filters.
    ``seed`` makes random sampling reproducible per request, whatever else shares the batch.
    ``logprobs`` asks for the log-probability of each chosen token under the model's raw
    distribution (before temperature, top-k and top-p), as vLLM reports them.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ``ValueError`` naming the field and its allowed range for any bad value."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_finite(self.temperature) or self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0 and finite (below {SAMPLING_EPS:g} means greedy), "
                             f"got {self.temperature!r}")
        if not _is_finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be in [0, 2^63), got {self.seed!r}")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
                limit = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
                raise ValueError(f"stop_token_ids must hold token ids in {limit}, got {t!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
