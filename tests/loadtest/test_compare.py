"""`pdserve loadtest compare` end to end, as a user runs it, on a tiny model: both servers
start at equal resources, the same seeded requests reach each, and the Markdown, JSON and PNG
outputs exist and agree; Ctrl-C stops the servers it started."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

from pdserve.loadtest.workload import LengthRange, WorkloadConfig, build_workload

WORKLOAD = dict(kind="mixed", num_requests=6, prompt_tokens=LengthRange(8, 24), output_tokens=LengthRange(3, 6),
                long_prompt_tokens=LengthRange(60, 100), long_share=0.34, seed=4)


def compare_cmd(model, out, *extra):
    w = WORKLOAD
    return [sys.executable, "-m", "pdserve.cli", "loadtest", "compare", "--model", str(model),
            "--cpus-per-actor", "0.5", "--kv-memory", "16MiB", "--workload", w["kind"],
            "-n", str(w["num_requests"]), "--prompt-tokens", str(w["prompt_tokens"]),
            "--output-tokens", str(w["output_tokens"]), "--long-prompt-tokens", str(w["long_prompt_tokens"]),
            "--long-share", str(w["long_share"]), "--seed", str(w["seed"]), "--warmup", "1",
            "--out", str(out), "--no-progress", *extra]


ENV = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")


def test_compare_writes_a_consistent_report(tiny_servable_model, tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run(compare_cmd(tiny_servable_model, out, "--rates", "4,8", "--slo-ttft-ms", "5000",
                                      "--slo-itl-ms", "2000"),
                          capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    assert list(data["modes"]) == ["colocated", "disaggregated"]
    assert data["slo"]["ttft_s"] == 5.0 and data["slo"]["itl_s"] == 2.0
    specs = build_workload(WorkloadConfig(**WORKLOAD))
    servers = {name: mode["server"] for name, mode in data["modes"].items()}
    # Equal resources: 2 colocated workers vs 1 prefill + 1 decode.
    assert (servers["colocated"]["mode"], servers["colocated"]["num_decode_workers"]) == ("colocated", 2)
    assert (servers["disaggregated"]["num_prefill_workers"], servers["disaggregated"]["num_decode_workers"]) == (1, 1)
    md = (out / "report.md").read_text()
    for name, mode in data["modes"].items():
        assert [run["rate"] for run in mode["runs"]] == [4.0, 8.0]
        for run in mode["runs"]:
            reqs = run["requests"]
            assert len(reqs) == len(specs)
            for r, s in zip(reqs, specs):  # the same requests, run to their length, on both sides
                assert r["error"] is None and r["finish_reason"] == "length", r
                assert (r["prompt_tokens"], r["output_tokens"]) == (s.prompt_tokens, s.output_tokens)
                assert len(r["itl_s"]) == s.output_tokens - 1 and r["ttft_s"] > 0
                assert r["server"]["e2e_s"] > 0
                if name == "colocated":
                    assert r["server"]["transfer_s"] == 0
            st = run["stats"]
            assert st["num_ok"] == len(specs)
            assert st["itl"]["count"] == sum(s.output_tokens - 1 for s in specs)
            good = sum(r["ttft_s"] <= 5.0 for r in reqs) / run["duration_s"]  # ITLs here are far below 2 s
            assert abs(st["goodput"] - good) < 1e-9
            # The Markdown shows the JSON's numbers.
            assert "| requests ok / sent | " in md and f"{st['goodput']:.3f}" in md
            assert f"{st['ttft']['p99'] * 1e3:.0f}" in md
    assert re.search(r"\| 4 \| [\d.]+ \| [\d.]+ \| \d+ \| \d+ \| [\d.]+x \| [\d.]+x \|", md)
    assert "1 prefill + 1 decode actors (0.5 CPU" in md and "2 colocated actors (0.5 CPU" in md
    for png in ("latency_cdf.png", "vs_rate.png"):
        head = (out / png).read_bytes()[:8]
        assert head == b"\x89PNG\r\n\x1a\n" and (out / png).stat().st_size > 10_000
    assert "highest rate at which colocated met the SLO" in proc.stdout  # the table is printed too
    for name in ("colocated", "disaggregated"):  # actor names of their own: no clash with a user's server
        assert f"--name pdserve-loadtest-{name}" in (out / f"server-{name}.log").read_text()


def ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_ctrl_c_stops_the_servers_it_started(tiny_servable_model, tmp_path):
    """Started with SIGINT ignored, as a shell starts the background jobs of a script (the way a
    test run on a fresh machine may start it): SIGINT must still stop it."""
    out = tmp_path / "report"
    proc = subprocess.Popen(compare_cmd(tiny_servable_model, out, "--rates", "0.5", "-n", "500"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                            preexec_fn=ignore_sigint)
    log = out / "server-colocated.log"
    try:
        end = time.monotonic() + 180
        address = None
        while time.monotonic() < end and proc.poll() is None:
            text = log.read_text() if log.exists() else ""
            m = re.search(r"listening on (\S+):(\d+)", text)
            address = m and (m.group(1), int(m.group(2)))
            if address and "pdserve.requests" in text:  # the sweep runs: requests are in flight
                break
            time.sleep(0.3)
        assert address and proc.poll() is None, \
            f"the colocated server did not start: {proc.stderr.read() if proc.poll() is not None else ''}"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 130
        assert "interrupted; the servers it started are stopped" in proc.stderr.read()
        assert "pdserve: stopped" in log.read_text()
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed connection's TIME_WAIT is no server
            s.bind(address)  # the server's port is free again
        assert not (out / "server-disaggregated.log").exists()  # the second side never started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
