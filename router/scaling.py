"""Starting worker actors, and changing how many run while the server serves.

``ActorFactory`` starts the actors of each role with the resources the user declared. Actor
names are ``<server name>-<role>-<n>`` for the actors a server starts with (``pdserve-decode-0``:
``pdserve serve --name`` changes the first part, so two servers can share a cluster) and
``<server name>-<role>-s<k>-<n>`` for the k-th scale-up, so no two ever collide. ``Scaler`` is what the ``Admin.Scale`` RPC calls:
new actors start and join placement first, then the ones to remove drain (no new requests;
running ones finish) and stop, so a scale in either direction loses no request.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.router.resources import RoleResources, cluster_nodes, unplaceable

logger = logging.getLogger(__name__)

# Longest wait for new actors to be placed and load their model, on top of --resource-wait.
START_TIMEOUT_S = 600.0
DEFAULT_DRAIN_TIMEOUT_S = 300.0


class ScaleError(Exception):
    """A scale request that cannot be done; ``code`` is the gRPC status name to answer with."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class StartFailed(RuntimeError):
    """New worker actors could not be started (placement timed out, or the actor raised)."""


@dataclass
class ScaleResult:
    num_prefill: int
    num_decode: int
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    num_cut: int = 0


class ActorFactory:
    """Starts worker actors of a server's roles: ``colocated``, or ``prefill`` and ``decode``.

    ``configs`` maps each role to its worker config (``WorkerConfig`` for colocated and decode,
    ``PrefillConfig`` for prefill) and ``resources`` to its ``RoleResources``.
    ``resource_wait_s`` is how long a start may wait for the cluster to provide resources
    (an autoscaler adding nodes) before it gives up. Colocated workers are named ``decode``.
    """

    def __init__(self, configs: dict[str, Any], resources: dict[str, RoleResources],
                 resource_wait_s: float = 0.0, name: str = "pdserve",
                 start_timeout_s: float = START_TIMEOUT_S):
        self.configs = configs
        self.resources = resources
        self.resource_wait_s = resource_wait_s
        self.start_timeout_s = start_timeout_s
        self.name = name
        self._batches = {role: itertools.count() for role in configs}
        self.started: list = []  # every actor this factory started: the server stops them on exit

    @property
    def roles(self) -> list[str]:
        return list(self.configs)

    def check_fits(self, counts: dict[str, int]) -> str | None:
        """Why ``counts`` actors per role can never be placed on the cluster's nodes, or None."""
        return unplaceable([(role, n, self.resources[role]) for role, n in counts.items() if n > 0],
                           cluster_nodes())

    def start(self, role: str, count: int) -> tuple[list, list[str]]:
        """Start ``count`` actors of ``role`` and wait until each has loaded its model (blocking).
        Returns ``(handles, names)``; on failure or timeout every actor of the batch is killed
        and ``StartFailed`` says why."""
        import ray

        batch = next(self._batches[role])
        prefix = f"{self.name}-{'prefill' if role == 'prefill' else 'decode'}" + (f"-s{batch}" if batch else "")
        names = [f"{prefix}-{i}" for i in range(count)]
        for name in names:
            try:
                ray.get_actor(name)
            except ValueError:
                continue
            raise StartFailed(f"an actor named {name!r} already runs in this Ray cluster (another pdserve "
                              "server?): give this server another name with `pdserve serve --name`")
        res = self.resources[role]
        config = copy.deepcopy(self.configs[role])
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["handles"] = self._start_fn(role)(config, num_workers=count, num_cpus=res.num_cpus,
                                                         num_gpus=res.num_gpus, resources=res.custom or None,
                                                         name_prefix=prefix, **self._role_kwargs(role))
            except BaseException as exc:  # reported below, in the caller's thread
                result["error"] = exc

        thread = threading.Thread(target=run, name=f"start-{prefix}", daemon=True)
        thread.start()
        timeout = self.resource_wait_s + self.start_timeout_s
        thread.join(timeout)
        timed_out = thread.is_alive()
        if timed_out or "error" in result:
            for name in names:  # kill what started; a thread still waiting then wakes with an error
                try:
                    ray.kill(ray.get_actor(name))
                except Exception:
                    pass
            thread.join(30)
            if not timed_out:
                raise StartFailed(f"starting {count} {role} worker(s) failed: {result['error']}") from result["error"]
            why = self.check_fits({role: count}) or (
                f"each asks for {res.describe()}; other work may hold it, or loading the model took longer")
            raise StartFailed(f"{count} {role} worker(s) did not start within {timeout:g} s: {why}")
        self.started += result["handles"]
        return result["handles"], names

    @staticmethod
    def _start_fn(role: str):
        if role == "prefill":
            from pdserve.prefill_worker.worker import start_prefill_workers

            return start_prefill_workers
        from pdserve.decode_worker.worker import start_workers

        return start_workers

    @staticmethod
    def _role_kwargs(role: str) -> dict:
        return {} if role == "prefill" else {"role": role}


