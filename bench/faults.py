"""``pdserve bench faults``: what a worker's death costs a server under load.

It starts a server (``pdserve serve`` as a subprocess on a local Ray, as ``pdserve loadtest
compare`` does), drives it at a constant request rate, and runs the same seeded load twice: once
without a fault, once with ``--kill ROLE@SECONDS`` (the first live actor of that role is killed
with ``ray.kill``, as a crash would end it). It prints, side by side:

- requests lost (ended with an error), with and without the fault;
- goodput in the window after the kill (requests finished, output tokens/s), against the same
  window of the run without the fault;
- the time from the kill until output throughput is back within 5% of its level before the kill
  (throughput over a sliding window of ``--window`` seconds), and the server's own time to
  replace the dead worker (``pdserve_worker_replacement_seconds``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import urllib.request
from pathlib import Path

import numpy as np

from pdserve.bench.common import machine

ROLES = ("decode", "prefill")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[0].split(": ", 1)[1]
    p.add_argument("--mode", choices=["colocated", "disaggregated"], default="colocated")
    p.add_argument("--decode", type=int, default=2, help="decode (colocated: all) actors (default 2)")
    p.add_argument("--prefill", type=int, default=1, help="prefill actors, disaggregated (default 1)")
    p.add_argument("--transport", choices=["grpc", "collective"], default="grpc")
    p.add_argument("--model", default="default")
    p.add_argument("--threads", type=int, default=1, help="torch threads per actor (default 1)")
    p.add_argument("--kill", default="decode@20", metavar="ROLE@SECONDS",
                   help="kill the first live actor of ROLE (decode or prefill) SECONDS into the run (default decode@20)")
    p.add_argument("--rate", type=float, default=1.0, help="requests/s, constant (default 1)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals (default 60)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--window", type=float, default=5.0, help="throughput window, seconds (default 5)")
    p.add_argument("--out", default="faults-report", help="folder for server logs and the JSON results")


def _parse_kill(text: str) -> tuple[str, float]:
    role, _, at = text.partition("@")
    if role not in ROLES or not at:
        raise SystemExit(f"--kill takes ROLE@SECONDS with ROLE one of {', '.join(ROLES)}; got {text!r}")
    return role, float(at)


def token_times(results) -> np.ndarray:
    """When each output token reached the client, seconds from the run's start."""
    times = []
    for r in results:
        if r.ttft_s is None:
            continue
        t = r.sent_s + r.ttft_s
        times.append(t)
        times.extend(t + np.cumsum(r.itl_s))
    return np.sort(np.array(times))


def throughput(times: np.ndarray, start: float, end: float) -> float:
    return float(((times >= start) & (times < end)).sum() / (end - start)) if end > start else 0.0


def recovery_s(times: np.ndarray, kill_s: float, baseline: float, window: float, end: float) -> float | None:
    """Seconds from the kill until a ``window``-second window of output throughput is back
    within 5% of ``baseline`` (None: never, before ``end``)."""
    t = kill_s
    while t + window <= end:
        if abs(throughput(times, t, t + window) - baseline) <= 0.05 * baseline:
            return t + window - kill_s
        t += 0.25
    return None


def _metric(metrics_url: str, name: str) -> list[tuple[str, float]]:
    try:
        text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    except OSError:
        return []
    return [(m.group(1), float(m.group(2))) for m in re.finditer(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M)]


