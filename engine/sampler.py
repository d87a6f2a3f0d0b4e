"""Turn the logits of the sampled positions into tokens, one request's parameters per row.

Each row is sampled on its own: a row whose logits are not usable (NaN, +inf, nothing left
after the filters) or whose draw fails is reported as failed, with a reason, and the other rows
of the batch keep their tokens. One request's numbers never fail its batch-mates.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pdserve.engine.sampling_params import SamplingParams


class Sampled(NamedTuple):
    """One step's draws: ``tokens[i]`` for row ``i`` (meaningless when ``i`` is in ``failed``),
    the chosen tokens' raw log-probabilities when any row asks for them, and the rows that could
    not be sampled with the reason for each."""

    tokens: list[int]
    logprobs: list[float] | None
    failed: dict[int, str]


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits outside top-k, then outside the top-p nucleus (in that order, as HF does)."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p; the first stays.
        drop = (probs.cumsum(-1) - probs) >= top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def _draw(row: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    """One random draw from a row whose largest logit is finite.

    The largest logit is subtracted before dividing by the temperature, so the scaled logits are
    at most 0 and never overflow, whatever the temperature (a tiny one sends the others to -inf,
    which leaves the argmax: the greedy limit).
    """
    row = _filter((row - row.max()) / p.temperature, p.top_k, p.top_p)
    probs = row.softmax(-1)
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0.0:
        raise ValueError("the sampling distribution is not finite")
    return int(torch.multinomial(probs, 1, generator=generator).item())


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> Sampled:
    """Sample one token per row of ``logits`` ``[N, vocab]`` (computed in float32).

    Greedy rows take the argmax. Random rows apply temperature, top-k and top-p, then draw with the
    row's own generator (seeded per request), so a request's draws do not depend on its batch.
    A row with a NaN or +inf logit, or with every logit -inf, fails (greedy or not), as does a
    random row whose draw raises; the rest of the batch is unaffected.
    """
    logits = logits.float()
    tokens = logits.argmax(-1).tolist()
    row_max = logits.max(-1).values
    usable = (~torch.isnan(logits).any(-1)) & torch.isfinite(row_max)
    failed: dict[int, str] = {
        i: "the model produced non-finite logits (NaN or inf) for this sequence"
        for i in (~usable).nonzero().flatten().tolist()
    }
    for i, p in enumerate(params):
        if p.greedy or i in failed:
            continue
        try:
            tokens[i] = _draw(logits[i], p, generators[i])
        except (RuntimeError, ValueError) as exc:  # torch reports bad distributions as RuntimeError
            failed[i] = f"sampling failed: {exc}"
    logprobs = None
    if any(p.logprobs for p in params):
        lp = torch.log_softmax(logits, -1)
        logprobs = lp.gather(1, torch.tensor(tokens, device=logits.device)[:, None]).squeeze(1).tolist()
    return Sampled(tokens, logprobs, failed)


def make_generator(params: SamplingParams, device: str | torch.device = "cpu") -> torch.Generator | None:
    """A per-request generator when the request is random and seeded, else ``None`` (global RNG)."""
    if params.greedy or params.seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(params.seed)
    return g
