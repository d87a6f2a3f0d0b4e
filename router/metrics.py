"""Prometheus metrics of a running pdserve, all served by the router at one HTTP ``/metrics``.

Design: the router is the only scrape target, whatever the number of nodes. It already sees every
request from arrival to summary, so it observes the request histograms and counters itself (from
the same timings the client gets in its summary), and it already asks every worker actor for its
``stats()`` over Ray, so the per-actor gauges are that ``WorkerStats``, fetched afresh at scrape
time. Actors on other nodes need no port of their own and Prometheus needs no service discovery.

- ``RouterMetrics`` owns one ``CollectorRegistry`` per router (two routers in one process do not
  share series), the metric objects, and the HTTP server (``start_http``).
- ``RequestObserver`` follows one request: the service feeds it every response it sends and
  tells it how the request ended; it records the metrics and logs one line per request.

Labels are bounded: ``mode`` (colocated, disaggregated), ``transport``, ``status`` (gRPC status
code names), ``finish_reason`` (stop, length, abort, none), and per actor ``role`` (colocated,
decode, prefill), ``actor`` (the actor's name) and ``device``. Never a request id.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)
request_log = logging.getLogger("pdserve.requests")


# Bucket bounds in seconds (and bytes), from a fast token step on a GPU to a long CPU request.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                   1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
BYTES_BUCKETS = tuple(float(4 ** k * 1024) for k in range(12))  # 1 KiB .. 4 GiB

FINISH_REASONS = ("stop", "length", "abort")


class MetricsPortInUse(OSError):
    """The metrics address could not be bound."""


class RouterMetrics:
    """The router's metrics: request histograms and counters, per-actor gauges, the HTTP endpoint.

    ``pool`` is the router's ``WorkerPool`` (``worker_snapshot``, ``refresh_stats``,
    ``num_waiting``); ``mode`` and ``transport`` label the request metrics.
    """

    def __init__(self, pool, mode: str, transport: str = "none", model: str = "", version: str = "",
                 scrape_timeout_s: float = 2.0):
        self.pool = pool
        self.mode = mode
        self.transport = transport
        self.scrape_timeout_s = scrape_timeout_s
        self.registry = CollectorRegistry()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._http = None
        self._http_thread: threading.Thread | None = None
        r = self.registry

        def hist(name: str, doc: str, buckets, labels=("mode",)) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.ttft = hist("pdserve_time_to_first_token_seconds",
                         "Time from arrival at the router to the first token sent to the client.", LATENCY_BUCKETS)
        self.itl = hist("pdserve_inter_token_latency_seconds",
                        "Time between two tokens sent to the client (a response of k tokens counts k "
                        "tokens of gap/k each).", TOKEN_BUCKETS)
        self.tpot = hist("pdserve_time_per_output_token_seconds",
                         "Per request: (end-to-end latency - TTFT) / (output tokens - 1).", TOKEN_BUCKETS)
        self.e2e = hist("pdserve_e2e_request_latency_seconds",
                        "Time from arrival at the router to the last response.", E2E_BUCKETS)
        self.queue = hist("pdserve_request_queue_time_seconds",
                          "Time from arrival until a worker started prefilling the request.", LATENCY_BUCKETS)
        self.prefill = hist("pdserve_request_prefill_time_seconds",
                            "Time a worker spent prefilling the request (to its first token).", LATENCY_BUCKETS)
        self.decode = hist("pdserve_request_decode_time_seconds",
                           "Time from the first token to the last.", E2E_BUCKETS)
        self.transfer = hist("pdserve_kv_transfer_time_seconds",
                             "Time the request's KV cache took from prefill to decode actor.", LATENCY_BUCKETS,
                             labels=("transport",))
        self.transfer_bytes = hist("pdserve_kv_transfer_size_bytes",
                                   "KV cache bytes of one request moved from prefill to decode actor.",
                                   BYTES_BUCKETS, labels=("transport",))
        self.requests = Counter("pdserve_requests", "Requests ended, by gRPC status and finish reason.",
                                ("mode", "status", "finish_reason"), registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens of requests that passed validation.",
                                     ("mode",), registry=r)
        self.migrations = Counter("pdserve_request_migrations",
                                  "Requests moved to another worker after theirs died or their KV transfer failed.",
                                  ("mode",), registry=r)
        self.replacement_time = Histogram("pdserve_worker_replacement_seconds",
                                          "From a worker's death being noticed to its replacement serving.",
                                          ("mode", "role"), buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300),
                                          registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "Tokens sent to clients.",
                                         ("mode",), registry=r)
        router_waiting = Gauge("pdserve_router_requests_waiting",
                               "Requests waiting in the router for a worker with room.", ("mode",), registry=r)
        router_waiting.labels(mode).set_function(lambda: self.pool.num_waiting)
        Info("pdserve_server", "What this router serves.", registry=r).info(
            {"mode": mode, "transport": transport, "model": model, "version": version})
        ProcessCollector(registry=r)  # the router process's own CPU and memory
        r.register(_WorkerCollector(self))

        # Every series a dashboard plots exists (at zero) before the first request.
        for h in (self.ttft, self.itl, self.tpot, self.e2e, self.queue, self.prefill, self.decode):
            h.labels(mode)
        if mode == "disaggregated":
            self.transfer.labels(transport)
            self.transfer_bytes.labels(transport)
        for reason in FINISH_REASONS:
            self.requests.labels(mode, "OK", reason)
        self.prompt_tokens.labels(mode)
        self.generation_tokens.labels(mode)

    # ---- lifecycle -------------------------------------------------------------------------------

    def migrated(self) -> None:
        """The pool moved a request to another worker."""
        self.migrations.labels(self.mode).inc()

    def replaced(self, role: str, seconds: float) -> None:
        """The pool replaced a dead ``role`` worker, ``seconds`` after noticing its death."""
        self.replacement_time.labels(self.mode, role).observe(seconds)

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """The router's event loop: scrapes refresh the workers' stats on it."""
        self._loop = loop

    def start_http(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` (0: a free port) in a daemon thread; return the port."""
        try:
            self._http, self._http_thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise MetricsPortInUse(f"cannot serve metrics on {host}:{port} ({exc.strerror or exc}); "
                                   "choose another --metrics-port, 0 for a free one, or 'off'") from exc
        return int(self._http.server_port)

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    # ---- scrape time -----------------------------------------------------------------------------

    def _refresh_workers(self) -> None:
        """Fresh ``stats()`` from every worker, on the router's loop, within the scrape timeout (on
        a timeout or a stopped loop the last stats are reported)."""
        loop = self._loop
        if loop is None or loop.is_closed() or not loop.is_running():
            return
        try:
            if asyncio.get_running_loop() is loop:
                return  # called on the loop itself: waiting here would block it
        except RuntimeError:
            pass
        future = asyncio.run_coroutine_threadsafe(self.pool.refresh_stats(), loop)
        try:
            future.result(self.scrape_timeout_s)
        except Exception as exc:
            future.cancel()
            logger.warning("metrics: worker stats not refreshed (%r); reporting the last ones", exc)


