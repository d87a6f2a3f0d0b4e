"""The client side of a load test: send requests at their arrival times, time every token.

One asyncio loop and one gRPC channel (``pdserve.client.AsyncClient``) carry every request as
its own stream. The driver never waits for a request before sending the next: a request that is
due is sent on time whatever is still running. Timestamps are taken with ``time.perf_counter``
when each streamed response arrives.

Per request: TTFT (send to first token), the inter-token latencies (ITL), TPOT (mean time per
output token after the first), end-to-end latency, and the server's own per-phase timings from
the stream's last response. When one response carries ``k > 1`` tokens (the server coalesced
several steps), its gap since the previous response is split evenly over its ``k`` tokens, so
every output token after the first has exactly one ITL.

The client checks that it is not the bottleneck: ``send_lag_s`` (how late each request went out
compared to its schedule), the event loop's own lag (a 10 ms ticker's oversleep) and the
process's CPU use are reported with every run (``ClientLag``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np

from pdserve.client import AsyncClient, RequestError
from pdserve.loadtest.workload import RequestSpec

# Above these the report warns that the client, not the server, may have set the pace.
SEND_LAG_WARN_S = 0.05
LOOP_LAG_WARN_S = 0.05
CLIENT_CPU_WARN = 0.8


@dataclass
class RunOptions:
    """How requests are sent: sampling (greedy by default), EOS handling, deadline, warm-up."""

    temperature: float = 0.0
    ignore_eos: bool = True  # outputs run to exactly the asked length
    timeout_s: float = 600.0
    warmup: int = 2  # short requests sent (concurrently) before the measured ones, not recorded


@dataclass
class RequestResult:
    """What one request measured. Times in seconds; ``*_s`` offsets are from the run's start."""

    index: int
    label: str
    scheduled_s: float
    sent_s: float
    output_tokens: int = 0  # tokens received
    prompt_tokens: int | None = None  # from the server's summary
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    finish_reason: str | None = None
    server: dict | None = None  # the server's per-phase timings
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason is not None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if not self.ok or self.output_tokens < 2 or self.ttft_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def end_s(self) -> float | None:
        return None if self.e2e_s is None else self.sent_s + self.e2e_s

    def to_json(self) -> dict:
        out = asdict(self)
        out["tpot_s"] = self.tpot_s
        return out


@dataclass
class ClientLag:
    """Evidence that the client kept up: late sends, event-loop lag, client CPU use."""

    send_lag_p50_s: float
    send_lag_p99_s: float
    send_lag_max_s: float
    loop_lag_p99_s: float
    loop_lag_max_s: float
    cpu_share: float  # the client process's CPU seconds per wall second (1.0 = one core busy)

    @property
    def warnings(self) -> list[str]:
        out = []
        if self.send_lag_p99_s > SEND_LAG_WARN_S:
            out.append(f"requests went out late (p99 {self.send_lag_p99_s * 1e3:.0f} ms after their schedule)")
        if self.loop_lag_max_s > LOOP_LAG_WARN_S:
            out.append(f"the client's event loop stalled (max {self.loop_lag_max_s * 1e3:.0f} ms)")
        if self.cpu_share > CLIENT_CPU_WARN:
            out.append(f"the client used {self.cpu_share:.0%} of a core")
        return out


@dataclass
class RunResult:
    """One load run: every request, the run's wall time, and the client's own lag."""

    rate: float | None  # offered requests/s (None: all at once)
    results: list[RequestResult]
    duration_s: float  # first send to last response
    client: ClientLag

    def to_json(self) -> dict:
        return {"rate": self.rate, "duration_s": self.duration_s, "client": asdict(self.client),
                "client_warnings": self.client.warnings, "requests": [r.to_json() for r in self.results]}


