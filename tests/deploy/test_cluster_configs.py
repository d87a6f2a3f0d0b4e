"""The cluster configs in deploy/ are what Ray and pdserve accept, checked offline.

Every `ray up` config validates against the cluster-config schema that ships inside the
installed `ray` package (and Ray's own offline checks); the pdserve command each one starts is
one that `pdserve serve` parses, and the custom resources it pins roles with are ones the
config's node types advertise. The KubeRay manifest parses, names one image everywhere, and its
worker groups advertise what the router's command asks for.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml

from pdserve import cli, serve

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RAY_UP_CONFIGS = sorted(p for p in DEPLOY.glob("*/*.yaml") if p.parent.name != "kuberay")
KUBERAY = DEPLOY / "kuberay" / "raycluster.yaml"


def ray_schema() -> dict:
    return json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())


def serve_args(command: str):
    """The parsed and checked `pdserve serve` arguments of a shell command line."""
    words = shlex.split(command)
    words = words[words.index("pdserve") + 1:]
    for end in (">", "&", ";", "&&"):  # the shell's redirections end the command
        if end in words:
            words = words[:words.index(end)]
    args = cli.build_parser(words).parse_args(words)
    assert args.func is serve.cmd_serve
    assert serve.check_serve_args(args) is None
    return args


def custom_resources(args) -> set[str]:
    names = set(args.decode_role.custom)
    if args.mode == "disaggregated":
        names |= set(args.prefill_role.custom)
    return names


def test_there_are_configs_for_aws_and_gcp():
    providers = {yaml.safe_load(p.read_text())["provider"]["type"] for p in RAY_UP_CONFIGS}
    assert {"aws", "gcp"} <= providers


@pytest.mark.parametrize("path", RAY_UP_CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_ray_up_config_validates_against_rays_schema(path: Path):
    config = yaml.safe_load(path.read_text())
    jsonschema.validate(config, ray_schema())
    from ray.autoscaler._private.util import validate_config

    validate_config(config)  # Ray's own offline checks on top (head node type, worker counts)


@pytest.mark.parametrize("path", RAY_UP_CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_ray_up_config_installs_and_starts_pdserve_on_its_gpu_nodes(path: Path):
    config = yaml.safe_load(path.read_text())
    types = config["available_node_types"]
    head, workers = types[config["head_node_type"]], [t for n, t in types.items() if n != config["head_node_type"]]
    assert workers and all(t["resources"].get("GPU", 0) >= 1 for t in workers), "GPU worker node types"
    assert config["docker"]["image"].startswith(f"rayproject/ray:{ray.__version__}-"), "the Ray image matches the pinned ray"

    setup = config["setup_commands"] + config["worker_setup_commands"]
    assert any("torch==2.13.0" in c and "+cpu" not in c for c in setup), "GPU nodes install the CUDA torch build"
    assert any("pip install" in c and "pdserve" in c for c in setup), "the nodes install pdserve"

    starts = [c for c in config["head_start_ray_commands"] if "pdserve serve" in c]
    assert len(starts) == 1
    args = serve_args(starts[0])
    assert args.address == "auto" and args.host == "0.0.0.0"
    advertised = {name for t in types.values() for name in t["resources"]}
    pinned = custom_resources(args)
    assert pinned and pinned <= advertised, f"{pinned - advertised} is advertised by no node type"
    assert not pinned & set(head["resources"]), "workers are not pinned to the head"
    # The roles land on different node types.
    prefill_types = {n for n, t in types.items() if set(args.prefill_role.custom) <= set(t["resources"])}
    decode_types = {n for n, t in types.items() if set(args.decode_role.custom) <= set(t["resources"])}
    assert prefill_types and decode_types and not prefill_types & decode_types


def test_kuberay_manifest_names_one_image_and_consistent_resources():
    docs = list(yaml.safe_load_all(KUBERAY.read_text()))
    cluster = next(d for d in docs if d["kind"] == "RayCluster")
    service = next(d for d in docs if d["kind"] == "Service")
    assert cluster["apiVersion"] == "ray.io/v1"
    assert cluster["spec"]["rayVersion"] == ray.__version__

    head_pod = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    groups = cluster["spec"]["workerGroupSpecs"]
    containers = head_pod["containers"] + [c for g in groups for c in g["template"]["spec"]["containers"]]
    images = {c["image"] for c in containers}
    assert len(images) == 1, f"one pdserve image everywhere, got {images}"
    dockerfile = (DEPLOY / "kuberay" / "Dockerfile").read_text()
    assert f"FROM rayproject/ray:{ray.__version__}-" in dockerfile
    assert "pip install" in dockerfile and "/home/ray/pdserve" in dockerfile

    router = next(c for c in head_pod["containers"] if "pdserve serve" in " ".join(c.get("args", [])))
    args = serve_args(" ".join(router["args"]))
    assert args.address == "auto" and args.host == "0.0.0.0"
    # `--address auto` finds the head through the /tmp/ray the two containers share.
    mounts = {c["name"]: {m["mountPath"] for m in c.get("volumeMounts", [])} for c in head_pod["containers"]}
    assert all("/tmp/ray" in m for m in mounts.values())

    advertised: dict[str, set[str]] = {}
    for g in groups:
        spec = g["rayStartParams"]["resources"].strip().strip('"').replace('\\"', '"')
        advertised[g["groupName"]] = set(json.loads(spec))
        gpus = int(g["rayStartParams"]["num-gpus"])
        for c in g["template"]["spec"]["containers"]:
            assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == gpus
    assert {n for n, names in advertised.items() if set(args.prefill_role.custom) <= names} == {"prefill"}
    assert {n for n, names in advertised.items() if set(args.decode_role.custom) <= names} == {"decode"}

    port = next(p for p in router["ports"] if p["containerPort"] == args.port)
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]
    assert service["spec"]["selector"] == {"ray.io/cluster": cluster["metadata"]["name"], "ray.io/node-type": "head"}
