"""pdserve on two hosts, on one machine: two network namespaces joined by a veth pair.

Host A (10.77.0.1) runs the Ray head, `pdserve serve` and the client; host B (10.77.0.2) runs a
Ray worker node. The hosts advertise the custom resources ``host_a`` and ``host_b``, and
``--prefill-resources``/``--decode-resources`` pin the prefill actor to A and the decode actor
to B, so every KV cache crosses the veth pair over the gRPC transport. Greedy answers must be
token-identical to a single-host reference (Hugging Face ``generate()``, float32, which the
single-host tests in tests/router hold pdserve to); the model is a tiny random Llama with the
default model's tokenizer, so that four actor starts fit the time. Then `Admin.Scale` takes the server from
1 prefill + 1 decode worker to 2 + 2 and back while three clients keep requests flowing: every
request must finish, with the same greedy tokens, and the new workers must have served some.

Needs root and ``ip netns`` (skipped with the reason otherwise). The Ray processes are ours:
``ray start --block`` in subprocesses that we stop, with a temp dir and an auth token of our
own, so nothing here touches another Ray on the machine (no ``ray stop``; the cluster's address
file lives in our temp dir, not /tmp/ray). Takes about a minute on two cores.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
HOST_A, HOST_B = "10.77.0.1", "10.77.0.2"
GCS_PORT = 6390
ROUTER_PORT = 50061


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


class TwoHosts:
    """Two network namespaces joined by a veth pair; removed (with the pair) on ``close``."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.ns_a, self.ns_b = f"pdmhA{tag}", f"pdmhB{tag}"
        self.created: list[str] = []
        for ns in (self.ns_a, self.ns_b):
            r = _run("ip", "netns", "add", ns)
            if r.returncode:
                self.close()
                raise PermissionError(f"`ip netns add {ns}` failed: {r.stderr.strip()}")
            self.created.append(ns)
        veth_a, veth_b = f"pdva{tag}", f"pdvb{tag}"
        steps = [
            ("ip", "link", "add", veth_a, "type", "veth", "peer", "name", veth_b),
            ("ip", "link", "set", veth_a, "netns", self.ns_a),
            ("ip", "link", "set", veth_b, "netns", self.ns_b),
            ("ip", "-n", self.ns_a, "addr", "add", f"{HOST_A}/24", "dev", veth_a),
            ("ip", "-n", self.ns_b, "addr", "add", f"{HOST_B}/24", "dev", veth_b),
            ("ip", "-n", self.ns_a, "link", "set", "lo", "up"),
            ("ip", "-n", self.ns_b, "link", "set", "lo", "up"),
            ("ip", "-n", self.ns_a, "link", "set", veth_a, "up"),
            ("ip", "-n", self.ns_b, "link", "set", veth_b, "up"),
        ]
        for step in steps:
            r = _run(*step)
            if r.returncode:
                self.close()
                raise PermissionError(f"`{' '.join(step)}` failed: {r.stderr.strip()}")

    def exec(self, ns: str, *cmd: str) -> list[str]:
        return ["ip", "netns", "exec", ns, *cmd]

    def close(self) -> None:
        for ns in self.created:  # deleting a namespace deletes its end of the pair, and so the pair
            _run("ip", "netns", "del", ns)
        self.created = []


