"""What each worker role asks Ray for, and whether a cluster can ever give it.

``pdserve serve --prefill-resources '{"GPU": 1, "prefill_node": 1}'`` pins prefill actors to the
nodes that advertise ``prefill_node`` (a custom resource set by ``ray start --resources`` or a
node type of a ``ray up`` config). ``CPU`` and ``GPU`` become the actor's ``num_cpus`` and
``num_gpus``; every other name is a custom resource. Ray places an actor on one node, so an
actor fits only where a single node has all it asks for: ``unplaceable`` checks that against
the nodes' totals before any actor starts, since an actor that fits nowhere would wait forever.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field


class ResourceSpecError(ValueError):
    """A resource flag that cannot be parsed or asks for something Ray cannot give."""


@dataclass
class RoleResources:
    """The Ray resources of one worker actor of a role."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    custom: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, float]:
        """Every resource this actor holds, as Ray names them (zeros left out)."""
        out = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.custom}
        return {k: v for k, v in out.items() if v > 0}

    def describe(self) -> str:
        return json.dumps(self.as_dict()) if self.as_dict() else "{} (no resources)"


def parse_resources(text: str, flag: str = "--resources") -> dict[str, float]:
    """``'{"GPU": 1, "prefill_node": 1}'`` or ``GPU=1,prefill_node=1`` -> ``{"GPU": 1.0, ...}``."""
    text = text.strip()
    if not text:
        return {}
    if text[0] in "{[\"":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ResourceSpecError(f"{flag}: not valid JSON ({exc.msg}): {text!r}; "
                                    "use e.g. '{\"GPU\": 1, \"prefill_node\": 1}' or GPU=1,prefill_node=1") from None
        if not isinstance(raw, dict):
            raise ResourceSpecError(f"{flag}: expected a JSON object of resource name -> amount, got {text!r}")
        items = list(raw.items())
    else:
        items = []
        for part in text.split(","):
            name, sep, amount = part.partition("=")
            if not sep:
                raise ResourceSpecError(f"{flag}: expected NAME=AMOUNT pairs separated by commas, got {part.strip()!r}")
            items.append((name.strip(), amount.strip()))
    out: dict[str, float] = {}
    for name, amount in items:
        if not isinstance(name, str) or not name:
            raise ResourceSpecError(f"{flag}: a resource needs a name")
        if name in out:
            raise ResourceSpecError(f"{flag}: resource {name!r} is given twice")
        try:
            value = float(amount)
        except (TypeError, ValueError):
            raise ResourceSpecError(f"{flag}: {name} must be a number, got {amount!r}") from None
        if not math.isfinite(value) or value < 0:
            raise ResourceSpecError(f"{flag}: {name} must be a number >= 0, got {amount!r}")
        if value > 1 and value != int(value):
            # Ray's rule: fractions of a resource only below one unit.
            raise ResourceSpecError(f"{flag}: {name}={value:g}: amounts above 1 must be whole numbers")
        out[name] = value
    return out


def role_resources(custom: dict[str, float], num_cpus: float | None, num_gpus: float | None,
                   flag: str, default_cpus: float = 1.0) -> RoleResources:
    """Merge ``--ROLE-resources`` with ``--ROLE-cpus``/``--ROLE-gpus``; giving one resource both
    ways is an error (which one should win is not obvious)."""
    custom = dict(custom)
    role = flag.split("-")[2]  # "--prefill-resources" -> "prefill"
    for key, value in (("CPU", num_cpus), ("GPU", num_gpus)):
        if key in custom and value is not None:
            raise ResourceSpecError(f"{flag} sets {key} and so does --{role}-{key.lower()}s: give it once")
    cpus = custom.pop("CPU", num_cpus if num_cpus is not None else default_cpus)
    gpus = custom.pop("GPU", num_gpus if num_gpus is not None else 0.0)
    return RoleResources(num_cpus=cpus, num_gpus=gpus, custom=custom)


def unplaceable(demands: list[tuple[str, int, RoleResources]], nodes: list[dict[str, float]]) -> str | None:
    """Whether ``count`` actors of each ``(role, count, resources)`` can be placed on ``nodes``
    (each node's total resources), every actor on one node. ``None`` when they all fit, else a
    message naming the role and the resource that is short. Placement is first fit, largest
    demands first: good enough to tell "can never work" from "fits"."""
    free = [dict(n) for n in nodes]
    order = sorted(demands, key=lambda d: -sum(d[2].as_dict().values()))
    for role, count, res in order:
        need = res.as_dict()
        for placed in range(count):
            node = next((n for n in free if all(n.get(k, 0.0) + 1e-9 >= v for k, v in need.items())), None)
            if node is None:
                return _explain(role, count, placed, res, nodes)
            for k, v in need.items():
                node[k] = node.get(k, 0.0) - v
    return None


def _explain(role: str, count: int, placed: int, res: RoleResources, nodes: list[dict[str, float]]) -> str:
    need = res.as_dict()
    flag = f"--{role}-resources"
    for k, v in need.items():
        best = max((n.get(k, 0.0) for n in nodes), default=0.0)
        if best + 1e-9 < v:
            where = (f"no node of the Ray cluster has {k}" if best == 0
                     else f"the largest amount of {k} on one node is {best:g}")
            return (f"each {role} worker asks for {res.describe()} but {where}: start nodes that "
                    f"advertise it (ray start --resources '{{\"{k}\": N}}' or a node type in deploy/) "
                    f"or change {flag}")
    together = [n for n in nodes if all(n.get(k, 0.0) >= v for k, v in need.items())]
    if not together:
        return (f"each {role} worker asks for {res.describe()} but no single node has all of it "
                f"(an actor runs on one node): change {flag}")
    return (f"the Ray cluster has room for {placed} of the {count} {role} workers "
            f"({res.describe()} each) next to the other workers; add nodes, lower the number of "
            f"{role} workers or ask for less ({flag}, fractions such as 0.5 are fine)")


def cluster_nodes() -> list[dict[str, float]]:
    """The total resources of each live node of the connected Ray cluster."""
    import ray

    return [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]