class _WorkerCollector(Collector):
    """Per-actor gauges from the workers' ``WorkerStats``, read when Prometheus scrapes."""

    def __init__(self, metrics: RouterMetrics):
        self.metrics = metrics

    def describe(self) -> Iterable:
        return []  # the families depend on the workers present: collected only at scrape time

    def collect(self) -> Iterable[GaugeMetricFamily]:
        self.metrics._refresh_workers()
        labels = ["role", "actor"]
        up = GaugeMetricFamily("pdserve_worker_up", "1 while the actor serves, 0 once it died.", labels=labels)
        running = GaugeMetricFamily("pdserve_num_requests_running", "Requests in the actor's running batch.",
                                    labels=labels)
        waiting = GaugeMetricFamily("pdserve_num_requests_waiting", "Requests queued in the actor.", labels=labels)
        used = GaugeMetricFamily("pdserve_kv_blocks_used", "KV cache blocks in use in the actor.", labels=labels)
        free = GaugeMetricFamily("pdserve_kv_blocks_free", "Free KV cache blocks in the actor.", labels=labels)
        queued = GaugeMetricFamily("pdserve_prefill_queue_tokens",
                                   "Prompt tokens queued in the actor and not yet prefilled.", labels=labels)
        peak = GaugeMetricFamily("pdserve_peak_memory_bytes",
                                 "Peak memory of the actor: CUDA max_memory_allocated, or the process's peak "
                                 "RSS on CPU.", labels=labels + ["device"])
        for role, name, alive, s in self.metrics.pool.worker_snapshot():
            up.add_metric([role, name], 1.0 if alive else 0.0)
            if not alive:
                continue
            running.add_metric([role, name], s.num_running)
            waiting.add_metric([role, name], s.num_waiting)
            used.add_metric([role, name], s.total_blocks - s.free_blocks)
            free.add_metric([role, name], s.free_blocks)
            queued.add_metric([role, name], s.queued_prompt_tokens)
            peak.add_metric([role, name, s.device], s.peak_memory_bytes)
        return [up, running, waiting, used, free, queued, peak]


