"""Statistics of a load run: latency distributions, throughput, and goodput under SLOs.

Percentiles are numpy's (linear interpolation between order statistics). ITLs are pooled over
every token of every successful request, so ``itl.p99`` is the 99th percentile token gap a
user saw; TTFT, TPOT and end-to-end latency have one value per successful request.

Goodput is the rate of requests that succeeded *and* met every SLO given: TTFT at most
``ttft_s``, the request's own ITL percentile ``itl_quantile`` (default its p99) at most
``itl_s``, and its TPOT at most ``tpot_s``. Rates are divided by the run's duration (first send
to last response).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from pdserve.loadtest.driver import RequestResult, RunResult

PERCENTILES = (50, 90, 99)
SERVER_PHASES = ("queued_s", "prefill_s", "transfer_s", "decode_s")


@dataclass
class Summary:
    """Mean and percentiles of one latency, in seconds; all ``None`` when there were no values."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None


def summarize(values) -> Summary:
    a = np.asarray(list(values), dtype=float)
    if a.size == 0:
        return Summary(0, None, None, None, None, None)
    p50, p90, p99 = (float(x) for x in np.percentile(a, PERCENTILES))
    return Summary(int(a.size), float(a.mean()), p50, p90, p99, float(a.max()))


@dataclass
class SLO:
    """Service-level objectives; ``None`` means not checked."""

    ttft_s: float | None = None
    itl_s: float | None = None
    tpot_s: float | None = None
    itl_quantile: float = 99.0  # which percentile of a request's own ITLs must stay under itl_s

    def describe(self) -> str:
        parts = []
        if self.ttft_s is not None:
            parts.append(f"TTFT <= {self.ttft_s * 1e3:g} ms")
        if self.itl_s is not None:
            parts.append(f"p{self.itl_quantile:g} ITL <= {self.itl_s * 1e3:g} ms")
        if self.tpot_s is not None:
            parts.append(f"TPOT <= {self.tpot_s * 1e3:g} ms")
        return " and ".join(parts) or "none (every successful request counts)"


def meets_slo(r: RequestResult, slo: SLO) -> bool:
    """Whether one request succeeded within every objective of ``slo``."""
    if not r.ok or r.ttft_s is None:
        return False
    if slo.ttft_s is not None and r.ttft_s > slo.ttft_s:
        return False
    if slo.itl_s is not None and r.itl_s and float(np.percentile(r.itl_s, slo.itl_quantile)) > slo.itl_s:
        return False
    tpot = r.tpot_s
    if slo.tpot_s is not None and tpot is not None and tpot > slo.tpot_s:
        return False
    return True


@dataclass
class RunStats:
    """Aggregates of one run."""

    num_requests: int
    num_ok: int
    num_errors: int
    duration_s: float
    request_throughput: float  # successful requests/s
    output_token_throughput: float  # output tokens/s
    total_token_throughput: float  # prompt + output tokens/s
    goodput: float  # requests/s that met every SLO
    slo_attainment: float  # share of all requests that met every SLO
    ttft: Summary
    itl: Summary
    tpot: Summary
    e2e: Summary
    server: dict[str, Summary]  # the server's per-phase timings
    by_label: dict[str, dict]  # TTFT and ITL per class of request (e.g. short/long prompts)

    def to_json(self) -> dict:
        return asdict(self)


def run_stats(run: RunResult, slo: SLO) -> RunStats:
    results = run.results
    ok = [r for r in results if r.ok]
    duration = run.duration_s if run.duration_s > 0 else float("inf")  # no time: rates of 0
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    good = sum(meets_slo(r, slo) for r in results)
    labels = sorted({r.label for r in results if r.label})
    return RunStats(
        num_requests=len(results),
        num_ok=len(ok),
        num_errors=len(results) - len(ok),
        duration_s=run.duration_s,
        request_throughput=len(ok) / duration,
        output_token_throughput=out_tokens / duration,
        total_token_throughput=(out_tokens + prompt_tokens) / duration,
        goodput=good / duration,
        slo_attainment=good / len(results) if results else 0.0,
        ttft=summarize(r.ttft_s for r in ok),
        itl=summarize(x for r in ok for x in r.itl_s),
        tpot=summarize(r.tpot_s for r in ok if r.tpot_s is not None),
        e2e=summarize(r.e2e_s for r in ok),
        server={p: summarize(r.server[p] for r in ok if r.server) for p in SERVER_PHASES},
        by_label={
            label: {"count": sum(r.label == label for r in results),
                    "ttft": summarize(r.ttft_s for r in ok if r.label == label),
                    "itl": summarize(x for r in ok if r.label == label for x in r.itl_s)}
            for label in labels
        },
    )