class Procs:
    """Subprocesses we started, each in its own session; stopped in reverse order."""

    def __init__(self, log_dir: Path, env: dict) -> None:
        self.log_dir, self.env = log_dir, env
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, cmd: list[str]) -> subprocess.Popen:
        out = open(self.log_dir / f"{name}.log", "w")
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
                                text=True)
        self.procs.append((name, proc))
        return proc

    def log(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text()[-4000:] if path.exists() else ""

    def stop(self, name: str, sig: int = signal.SIGINT, timeout: float = 60) -> int | None:
        proc = dict(self.procs)[name]
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the session we started for it
                proc.wait()
        return proc.returncode

    def stop_all(self) -> None:
        for name, _ in reversed(self.procs):
            self.stop(name, signal.SIGTERM, timeout=30)


def wait_for_line(procs: Procs, name: str, text: str, timeout: float) -> None:
    proc = dict(procs.procs)[name]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if text in procs.log(name):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    raise AssertionError(f"{name} did not print {text!r}:\n{procs.log(name)}")


@pytest.fixture(scope="module")
def hosts():
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces (ip netns add)")
    if shutil.which("ip") is None:
        pytest.skip("needs the `ip` command (iproute2) to create network namespaces")
    try:
        h = TwoHosts()
    except PermissionError as exc:
        pytest.skip(f"network namespaces are not permitted here: {exc}")
    yield h
    h.close()


@pytest.fixture(scope="module")
def model_dir(tiny_servable_model) -> Path:
    return tiny_servable_model


@pytest.fixture(scope="module")
def hf_reference(model_dir):
    """Single-host greedy answers: Hugging Face ``generate()``, float32."""
    import torch
    from transformers import AutoModelForCausalLM

    from pdserve.engine.model_loader import load_tokenizer

    tok = load_tokenizer(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def answer(question: str, new_tokens: int) -> list[int]:
        ids = list(tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                           tokenize=True)["input_ids"])
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
        return out[0, len(ids):].tolist()

    return answer


def test_two_hosts_pinned_roles_kv_across_and_scaling_under_load(hosts, hf_reference, model_dir):
    sys.path.insert(0, str(HERE))
    import multihost_client as mc

    reference = [hf_reference(q, mc.NEW_TOKENS) for q in mc.QUESTIONS]

    tmp = Path(tempfile.mkdtemp(prefix="pdmh"))  # short: Ray's socket paths live under it
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32),
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    env.pop("RAY_ADDRESS", None)
    procs = Procs(tmp, env)
    gcs = f"{HOST_A}:{GCS_PORT}"
    try:
        common = ["--num-cpus", "4", "--object-store-memory", str(100 * 2**20), "--disable-usage-stats", "--block"]
        procs.start("head", hosts.exec(hosts.ns_a, "ray", "start", "--head", "--node-ip-address", HOST_A,
                                       "--port", str(GCS_PORT), "--temp-dir", str(tmp / "ray"),
                                       "--include-dashboard", "false", "--resources", '{"host_a": 4}', *common))
        wait_for_line(procs, "head", "Ray runtime started", 90)
        procs.start("worker", hosts.exec(hosts.ns_b, "ray", "start", "--address", gcs, "--node-ip-address", HOST_B,
                                         "--resources", '{"host_b": 4}', *common))
        # The router pins each role to a host; --resource-wait covers host B still joining.
        procs.start("serve", hosts.exec(
            hosts.ns_a, sys.executable, "-m", "pdserve.cli", "serve", "--address", gcs, "--mode", "disaggregated",
            "--prefill", "1", "--decode", "1", "--transport", "grpc",
            "--prefill-resources", '{"CPU": 0.5, "host_a": 1}', "--decode-resources", "CPU=0.5,host_b=1",
            "--resource-wait", "90", "--host", HOST_A, "--port", str(ROUTER_PORT), "--metrics-port", "off",
            "--model", str(model_dir), "--kv-memory", "16MiB", "--threads", "1", "--max-model-len", "256"))
        wait_for_line(procs, "serve", "listening on", 240)

        out = tmp / "client.json"
        client = subprocess.run(hosts.exec(hosts.ns_a, sys.executable, str(HERE / "multihost_client.py"),
                                           f"{HOST_A}:{ROUTER_PORT}", gcs, str(out)),
                                env=env, capture_output=True, text=True, timeout=400)
        assert client.returncode == 0, f"{client.stderr[-4000:]}\nserve log:\n{procs.log('serve')}"
        report = json.loads(out.read_text())

        # Two hosts; each role on its own, and the decode worker's KV receiver on host B.
        assert report["node_ips"] == [HOST_A, HOST_B]
        assert report["info"] == ["disaggregated", 1, 1, "grpc"]
        assert report["held_1p1d"] == {"host_a": 1.0, "host_b": 1.0}
        assert report["decode_kv_address"].startswith(f"{HOST_B}:")
        assert report["prefill_transfers"]["transfers"] >= len(mc.QUESTIONS)  # KV from A reached B
        assert report["greedy"] == reference

        # 1P+1D -> 2P+2D -> 1P+1D under load: the new actors joined on their hosts and served.
        assert report["scale_up"]["counts"] == [2, 2] and report["info_2p2d"] == [2, 2]
        assert sorted(report["scale_up"]["added"]) == ["pdserve-decode-s1-0", "pdserve-prefill-s1-0"]
        assert report["held_2p2d"] == {"host_a": 2.0, "host_b": 2.0}
        assert all(a.startswith(f"{HOST_B}:") for a in report["new_kv_addresses"].values())
        assert all(n > 0 for n in report["served_by_new"].values()), report["served_by_new"]
        assert report["scale_down"]["counts"] == [1, 1] and len(report["scale_down"]["removed"]) == 2
        assert report["scale_down"]["cut"] == 0
        assert report["held_after"] == {"host_a": 1.0, "host_b": 1.0}

        # No request lost or changed: every one finished with the single-host greedy tokens.
        results = report["results"]
        print(f"multihost: {len(results)} requests under load; scale up {report['scale_up']['s']:.1f} s, "
              f"scale down {report['scale_down']['s']:.1f} s; new workers served {report['served_by_new']}")
        errors = [r for r in results if "error" in r]
        assert not errors, errors[:5]
        assert len(results) >= 10
        assert all(r["tokens"] == reference[r["q"]] for r in results)
        assert any(r["t"] > report["scale_down"]["t_end"] for r in results)  # still serving after it

        assert procs.stop("serve") == 0, procs.log("serve")
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)
