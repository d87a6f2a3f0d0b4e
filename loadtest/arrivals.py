"""Arrivals: when each request of a load test is sent.

- ``poisson``: independent arrivals at ``rate`` requests/s (exponential gaps);
- ``gamma``: gaps from a gamma distribution with mean ``1/rate`` and shape ``burstiness``: 1 is
  Poisson, below 1 burstier (clumps of requests, then silences), above 1 more regular; the
  coefficient of variation of the gaps is ``1/sqrt(burstiness)``;
- ``burst``: every request at once (the rate is ignored).

Gaps are drawn as unit-mean variates and then divided by the rate, so with one seed a rate sweep
replays the same pattern, compressed: the request that comes third at 1 req/s also comes third
at 4 req/s. The first request goes at time 0.
"""

from __future__ import annotations

import numpy as np

ARRIVALS = ("poisson", "gamma", "burst")


def arrival_times(n: int, rate: float, kind: str = "poisson", burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """``n`` send times in seconds after the start, non-decreasing, the first one 0."""
    if kind not in ARRIVALS:
        raise ValueError(f"unknown arrival process {kind!r}; choose from {', '.join(ARRIVALS)}")
    if n < 1:
        raise ValueError(f"the number of requests must be >= 1, got {n}")
    if kind == "burst":
        return np.zeros(n)
    if not rate > 0 or not np.isfinite(rate):
        raise ValueError(f"the request rate must be a number > 0 (requests/s), got {rate}")
    # A stream of its own (not the workload's), so the requests do not change with the arrivals.
    rng = np.random.default_rng([seed, 1])
    if kind == "poisson":
        gaps = rng.exponential(1.0, size=n - 1)
    else:
        if not burstiness > 0 or not np.isfinite(burstiness):
            raise ValueError(f"burstiness must be a number > 0 (1 is Poisson, < 1 burstier), got {burstiness}")
        gaps = rng.gamma(burstiness, 1.0 / burstiness, size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps / rate)])
