"""Per-request sampling parameters: one small dataclass, validated in one place."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick the next tokens of one request.

    ``temperature == 0`` means greedy. ``top_k == 0`` and ``top_p == 1`` disable those filters.
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
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be in [0, 2^63), got {self.seed!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
                limit = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
                raise ValueError(f"stop_token_ids must hold token ids in {limit}, got {t!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
