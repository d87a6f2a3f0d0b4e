"""The outside judge: AIPerf and ``pdserve loadtest run`` drive the same running server with the
same workload at the same request rates, and their TTFT and ITL are printed side by side.

    python bench/judge.py --http 127.0.0.1:8091 --grpc 127.0.0.1:50071

Per rate, one after the other (never together): AIPerf over the OpenAI-compatible HTTP API
(``/v1/completions``, streamed), then ``pdserve loadtest run`` over gRPC. Both send
``--num-requests`` requests of ``--prompt-tokens`` prompt tokens and exactly ``--output-tokens``
output tokens (EOS ignored), greedy, at each of ``--rates`` requests/s with constant gaps (``--arrival
poisson`` for exponential ones), after 2 unmeasured warm-up requests.

The two tools name their figures differently; the table pairs them by definition
(docs/loadtest.md, "Driving pdserve with outside tools"):

- TTFT: both from sending the request to the first response that carries output;
- ITL (per token, pooled over every gap of every request): pdserve's ``itl``; AIPerf's
  ``inter_chunk_latency`` (the gaps between streamed chunks: the same thing while every chunk
  carries one token);
- TPOT (per request, the mean gap after the first token): pdserve's ``tpot``; AIPerf's
  ``inter_token_latency`` (AIPerf calls this "ITL").

Below them, for each tool's own requests, the server's TTFT (``pdserve_timings`` in the last SSE
chunk; the gRPC stream's summary) and what the client and its path added to it (client TTFT minus
server TTFT). When the tools disagree, these say whether the server was slower during one run
(the machine: on a small shared machine, other work) or one tool measured more (the client).
A third column applies pdserve loadtest's definitions and numpy's percentiles to AIPerf's own raw
timestamps (its ``profile_export_raw.jsonl``): equal to AIPerf's column when the two tools define
TTFT, ITL and TPOT alike, whatever the machine did during either run.

AIPerf is not a dependency of pdserve: install it anywhere (``python -m venv /work/aiperf-venv &&
/work/aiperf-venv/bin/pip install aiperf==0.13.0``) and pass ``--aiperf PATH`` if its ``aiperf``
is not on ``PATH``. It needs a tokenizer to build its prompts; by default this script gives it the
local directory of the default model (``resolve_model_dir``), so nothing is fetched from a hub.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

WARMUP = 2  # unmeasured requests before each run, both tools
# pdserve loadtest has no "constant" arrival: gamma gaps with this shape have a coefficient of
# variation of 1/sqrt(1e6) = 0.1%: constant gaps, to a millisecond at 1 request/s.
CONSTANT_BURSTINESS = 1e6
# (label, AIPerf metric, pdserve loadtest stat) compared row by row
PAIRS = (
    ("TTFT", "time_to_first_token", "ttft"),
    ("ITL (per token)", "inter_chunk_latency", "itl"),
    ("TPOT (= AIPerf ITL)", "inter_token_latency", "tpot"),
)


# The server's own TTFT of each tool's requests (pdserve_timings / the gRPC summary): when the two
# tools differ, these say whether the server was slower during one run (the machine) or the
# client and its path added more (the tool).
SERVER_ROWS = ("server TTFT p50", "server TTFT p99", "client - server TTFT p50", "client - server TTFT p99")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Drive a running pdserve server with AIPerf (HTTP) and pdserve loadtest run (gRPC) at the same "
                     "rates and workload, and print both tools' TTFT and ITL p50/p99 side by side.")
    p.add_argument("--http", required=True, metavar="HOST:PORT", help="the server's OpenAI-compatible HTTP address")
    p.add_argument("--grpc", required=True, metavar="HOST:PORT", help="the same server's gRPC address")
    p.add_argument("--rates", default="0.5,1", metavar="R[,R...]", help="request rates, req/s (default 0.5,1)")
    p.add_argument("--num-requests", "-n", type=int, default=30, metavar="N", help="requests per run (default 30)")
    p.add_argument("--prompt-tokens", type=int, default=200, metavar="N", help="prompt length (default 200)")
    p.add_argument("--output-tokens", type=int, default=64, metavar="N", help="output length (default 64)")
    p.add_argument("--arrival", choices=["constant", "poisson"], default="constant",
                   help="gaps between requests (default constant)")
    p.add_argument("--seed", type=int, default=0, help="both tools' seed (default 0)")
    p.add_argument("--model", default=None,
                   help="the model id to send (default: the first id of GET /v1/models)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="tokenizer directory for AIPerf (default: the default model's local directory)")
    p.add_argument("--api-key", default=None, help="the server's API key, if it has one")
    p.add_argument("--aiperf", default=None, metavar="PATH",
                   help="the aiperf executable (default: aiperf on PATH, else /work/aiperf-venv/bin/aiperf)")
    p.add_argument("--tools", default="aiperf,pdserve", metavar="LIST",
                   help="which tools to run, in order, at each rate (default aiperf,pdserve)")
    p.add_argument("--out", default="judge-report", metavar="DIR",
                   help="folder for each tool's own output and judge.json (default judge-report)")


def _aiperf_exe(given: str | None) -> str:
    for cand in (given, shutil.which("aiperf"), "/work/aiperf-venv/bin/aiperf"):
        if cand and Path(cand).exists():
            return cand
    raise SystemExit("aiperf not found: install it (pip install aiperf==0.13.0, in a virtualenv of its own) "
                     "and pass --aiperf PATH")


def _served_model(http: str, api_key: str | None) -> str:
    req = urllib.request.Request(f"http://{http}/v1/models")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)["data"][0]["id"]


def _run(cmd: list[str], log: Path) -> tuple[float, float]:
    """Run ``cmd`` to completion with its output in ``log``; return (wall s, CPU s of it and its children)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if rc != 0:
        tail = log.read_text().splitlines()[-15:]
        raise SystemExit(f"{cmd[0]} failed (exit {rc}); its log: {log}\n" + "\n".join(tail))
    return wall, cpu