class RequestObserver:
    """One request as the client sees it: every response sent, then how the request ended.

    Latency histograms are observed for requests that completed (status OK), from the summary
    timings the client also receives; the request and token counters count every request.
    """

    def __init__(self, metrics: RouterMetrics | None, clock: Callable[[], float] = time.monotonic):
        self.metrics = metrics
        self._clock = clock
        self.t_arrival = clock()
        self.request_id: str | None = None
        self.prompt_tokens: int | None = None  # set once the request passed validation
        self.worker_timings: dict[str, float] = {}  # what the workers measured (the service sets it)
        self.kv_transfer_bytes = 0
        self.tokens = 0
        self._t_first: float | None = None
        self._t_last: float | None = None
        self._gaps: list[float] = []
        self.done = False

    def started(self, request_id: str, prompt_tokens: int) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens

    def response(self, r) -> None:
        """A ``GenerateResponse`` about to be sent; the one with a finish reason ends the request."""
        now = self._clock()
        n = len(r.token_ids)
        if n:
            if self._t_last is None:
                self._t_first = now
                self._gaps.extend([0.0] * (n - 1))  # tokens that came with the first one
            else:
                self._gaps.extend([(now - self._t_last) / n] * n)
            self._t_last = now
            self.tokens += n
        if r.finish_reason:
            self._end("OK", _finish_name(r.finish_reason), r.timings, now)

    def failed(self, status: str, message: str = "") -> None:
        """The request ended without its summary (``status``: a gRPC status code name)."""
        self._end(status, "none", None, self._clock(), message)

    def _end(self, status: str, finish_reason: str, timings, now: float, message: str = "") -> None:
        if self.done:
            return
        self.done = True
        m = self.metrics
        if m is not None:
            mode = m.mode
            m.requests.labels(mode, status, finish_reason).inc()
            if self.prompt_tokens is not None:
                m.prompt_tokens.labels(mode).inc(self.prompt_tokens)
            m.generation_tokens.labels(mode).inc(self.tokens)
            if timings is not None:
                m.ttft.labels(mode).observe(timings.ttft_s)
                m.e2e.labels(mode).observe(timings.e2e_s)
                m.queue.labels(mode).observe(timings.queued_s)
                m.prefill.labels(mode).observe(timings.prefill_s)
                m.decode.labels(mode).observe(timings.decode_s)
                itl = m.itl.labels(mode)
                for gap in self._gaps:
                    itl.observe(gap)
                if self.tokens > 1:
                    m.tpot.labels(mode).observe((timings.e2e_s - timings.ttft_s) / (self.tokens - 1))
                if "transfer" in self.worker_timings:  # measured by the decode actor
                    m.transfer.labels(m.transport).observe(self.worker_timings["transfer"])
                    m.transfer_bytes.labels(m.transport).observe(self.kv_transfer_bytes)
        if request_log.isEnabledFor(logging.INFO):
            request_log.info(self._log_line(status, finish_reason, timings, now, message))

    def _log_line(self, status: str, finish_reason: str, timings, now: float, message: str) -> str:
        """``key=value`` pairs (logfmt): the request's id, outcome, token counts and phase timings."""
        fields: list[tuple[str, object]] = [
            ("request_id", self.request_id or "-"),
            ("mode", self.metrics.mode if self.metrics else "-"),
            ("status", status),
            ("finish_reason", finish_reason),
            ("prompt_tokens", self.prompt_tokens if self.prompt_tokens is not None else 0),
            ("completion_tokens", self.tokens),
        ]
        if timings is not None:
            fields += [(k, f"{getattr(timings, k):.4f}") for k in
                       ("queued_s", "prefill_s", "transfer_s", "ttft_s", "decode_s", "e2e_s")]
        else:
            if self._t_first is not None:
                fields.append(("ttft_s", f"{self._t_first - self.t_arrival:.4f}"))
            fields.append(("e2e_s", f"{now - self.t_arrival:.4f}"))
        if self.kv_transfer_bytes:
            fields.append(("kv_transfer_bytes", self.kv_transfer_bytes))
        if message:
            fields.append(("error", json.dumps(message)))
        return "request " + " ".join(f"{k}={v}" for k, v in fields)


def _finish_name(value: int) -> str:
    """``pb.FinishReason`` value -> ``stop``/``length``/``abort``."""
    from pdserve.v1 import generation_pb2 as pb

    name = pb.FinishReason.Name(value)
    return name.removeprefix("FINISH_REASON_").lower()