class _LoopLagMonitor:
    """A ticker that sleeps ``interval`` and records how much longer it actually slept."""

    def __init__(self, interval: float = 0.01) -> None:
        self.interval = interval
        self.lags: list[float] = []

    async def run(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(self.interval)
            self.lags.append(max(0.0, time.perf_counter() - t - self.interval))


async def run_load(
    client: AsyncClient,
    specs: Sequence[RequestSpec],
    times: Sequence[float],
    vocab_size: int,
    options: RunOptions | None = None,
    rate: float | None = None,
    on_done: Callable[[RequestResult], None] | None = None,
) -> RunResult:
    """Send ``specs[i]`` at ``times[i]`` seconds after the start; wait for every answer."""
    options = options or RunOptions()
    if len(specs) != len(times):
        raise ValueError("one arrival time per request")
    # Build every input before the clock starts, so sending is cheap.
    inputs = [s.inputs(vocab_size) for s in specs]
    if options.warmup:
        await warm_up(client, options)
    monitor = _LoopLagMonitor()
    monitor_task = asyncio.create_task(monitor.run())
    cpu0 = time.process_time()
    start = time.perf_counter()
    tasks = []
    try:
        for spec, t, kwargs in sorted(zip(specs, times, inputs), key=lambda x: x[1]):
            delay = start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(_one(client, spec, float(t), start, kwargs, options))
            if on_done is not None:
                task.add_done_callback(lambda f: f.cancelled() or f.exception() or on_done(f.result()))
            tasks.append(task)
        results = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        monitor_task.cancel()
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu0
    ends = [r.end_s for r in results if r.end_s is not None]
    duration = max(ends) if ends else wall
    results = sorted(results, key=lambda r: r.index)
    send_lag = np.array([r.sent_s - r.scheduled_s for r in results])
    loop_lag = np.array(monitor.lags or [0.0])
    lag = ClientLag(
        send_lag_p50_s=float(np.percentile(send_lag, 50)), send_lag_p99_s=float(np.percentile(send_lag, 99)),
        send_lag_max_s=float(send_lag.max()), loop_lag_p99_s=float(np.percentile(loop_lag, 99)),
        loop_lag_max_s=float(loop_lag.max()), cpu_share=cpu / wall if wall > 0 else 0.0,
    )
    return RunResult(rate=rate, results=results, duration_s=duration, client=lag)


async def _one(client: AsyncClient, spec: RequestSpec, scheduled: float, start: float, kwargs: dict,
               options: RunOptions) -> RequestResult:
    sent = time.perf_counter()
    r = RequestResult(index=spec.index, label=spec.label, scheduled_s=scheduled, sent_s=sent - start)
    last = None
    try:
        stream = client.generate(**kwargs, max_tokens=spec.output_tokens, temperature=options.temperature,
                                 ignore_eos=options.ignore_eos, timeout=options.timeout_s)
        async for chunk in stream:
            now = time.perf_counter()
            k = len(chunk.token_ids)
            if k:
                if last is None:
                    r.ttft_s = now - sent
                    r.itl_s.extend([0.0] * (k - 1))  # tokens that came with the first one
                else:
                    r.itl_s.extend([(now - last) / k] * k)
                last = now
                r.output_tokens += k
            if chunk.finish_reason is not None:
                r.e2e_s = now - sent
                r.finish_reason = chunk.finish_reason
                r.prompt_tokens = chunk.prompt_tokens
                t = chunk.timings
                r.server = {"queued_s": t.queued_s, "prefill_s": t.prefill_s, "transfer_s": t.transfer_s,
                            "ttft_s": t.ttft_s, "decode_s": t.decode_s, "e2e_s": t.e2e_s}
        if r.finish_reason is None:
            r.error = "the stream ended without a summary"
    except RequestError as exc:
        r.error = f"{exc.code.name}: {exc.message}"
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # a client-side failure of this request only
        r.error = f"{type(exc).__name__}: {exc}"
    return r


async def warm_up(client: AsyncClient, options: RunOptions) -> None:
    """A few short requests at once, so the first measured ones do not pay for cold caches."""
    async def one(i: int) -> None:
        async for _ in client.generate(token_ids=[1 + i] * 16, max_tokens=4, temperature=0.0,
                                       ignore_eos=True, timeout=options.timeout_s):
            pass

    await asyncio.gather(*(one(i) for i in range(options.warmup)))