def aiperf_command(args, exe: str, model: str, tokenizer: str, rate: float, out: Path) -> list[str]:
    cmd = [exe, "profile", "--model", model, "--tokenizer", tokenizer, "--url", f"http://{args.http}",
           "--endpoint-type", "completions", "--streaming",
           "--request-rate", f"{rate:g}", "--arrival-pattern", args.arrival, "--request-count", str(args.num_requests),
           "--warmup-request-count", str(WARMUP),
           "--isl", str(args.prompt_tokens), "--isl-stddev", "0", "--osl", str(args.output_tokens), "--osl-stddev", "0",
           "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
           "--use-server-token-count", "--random-seed", str(args.seed),
           "--ui", "none", "--no-server-metrics", "--no-gpu-telemetry",
           "--workers-max", "1", "--record-processors", "1", "--export-level", "raw", "--artifact-dir", str(out)]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    return cmd


def pdserve_command(args, rate: float, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "pdserve.cli", "loadtest", "run", "--target", args.grpc,
           "--workload", "fixed", "--prompt-tokens", str(args.prompt_tokens), "--output-tokens", str(args.output_tokens),
           "-n", str(args.num_requests), "--rates", f"{rate:g}", "--seed", str(args.seed), "--warmup", str(WARMUP),
           "--no-progress", "--out", str(out)]
    if args.arrival == "constant":
        cmd += ["--arrival", "gamma", "--burstiness", f"{CONSTANT_BURSTINESS:g}"]
    else:
        cmd += ["--arrival", "poisson"]
    if args.api_key:
        if "--api-key" not in subprocess.run([sys.executable, "-m", "pdserve.cli", "loadtest", "run", "--help"],
                                             capture_output=True, text=True).stdout:
            raise SystemExit("this pdserve loadtest run takes no --api-key: judge a server without one")
        cmd += ["--api-key", args.api_key]
    return cmd


def read_aiperf(out: Path) -> dict:
    d = json.loads((out / "profile_export_aiperf.json").read_text())
    row = {}
    for label, metric, _ in PAIRS:
        m = d.get(metric) or {}
        row[label] = {q: m.get(q) for q in ("p50", "p99")}  # already in ms
    row["requests ok"] = (d.get("request_count") or {}).get("avg")
    row["output tokens (mean)"] = (d.get("output_sequence_length") or {}).get("avg")
    row["prompt tokens (mean)"] = (d.get("usage_prompt_tokens") or d.get("input_sequence_length") or {}).get("avg")
    raw = out / "profile_export_raw.jsonl"
    if raw.exists():
        reqs = _aiperf_requests(raw)
        row.update(_server_side([((r["chunks"][0] - r["start"]) / 1e9, r["timings"]["ttft_s"])
                                 for r in reqs if r["timings"]]))
        row["_pdserve_arithmetic"] = pdserve_arithmetic(reqs)
    return row


