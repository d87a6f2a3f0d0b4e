"""Statistics against numpy on known data, and goodput on a hand-made set of requests."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.loadtest.driver import ClientLag, RequestResult, RunResult
from pdserve.loadtest.stats import SLO, meets_slo, run_stats, summarize

LAG = ClientLag(0, 0, 0, 0, 0, 0)


def test_summarize_matches_numpy():
    data = np.random.default_rng(0).lognormal(size=997)
    s = summarize(data)
    assert s.count == 997
    assert s.mean == pytest.approx(np.mean(data))
    assert (s.p50, s.p90, s.p99) == pytest.approx(tuple(np.percentile(data, [50, 90, 99])))
    assert s.max == data.max()
    small = summarize([4.0, 1.0, 3.0, 2.0])  # by hand: linear interpolation between order statistics
    assert (small.mean, small.p50, small.p90, small.p99) == pytest.approx((2.5, 2.5, 3.7, 3.97))
    assert summarize([]).count == 0 and summarize([]).p99 is None


def req(index, ttft, itl, prompt=10, error=None, label=""):
    """A finished request: TTFT, then one token per ITL."""
    r = RequestResult(index=index, label=label, scheduled_s=float(index), sent_s=float(index))
    if error:
        r.error = error
        return r
    r.ttft_s, r.itl_s = ttft, list(itl)
    r.output_tokens = 1 + len(itl)
    r.e2e_s = ttft + sum(itl)
    r.finish_reason = "length"
    r.prompt_tokens = prompt
    r.server = {"queued_s": 0.01, "prefill_s": 0.1 * index, "transfer_s": 0.0, "ttft_s": ttft,
                "decode_s": sum(itl), "e2e_s": r.e2e_s}
    return r


# Four requests: a: fast; b: slow first token; c: one 0.9 s stall among 0.05 s gaps; d: failed.
A = req(0, 0.2, [0.05] * 9, label="short")
B = req(1, 3.0, [0.05] * 9, label="long")
C = req(2, 0.3, [0.05] * 4 + [0.9] + [0.05] * 4, label="short")
D = req(3, 0, [], error="RESOURCE_EXHAUSTED: busy")


def test_meets_slo_checks_each_objective():
    slo = SLO(ttft_s=1.0, itl_s=0.5)
    assert [meets_slo(r, slo) for r in (A, B, C, D)] == [True, False, False, False]
    assert [meets_slo(r, SLO(ttft_s=1.0)) for r in (A, B, C, D)] == [True, False, True, False]
    assert [meets_slo(r, SLO()) for r in (A, B, C, D)] == [True, True, True, False]
    # C's median gap is fine: a p50 ITL objective passes it, p99 does not.
    assert meets_slo(C, SLO(itl_s=0.5, itl_quantile=50)) and not meets_slo(C, SLO(itl_s=0.5, itl_quantile=99))
    # TPOT: C averages (0.05 * 8 + 0.9) / 9 = 0.144 s per token after the first.
    assert C.tpot_s == pytest.approx(1.3 / 9)
    assert meets_slo(C, SLO(tpot_s=0.15)) and not meets_slo(C, SLO(tpot_s=0.14))


def test_run_stats_on_a_hand_made_run():
    run = RunResult(rate=1.0, results=[A, B, C, D], duration_s=8.0, client=LAG)
    st = run_stats(run, SLO(ttft_s=1.0, itl_s=0.5))
    assert (st.num_requests, st.num_ok, st.num_errors) == (4, 3, 1)
    assert st.goodput == pytest.approx(1 / 8.0)  # only A
    assert st.slo_attainment == pytest.approx(1 / 4)
    assert st.request_throughput == pytest.approx(3 / 8.0)
    assert st.output_token_throughput == pytest.approx(30 / 8.0)
    assert st.total_token_throughput == pytest.approx(60 / 8.0)
    ttfts = [0.2, 3.0, 0.3]
    assert st.ttft.mean == pytest.approx(np.mean(ttfts))
    assert st.ttft.p90 == pytest.approx(np.percentile(ttfts, 90))
    itls = A.itl_s + B.itl_s + C.itl_s  # pooled over every token
    assert st.itl.count == 27
    assert st.itl.p99 == pytest.approx(np.percentile(itls, 99))
    assert st.tpot.p50 == pytest.approx(np.median([A.tpot_s, B.tpot_s, C.tpot_s]))
    assert st.e2e.max == pytest.approx(3.45)
    assert st.server["prefill_s"].mean == pytest.approx(0.1)
    assert st.by_label["short"]["count"] == 2 and st.by_label["long"]["ttft"].p50 == pytest.approx(3.0)
    assert st.to_json()["itl"]["count"] == 27


def test_run_stats_without_successes():
    st = run_stats(RunResult(rate=None, results=[D], duration_s=0.0, client=LAG), SLO(ttft_s=1.0))
    assert (st.goodput, st.request_throughput, st.ttft.count) == (0.0, 0.0, 0)
