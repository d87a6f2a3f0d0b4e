"""A sweep: the same requests against one server at each request rate, one run after another.

Each run starts when the previous one has fully drained, so runs never overlap. A trace
workload is one run at the trace's own times (divided by ``speedup``); ``burst`` arrivals are
one run with every request at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from pdserve.client import AsyncClient, ServerInfo
from pdserve.loadtest.arrivals import arrival_times
from pdserve.loadtest.driver import RunOptions, RunResult, run_load
from pdserve.loadtest.workload import RequestSpec


@dataclass
class Schedule:
    """When the requests of a workload go out: arrival process, rates, seed."""

    arrival: str = "poisson"
    rates: Sequence[float] = (1.0,)
    burstiness: float = 1.0
    seed: int = 0
    speedup: float = 1.0  # traces: play the trace this many times faster

    def plans(self, specs: Sequence[RequestSpec]) -> list[tuple[float | None, np.ndarray]]:
        """``(offered rate, send times)`` of every run in the sweep."""
        n = len(specs)
        if all(s.arrival_s is not None for s in specs):  # a trace brings its own times
            if not self.speedup > 0:
                raise ValueError(f"the trace speed-up must be > 0, got {self.speedup}")
            times = np.array([s.arrival_s for s in specs]) / self.speedup
            span = float(times.max() - times.min())
            return [(n / span if span > 0 else None, times)]
        if self.arrival == "burst":
            return [(None, arrival_times(n, 1.0, "burst"))]
        if not self.rates:
            raise ValueError("give at least one request rate")
        return [(float(r), arrival_times(n, r, self.arrival, self.burstiness, self.seed)) for r in self.rates]


async def run_sweep(target: str, specs: Sequence[RequestSpec], schedule: Schedule, options: RunOptions,
                    progress=None, label: str = "", connect_timeout_s: float = 60.0) -> tuple[ServerInfo, list[RunResult]]:
    """Every run of ``schedule`` against the server at ``target``; ``progress`` is a tqdm bar
    (or ``None``) advanced by one per finished request."""
    plans = schedule.plans(specs)
    async with AsyncClient(target) as client:
        info = await client.server_info(timeout=connect_timeout_s)
        runs = []
        for rate, times in plans:
            if progress is not None:
                what = "all at once" if rate is None else f"{rate:g} req/s"
                progress.set_description(f"{label or info.mode} @ {what}")
            on_done = (lambda _r: progress.update(1)) if progress is not None else None
            runs.append(await run_load(client, specs, times, info.vocab_size, options, rate=rate, on_done=on_done))
    return info, runs
