"""Arrival processes: Poisson and gamma gaps have the right mean and burstiness, a seed replays
the same pattern, and a rate sweep compresses one pattern rather than drawing a new one."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.loadtest.arrivals import arrival_times

N = 40000


def gaps(times):
    return np.diff(times)


def test_poisson_gaps_are_exponential_at_the_rate():
    t = arrival_times(N, rate=4.0, kind="poisson", seed=1)
    g = gaps(t)
    assert t[0] == 0 and np.all(g >= 0)
    assert abs(g.mean() - 0.25) < 0.01  # sd of the mean: 0.25 / sqrt(N) = 0.00125
    assert abs(g.std() / g.mean() - 1.0) < 0.03  # exponential: coefficient of variation 1
    # Poisson counts: the number of arrivals per second has mean = variance = rate.
    counts = np.bincount(t.astype(int))[:-1]
    assert abs(counts.mean() - 4) < 0.1 and abs(counts.var() / counts.mean() - 1) < 0.1


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_gaps_have_the_asked_burstiness(burstiness):
    g = gaps(arrival_times(N, rate=2.0, kind="gamma", burstiness=burstiness, seed=2))
    assert abs(g.mean() - 0.5) < 0.5 * 0.03
    assert abs(g.std() / g.mean() - 1 / np.sqrt(burstiness)) < 0.05 / np.sqrt(burstiness)


def test_burst_sends_everything_at_once():
    assert np.array_equal(arrival_times(5, rate=123, kind="burst"), np.zeros(5))


def test_seeded_and_rate_sweeps_compress_one_pattern():
    a = arrival_times(100, 1.0, "gamma", 0.5, seed=9)
    assert np.array_equal(a, arrival_times(100, 1.0, "gamma", 0.5, seed=9))
    assert not np.array_equal(a, arrival_times(100, 1.0, "gamma", 0.5, seed=10))
    assert np.allclose(arrival_times(100, 4.0, "gamma", 0.5, seed=9), a / 4)
    assert len(arrival_times(1, 1.0)) == 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(n=5, rate=0.0), "rate must be"),
    (dict(n=5, rate=float("nan")), "rate must be"),
    (dict(n=0, rate=1.0), ">= 1"),
    (dict(n=5, rate=1.0, kind="uniform"), "choose from"),
    (dict(n=5, rate=1.0, kind="gamma", burstiness=0), "burstiness"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        arrival_times(**kwargs)