def run(args: argparse.Namespace) -> int:
    import ray

    from pdserve.client import AsyncClient
    from pdserve.loadtest.driver import RunOptions, run_load
    from pdserve.loadtest.launcher import RAY_NAMESPACE, RayCluster, ServerConfig, ServerProcess
    from pdserve.loadtest.workload import LengthRange, WorkloadConfig, build_workload

    role, kill_at = _parse_kill(args.kill)
    if args.mode == "colocated" and role == "prefill":
        raise SystemExit("a colocated server has no prefill actors: --kill decode@SECONDS")
    n = max(1, int(args.rate * args.duration))
    specs = build_workload(WorkloadConfig(kind="uniform", num_requests=n,
                                          prompt_tokens=LengthRange(args.prompt_tokens, args.prompt_tokens),
                                          output_tokens=LengthRange(args.output_tokens, args.output_tokens)))
    times = np.arange(n) / args.rate  # constant gaps: a steady load, so a dip is the fault's
    config = ServerConfig(mode=args.mode, decode=args.decode, prefill=args.prefill if args.mode == "disaggregated" else 0,
                          threads=args.threads, model=args.model, transport=args.transport, name="pdserve-faults")
    out = Path(args.out)
    print(f"# pdserve bench faults, {machine()}")
    print(f"# {config.describe()}; {n} requests at {args.rate:g} req/s, {args.prompt_tokens} prompt + "
          f"{args.output_tokens} output tokens; fault: kill a {role} actor at {kill_at:g} s")
    report = {}
    with RayCluster(None, num_cpus=config.resources()["CPU"] + 1) as cluster:
        for label in ("no fault", "fault"):
            with ServerProcess(config, cluster, out / f"server-{label.replace(' ', '-')}.log") as server:
                log = server.log_path.read_text(errors="replace")
                metrics_port = re.search(r"metrics on http://[^:]+:(\d+)/metrics", log)

                async def drive():
                    async with AsyncClient(server.address, timeout=600) as client:
                        info = await client.server_info(timeout=60)
                        load = asyncio.ensure_future(run_load(client, specs, times, info.vocab_size,
                                                              RunOptions(warmup=2), rate=args.rate))
                        killed = None
                        if label == "fault":
                            await asyncio.sleep(kill_at)
                            killed = await asyncio.to_thread(_kill_one, ray, RAY_NAMESPACE, config, role)
                        return await load, killed

                result, killed = asyncio.run(drive())
                tokens = token_times(result.results)
                end = float(times[-1])
                lost = [r for r in result.results if not r.ok]
                baseline = throughput(tokens, 5.0, kill_at)
                entry = {
                    "requests": n, "lost": len(lost), "errors": sorted({r.error for r in lost if r.error})[:5],
                    "baseline_tokens_per_s": baseline,
                    "after_kill_tokens_per_s": throughput(tokens, kill_at, kill_at + 3 * args.window),
                    "after_kill_requests_done": sum(1 for r in result.results
                                                    if r.ok and kill_at <= r.end_s < kill_at + 3 * args.window),
                    "recovery_s": recovery_s(tokens, kill_at, baseline, args.window, end) if label == "fault" else None,
                    "killed": killed,
                }
                if metrics_port and label == "fault":
                    url = f"http://127.0.0.1:{metrics_port.group(1)}/metrics"
                    for _ in range(60):  # the replacement may still be loading its model
                        s = dict(_metric(url, "pdserve_worker_replacement_seconds_sum"))
                        if s:
                            break
                        import time as _time

                        _time.sleep(1)
                    entry["replacement_s"] = sum(s.values()) if s else None
                    entry["migrations"] = sum(v for _, v in _metric(url, "pdserve_request_migrations_total"))
                report[label] = entry
    out.mkdir(parents=True, exist_ok=True)
    (out / "faults.json").write_text(json.dumps(report, indent=2))
    a, b = report["no fault"], report["fault"]
    w = 3 * args.window
    print(f"{'':34}{'no fault':>12}{'fault':>12}")
    print(f"{'requests lost':34}{a['lost']:>12}{b['lost']:>12}")
    print(f"{'output tok/s before the kill':34}{a['baseline_tokens_per_s']:>12.1f}{b['baseline_tokens_per_s']:>12.1f}")
    print(f"{f'output tok/s in the {w:g} s after':34}{a['after_kill_tokens_per_s']:>12.1f}{b['after_kill_tokens_per_s']:>12.1f}")
    print(f"{f'requests done in the {w:g} s after':34}{a['after_kill_requests_done']:>12}{b['after_kill_requests_done']:>12}")
    rec = b["recovery_s"]
    print(f"{'back within 5% after (s)':34}{'':>12}{('never' if rec is None else f'{rec:.1f}'):>12}")
    if b.get("replacement_s") is not None:
        print(f"{'worker replaced after (s)':34}{'':>12}{b['replacement_s']:>12.1f}")
    if b.get("migrations") is not None:
        print(f"{'requests migrated':34}{'':>12}{b['migrations']:>12.0f}")
    print(f"killed: {b['killed']}; results: {out / 'faults.json'}")
    if b["errors"]:
        print("errors:", *b["errors"], sep="\n  ", file=sys.stderr)
    return 0 if b["lost"] == 0 else 1


def _kill_one(ray, namespace: str, config, role: str) -> str:
    """Kill the first live actor of ``role`` of the server; return its name."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a.get("namespace") == namespace and a["name"].startswith(f"{config.server_name}-{role}-")]
    for name in sorted(names):
        try:
            ray.kill(ray.get_actor(name, namespace=namespace))
            return name
        except ValueError:
            continue
    raise RuntimeError(f"no live {role} actor of {config.server_name} to kill (found {names})")
