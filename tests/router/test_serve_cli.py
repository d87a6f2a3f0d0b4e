"""`pdserve serve` as a user runs it: a process that prints its address, answers, and stops
cleanly on Ctrl-C (its actors gone, its port free); colocated and disaggregated.

It joins the test session's Ray with ``--address`` (starting a second Ray would double the
cost); the default of an embedded Ray goes through the same code after ``ray.init``.
"""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
import ray

from pdserve.client import Client


def read_line_matching(proc: subprocess.Popen, pattern: str, timeout: float) -> re.Match:
    end = time.monotonic() + timeout
    seen = []
    while time.monotonic() < end:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            m = re.search(pattern, line)
            if m:
                return m
        elif proc.poll() is not None:
            break
    raise AssertionError(f"no line matching {pattern!r}; stdout so far: {''.join(seen)!r}")


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_serve_generate_and_ctrl_c(ray_session, tmp_path):
    address = ray.get_runtime_context().gcs_address
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "serve", "--port", "0", "--address", address,
         "--kv-memory", "64MiB", "--threads", "1"],
        stdout=subprocess.PIPE, stderr=open(tmp_path / "serve.err", "w"), text=True, env=env,
    )
    try:
        m = read_line_matching(proc, r"listening on (127\.0\.0\.1):(\d+).*metrics on http://127\.0\.0\.1:(\d+)/metrics",
                               timeout=120)
        port = int(m.group(2))
        metrics_port = int(m.group(3))  # with --port 0, a free port too (docs/observability.md)
        with Client(f"127.0.0.1:{port}", timeout=60) as client:
            info = client.server_info()
            assert (info.mode, info.num_decode_workers) == ("colocated", 1)
            out = client.complete(messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0)
            assert out.completion_tokens >= 1
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
            samples = [s for f in text_string_to_metric_families(r.read().decode()) for s in f.samples
                       if s.name == "pdserve_requests_total" and s.value]
        assert [(s.labels, s.value) for s in samples] == [
            ({"mode": "colocated", "status": "OK", "finish_reason": out.finish_reason}, 1.0)]
        assert ray.get_actor("pdserve-decode-0", namespace="pdserve")  # the worker runs in the cluster we lent it

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, (tmp_path / "serve.err").read_text()
        assert port_is_free(port)
        # The metrics server closed its HTTP connection first, so that port may linger in TIME_WAIT;
        # a new server binds it with SO_REUSEADDR (as prometheus_client's does).
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", metrics_port))
        with pytest.raises(ValueError):
            ray.get_actor("pdserve-decode-0", namespace="pdserve")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_disaggregated(ray_session, tmp_path, hf_chat_greedy):
    address = ray.get_runtime_context().gcs_address
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "serve", "--mode", "disaggregated", "--prefill", "1",
         "--decode", "1", "--prefill-cpus", "0.5", "--decode-cpus", "0.5", "--transport", "grpc",
         "--port", "0", "--address", address, "--kv-memory", "64MiB", "--threads", "1"],
        stdout=subprocess.PIPE, stderr=open(tmp_path / "serve.err", "w"), text=True, env=env,
    )
    try:
        m = read_line_matching(proc, r"listening on (127\.0\.0\.1):(\d+) \(disaggregated, 1 prefill \+ 1 decode",
                               timeout=120)
        port = int(m.group(2))
        with Client(f"127.0.0.1:{port}", timeout=60) as client:
            info = client.server_info()
            assert (info.mode, info.num_prefill_workers, info.num_decode_workers, info.transport) == (
                "disaggregated", 1, 1, "grpc")
            out = client.complete(messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0)
            assert out.token_ids == hf_chat_greedy("Hi", 6)
        for name in ("pdserve-prefill-0", "pdserve-decode-0"):
            assert ray.get_actor(name, namespace="pdserve")

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, (tmp_path / "serve.err").read_text()
        assert port_is_free(port)
        for name in ("pdserve-prefill-0", "pdserve-decode-0"):
            with pytest.raises(ValueError):
                ray.get_actor(name, namespace="pdserve")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
