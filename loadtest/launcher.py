"""Start and stop the servers that ``pdserve loadtest compare`` measures.

Each configuration runs as a ``pdserve serve`` subprocess on a free port, joined to one Ray
cluster: a local one started here (``ray.init(address="local")``, sized to what the workers ask
for), or the cluster given with ``--address``. The configurations run one after the other, never
together, so they never share CPUs. Their actors are named ``pdserve-loadtest-MODE-ROLE-N``
(``pdserve serve --name``), so they do not clash with a pdserve server already on the cluster.

``equal_resource_configs`` builds the pair that the comparison is about: ``P`` prefill + ``D``
decode actors against ``P + D`` colocated actors, every actor with the same CPUs, GPUs and
torch threads, so both sides hold the same resources in total.

A server is stopped as a user stops ``pdserve serve``: SIGINT, then a wait for it to kill its
actors and free its port; one that does not exit in time is killed, and any actor it left in the
cluster is killed by name. The subprocess runs in its own session, so a Ctrl-C in the terminal
reaches only the load test, which then stops the server itself.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

RAY_NAMESPACE = "pdserve"  # as pdserve.serve's RAY_NAMESPACE
_LISTENING = re.compile(r"pdserve: listening on (\S+) ")


class LaunchError(RuntimeError):
    """A server could not be started (the message says why and where its log is)."""


@dataclass
class ServerConfig:
    """One server configuration: its mode, actor counts and per-actor resources."""

    mode: str  # "colocated" or "disaggregated"
    decode: int  # decode actors (colocated: the workers)
    prefill: int = 0  # prefill actors (disaggregated only)
    cpus: float = 1.0  # Ray CPUs each actor reserves
    gpus: float = 0.0  # Ray GPUs each actor reserves
    threads: int | None = 1  # torch threads per actor
    model: str = "default"
    kv_memory: str | None = None
    max_model_len: int | None = None
    transport: str = "grpc"
    name: str = ""  # prefix of the actor names (`pdserve serve --name`); default pdserve-loadtest-MODE

    @property
    def server_name(self) -> str:
        return self.name or f"pdserve-loadtest-{self.mode}"

    @property
    def num_actors(self) -> int:
        return self.decode + self.prefill

    def resources(self) -> dict[str, float]:
        return {"CPU": self.num_actors * self.cpus, "GPU": self.num_actors * self.gpus}

    def describe(self) -> str:
        threads = f", {self.threads} thread{'s' if self.threads != 1 else ''} each" if self.threads else ""
        each = f"{self.cpus:g} CPU" + (f" + {self.gpus:g} GPU" if self.gpus else "")
        if self.mode == "colocated":
            return f"{self.decode} colocated actors ({each}{threads})"
        return (f"{self.prefill} prefill + {self.decode} decode actors ({each}{threads}, "
                f"KV over {self.transport})")

    def actor_names(self) -> list[str]:
        return ([f"{self.server_name}-decode-{i}" for i in range(self.decode)]
                + [f"{self.server_name}-prefill-{i}" for i in range(self.prefill)])

    def serve_args(self, ray_address: str) -> list[str]:
        args = ["serve", "--mode", self.mode, "--decode", str(self.decode), "--decode-cpus", f"{self.cpus:g}",
                "--decode-gpus", f"{self.gpus:g}", "--model", self.model, "--port", "0", "--address", ray_address,
                "--name", self.server_name]
        if self.mode == "disaggregated":
            args += ["--prefill", str(self.prefill), "--prefill-cpus", f"{self.cpus:g}",
                     "--prefill-gpus", f"{self.gpus:g}", "--transport", self.transport]
        if self.threads:
            args += ["--threads", str(self.threads)]
        if self.kv_memory:
            args += ["--kv-memory", self.kv_memory]
        if self.max_model_len:
            args += ["--max-model-len", str(self.max_model_len)]
        return args


def equal_resource_configs(prefill: int = 1, decode: int = 1, **common) -> list[ServerConfig]:
    """Colocated with ``prefill + decode`` actors, and disaggregated with ``prefill`` + ``decode``
    actors, every actor alike (``common``: cpus, gpus, threads, model, ...)."""
    if prefill < 1 or decode < 1:
        raise ValueError("the disaggregated side needs at least one prefill and one decode actor")
    return [ServerConfig("colocated", decode=prefill + decode, **common),
            ServerConfig("disaggregated", decode=decode, prefill=prefill, **common)]


class RayCluster:
    """The Ray cluster the servers join: started here (and shut down on exit) or given."""

    def __init__(self, address: str | None = None, num_cpus: float | None = None) -> None:
        self.address = address
        self.num_cpus = num_cpus
        self.started = False
        self.gcs_address = ""

    def __enter__(self) -> "RayCluster":
        import ray

        kwargs = dict(namespace=RAY_NAMESPACE, log_to_driver=False, configure_logging=False)
        # A Ctrl-C in the middle of ray.init would leave the processes it had started unknown to
        # ray.shutdown (and running): it takes effect once Ray is up, and Ray is shut down then.
        with _sigint_deferred() as interrupted:
            if self.address:
                ray.init(address=self.address, **kwargs)
            else:
                cpus = None if self.num_cpus is None else max(1, math.ceil(self.num_cpus))
                ray.init(address="local", num_cpus=cpus, include_dashboard=False, **kwargs)
                self.started = True
        if interrupted:
            ray.shutdown()
            raise KeyboardInterrupt
        self.gcs_address = ray.get_runtime_context().gcs_address
        return self

    def __exit__(self, *exc) -> None:
        import ray

        ray.shutdown()  # a Ray started here stops with it; a given cluster is only left

    def check(self, config: ServerConfig) -> None:
        """Fail early when the cluster cannot hold ``config`` or another pdserve holds its names."""
        import ray

        have = ray.cluster_resources()
        for kind, need in config.resources().items():
            if need > have.get(kind, 0) + 1e-9:
                raise LaunchError(f"{config.mode}: the actors ask for {need:g} {kind}s in all but the Ray cluster "
                                  f"has {have.get(kind, 0):g}; lower --cpus-per-actor/--gpus-per-actor or the "
                                  "number of actors")
        for name in config.actor_names():
            if _actor_exists(name):
                raise LaunchError(f"an actor named {name!r} already runs in this Ray cluster (another load "
                                  "test?); stop it, or compare on another cluster")

    def kill_leftovers(self, config: ServerConfig) -> list[str]:
        """Kill actors of ``config`` that are still alive (a server that had to be killed)."""
        import ray

        killed = []
        for name in config.actor_names():
            try:
                ray.kill(ray.get_actor(name, namespace=RAY_NAMESPACE))
                killed.append(name)
            except ValueError:  # gone, as it should be
                pass
        return killed


@contextlib.contextmanager
def _sigint_deferred():
    """Hold SIGINT for the block (main thread only); yields a list that is non-empty if one came."""
    came: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield came
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: came.append(signum))
    try:
        yield came
    finally:
        signal.signal(signal.SIGINT, previous)


def _actor_exists(name: str) -> bool:
    import ray

    try:
        ray.get_actor(name, namespace=RAY_NAMESPACE)
    except ValueError:
        return False
    return True


class ServerProcess:
    """``pdserve serve`` for one configuration, as a subprocess; a context manager that stops it."""

    def __init__(self, config: ServerConfig, cluster: RayCluster, log_path: str | Path) -> None:
        self.config = config
        self.cluster = cluster
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None
        self.address = ""

    def start(self, timeout_s: float = 600.0) -> str:
        """Start the server; return its address once it listens."""
        self.cluster.check(self.config)
        cmd = [sys.executable, "-m", "pdserve.cli", *self.config.serve_args(self.cluster.gcs_address)]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
            env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True)
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            m = _LISTENING.search(self.log_path.read_text(errors="replace"))
            if m:
                self.address = m.group(1)
                return self.address
            if self.proc.poll() is not None:
                raise LaunchError(f"{self.config.mode} server exited with status {self.proc.returncode} before "
                                  f"it listened; its log: {self.log_path}\n{_tail(self.log_path)}")
            time.sleep(0.2)
        raise LaunchError(f"{self.config.mode} server did not listen within {timeout_s:g} s; its log: {self.log_path}")

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGINT and wait (as Ctrl-C on ``pdserve serve``); kill it and its actors if it hangs."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=timeout_s)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            proc.kill()
            proc.wait()
        finally:
            if proc.poll() is None:  # interrupted before the kill above
                proc.kill()
                proc.wait()
            self.cluster.kill_leftovers(self.config)

    def __enter__(self) -> "ServerProcess":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
