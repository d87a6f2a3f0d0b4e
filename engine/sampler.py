"""Turn the logits of the sampled positions into tokens, one request's parameters per row."""

from __future__ import annotations

import torch

from pdserve.engine.sampling_params import SamplingParams


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


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> tuple[list[int], list[float] | None]:
    """Sample one token per row of ``logits`` ``[N, vocab]``.

    Greedy rows take the argmax. Random rows apply temperature, top-k and top-p, then draw with the
    row's own generator (seeded per request), so a request's draws do not depend on its batch.
    Returns the tokens and, when any row asks for them, the chosen tokens' raw log-probabilities.
    """
    logits = logits.float()
    tokens = logits.argmax(-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = _filter(logits[i] / p.temperature, p.top_k, p.top_p)
        probs = row.softmax(-1)
        tokens[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    logprobs = None
    if any(p.logprobs for p in params):
        lp = torch.log_softmax(logits, -1)
        logprobs = lp.gather(1, torch.tensor(tokens, device=logits.device)[:, None]).squeeze(1).tolist()
    return tokens, logprobs


def make_generator(params: SamplingParams, device: str | torch.device = "cpu") -> torch.Generator | None:
    """A per-request generator when the request is random and seeded, else ``None`` (global RNG)."""
    if params.greedy or params.seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(params.seed)
    return g