def _aiperf_requests(raw: Path) -> list[dict]:
    """Each measured AIPerf request from its raw record: the perf-counter times (ns) of its request
    start and of every SSE chunk that carries a token, its ``usage.completion_tokens`` and the
    server's ``pdserve_timings`` (from the stream's last chunk)."""
    out = []
    for line in raw.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("metadata", {}).get("benchmark_phase") != "profiling" or rec.get("status") != 200:
            continue
        req = {"start": rec["start_perf_ns"], "chunks": [], "tokens": None, "timings": None}
        for resp in rec.get("responses", []):
            for packet in resp.get("packets", []):
                if packet.get("name") != "data" or packet.get("value", "").strip() == "[DONE]":
                    continue
                try:
                    chunk = json.loads(packet["value"])
                except ValueError:
                    continue
                if chunk.get("choices"):
                    req["chunks"].append(resp["perf_ns"])
                if chunk.get("usage"):
                    req["tokens"] = chunk["usage"].get("completion_tokens")
                req["timings"] = chunk.get("pdserve_timings") or req["timings"]
        if req["chunks"]:
            out.append(req)
    return out


def pdserve_arithmetic(reqs: list[dict]) -> dict:
    """pdserve loadtest's definitions (loadtest/driver.py, stats.py) applied to AIPerf's own
    timestamps: TTFT to the first chunk, every gap between chunks split over the chunk's tokens
    (one per chunk unless the counts say otherwise), TPOT = (last - first) / (tokens - 1); numpy's
    percentiles. Equal to AIPerf's own figures when the two tools define them alike."""
    import numpy as np

    ttft, itl, tpot = [], [], []
    for r in reqs:
        t = np.array(r["chunks"], dtype=float) / 1e9
        n = r["tokens"] or len(t)
        ttft.append(t[0] - r["start"] / 1e9)
        itl.extend(np.diff(t))
        if n > 1:
            tpot.append((t[-1] - t[0]) / (n - 1))
    row = {}
    for (label, _, _), vals in zip(PAIRS, (ttft, itl, tpot)):
        p50, p99 = np.percentile(vals, [50, 99]) * 1e3 if vals else (None, None)
        row[label] = {"p50": p50, "p99": p99}
    row["requests ok"] = len(reqs)
    row["chunks per token (mean)"] = float(np.mean([len(r["chunks"]) / (r["tokens"] or len(r["chunks"]))
                                                    for r in reqs]))
    return row


def _server_side(pairs: list[tuple[float, float]]) -> dict:
    """The server's own TTFT of the same requests, and what the path and the client added to it."""
    import numpy as np

    if not pairs:
        return {}
    client = np.array([c for c, _ in pairs])
    server = np.array([s for _, s in pairs])
    return {"server TTFT p50": float(np.percentile(server, 50)) * 1e3,
            "server TTFT p99": float(np.percentile(server, 99)) * 1e3,
            "client - server TTFT p50": float(np.percentile(client - server, 50)) * 1e3,
            "client - server TTFT p99": float(np.percentile(client - server, 99)) * 1e3}