class Scaler:
    """Changes the number of workers of each role of a running ``WorkerPool``.

    One scale at a time. Additions come first (they start, load, and join placement), then the
    removals drain and stop, so capacity never dips below the smaller of old and new.
    """

    def __init__(self, pool, factory: ActorFactory):
        self.pool = pool
        self.factory = factory
        self._lock = asyncio.Lock()

    @property
    def polled_role(self) -> str:
        return "decode" if self.pool.disaggregated else "colocated"

    async def scale(self, prefill: int | None, decode: int | None,
                    drain_timeout_s: float | None = DEFAULT_DRAIN_TIMEOUT_S) -> ScaleResult:
        """Run ``prefill`` prefill and ``decode`` decode (colocated: plain) workers; ``None``
        leaves a role as it is."""
        want: dict[str, int] = {}
        if prefill is not None:
            if not self.pool.disaggregated:
                raise ScaleError("INVALID_ARGUMENT", "this server runs in colocated mode: it has no prefill "
                                 "workers (scale its workers with --decode)")
            want["prefill"] = prefill
        if decode is not None:
            want[self.polled_role] = decode
        for role, n in want.items():
            if n < 1:
                raise ScaleError("INVALID_ARGUMENT", f"a server needs at least 1 {role} worker; got {n}")
        if drain_timeout_s is not None and not drain_timeout_s >= 0:
            raise ScaleError("INVALID_ARGUMENT", f"drain_timeout_s must be >= 0; got {drain_timeout_s}")
        async with self._lock:
            have = {role: self.pool.num_serving(role) for role in self.factory.roles}
            adds = {role: n - have[role] for role, n in want.items() if n > have[role]}
            drops = {role: have[role] - n for role, n in want.items() if n < have[role]}
            result = ScaleResult(0, 0)
            if adds:
                peak = {role: max(have[role], want.get(role, 0)) for role in have}
                why = self.factory.check_fits(peak)
                if why and not self.factory.resource_wait_s:
                    raise ScaleError("RESOURCE_EXHAUSTED", f"cannot add workers: {why}")
                result.added = await self._add(adds)
            for role, n in drops.items():
                t0 = time.monotonic()
                actors, names, cut = await self.pool.remove_workers(role, n, drain_timeout_s)
                self._kill(actors)
                logger.info("scaled away %s worker(s) %s after a %.2f s drain (%d request(s) cut)",
                            role, ", ".join(names), time.monotonic() - t0, cut)
                result.removed += names
                result.num_cut += cut
            result.num_prefill = self.pool.num_serving("prefill") if self.pool.disaggregated else 0
            result.num_decode = self.pool.num_serving(self.polled_role)
            return result

    async def _add(self, adds: dict[str, int]) -> list[str]:
        started = await asyncio.gather(*(asyncio.to_thread(self.factory.start, role, n) for role, n in adds.items()),
                                       return_exceptions=True)
        errors = [r for r in started if isinstance(r, BaseException)]
        if errors:
            self._kill([h for r in started if not isinstance(r, BaseException) for h in r[0]])
            raise ScaleError("UNAVAILABLE" if isinstance(errors[0], StartFailed) else "INTERNAL", str(errors[0]))
        names: list[str] = []
        for role, (handles, _) in zip(adds, started):
            try:
                names += await self.pool.add_workers(handles, role)
            except ValueError as exc:
                self._kill(handles)
                raise ScaleError("FAILED_PRECONDITION", str(exc)) from None
            logger.info("scaled up: %d %s worker(s) %s", len(handles), role, ", ".join(names[-len(handles):]))
        return names

    @staticmethod
    def _kill(actors: list) -> None:
        import ray

        for a in actors:
            try:
                ray.kill(a)
            except Exception:  # already gone
                pass