def read_pdserve(out: Path) -> dict:
    d = json.loads((out / "results.json").read_text())
    (mode,) = d["modes"].values()
    (run,) = mode["runs"]
    st = run["stats"]
    row = {}
    for label, _, stat in PAIRS:
        row[label] = {q: (None if st[stat][q] is None else st[stat][q] * 1e3) for q in ("p50", "p99")}
    ok = [r for r in run["requests"] if r.get("error") is None and r.get("finish_reason")]
    row["requests ok"] = st["num_ok"]
    row["output tokens (mean)"] = sum(r["output_tokens"] for r in ok) / len(ok) if ok else None
    row["prompt tokens (mean)"] = sum(r["prompt_tokens"] or 0 for r in ok) / len(ok) if ok else None
    row.update(_server_side([(r["ttft_s"], r["server"]["ttft_s"]) for r in ok if r.get("server")]))
    return row


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def print_table(rate: float, rows: dict[str, dict]) -> None:
    if "_pdserve_arithmetic" in rows.get("AIPerf", {}):
        rows = {**rows, "pdserve's arithmetic on AIPerf's requests": rows["AIPerf"]["_pdserve_arithmetic"]}
    tools = list(rows)
    print(f"\n## rate {rate:g} req/s\n")
    ratio = "AIPerf" in rows and "pdserve" in rows
    head = ["metric (ms)"] + tools + (["pdserve / AIPerf"] if ratio else [])
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for label, _, _ in PAIRS:
        for q in ("p50", "p99"):
            vals = [rows[t][label][q] for t in tools]
            line = [f"{label} {q}"] + [_fmt(v) for v in vals]
            if ratio:
                a, b = rows["AIPerf"][label][q], rows["pdserve"][label][q]
                line.append("-" if not a or b is None else f"{b / a:.2f}")
            print("| " + " | ".join(line) + " |")
    for extra in SERVER_ROWS:
        vals = [rows[t].get(extra) for t in tools]
        line = [f"{extra} (from the server's timings)"] + [_fmt(v) for v in vals]
        if ratio:
            line.append("")
        print("| " + " | ".join(line) + " |")
    for extra in ("requests ok", "prompt tokens (mean)", "output tokens (mean)", "chunks per token (mean)",
                  "client CPU (cores)"):
        vals = [rows[t].get(extra) for t in tools]
        line = [extra] + [("-" if v is None else f"{v:.2f}" if extra == "client CPU (cores)" else f"{v:g}")
                          for v in vals]
        if ratio:
            line.append("")
        print("| " + " | ".join(line) + " |")


def run(args: argparse.Namespace) -> int:
    from pdserve.bench.common import machine, now

    rates = [float(x) for x in args.rates.split(",") if x.strip()]
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    if not rates or any(r <= 0 for r in rates) or not set(tools) <= {"aiperf", "pdserve"} or not tools:
        print("judge: --rates must be numbers > 0 and --tools a list of aiperf, pdserve", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    exe = _aiperf_exe(args.aiperf) if "aiperf" in tools else None
    model = args.model or _served_model(args.http, args.api_key)
    tokenizer = args.tokenizer
    if tokenizer is None and "aiperf" in tools:
        from pdserve.engine.model_loader import resolve_model_dir
        tokenizer = str(resolve_model_dir("default"))
    print(f"# pdserve judge: AIPerf vs pdserve loadtest\n\n- date: {now()}\n- machine: {machine()}\n"
          f"- server: HTTP {args.http}, gRPC {args.grpc}, model {model!r}\n"
          f"- workload: {args.num_requests} requests, {args.prompt_tokens} prompt tokens, exactly "
          f"{args.output_tokens} output tokens (EOS ignored), greedy, {args.arrival} arrivals, "
          f"{WARMUP} warm-up requests")
    results = {"date": now(), "machine": machine(), "args": {k: v for k, v in vars(args).items() if not callable(v)}, "runs": []}
    for rate in rates:
        rows: dict[str, dict] = {}
        commands = {}
        for tool in tools:
            if tool == "aiperf":
                d = out / f"aiperf-{rate:g}"
                cmd = aiperf_command(args, exe, model, tokenizer, rate, d)
                wall, cpu = _run(cmd, out / f"aiperf-{rate:g}.log")
                rows["AIPerf"] = read_aiperf(d)
                rows["AIPerf"]["client CPU (cores)"] = cpu / wall
                commands["AIPerf"] = cmd
            else:
                d = out / f"pdserve-{rate:g}"
                cmd = pdserve_command(args, rate, d)
                wall, cpu = _run(cmd, out / f"pdserve-{rate:g}.log")
                rows["pdserve"] = read_pdserve(d)
                rows["pdserve"]["client CPU (cores)"] = cpu / wall
                commands["pdserve"] = cmd
        print_table(rate, rows)
        results["runs"].append({"rate": rate, "rows": rows, "commands": commands})
    (out / "judge.json").write_text(json.dumps(results, indent=1))
    print("\nclient CPU: the tool's CPU seconds (all its processes) per wall second of its whole command, start-up "
          f"included. Each tool's own output: {out}/")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench/judge.py")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
