"""`--prefill-resources`/`--decode-resources`: parsing, merging with the CPU/GPU flags, and the
check that refuses workers no node of the cluster can hold (before any actor starts)."""

from __future__ import annotations

import pytest

from pdserve import cli, serve
from pdserve.router.resources import ResourceSpecError, RoleResources, parse_resources, unplaceable


def test_json_and_short_syntax_mean_the_same():
    assert parse_resources('{"GPU": 1, "prefill_node": 1}') == {"GPU": 1.0, "prefill_node": 1.0}
    assert parse_resources("GPU=1, prefill_node=0.5") == {"GPU": 1.0, "prefill_node": 0.5}
    assert parse_resources("") == {}


@pytest.mark.parametrize("text,message", [
    ("{GPU: 1}", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ("GPU", "NAME=AMOUNT"),
    ("GPU=one", "GPU must be a number"),
    ("GPU=-1", "GPU must be a number >= 0"),
    ("GPU=1.5", "above 1 must be whole numbers"),
    ('{"GPU": 1, "GPU": 2}', None),  # JSON keeps the last; the short syntax refuses repeats:
    ("GPU=1,GPU=2", "given twice"),
])
def test_bad_specs_say_what_is_wrong(text, message):
    if message is None:
        assert parse_resources(text) == {"GPU": 2.0}
        return
    with pytest.raises(ResourceSpecError, match=message):
        parse_resources(text, "--decode-resources")


def serve_args(*flags: str):
    args = cli.build_parser().parse_args(["serve", *flags])
    return args, serve.check_serve_args(args)


def test_cpu_and_gpu_in_a_spec_replace_the_flags_and_custom_names_pin():
    args, error = serve_args("--mode", "disaggregated", "--prefill-resources", '{"GPU": 1, "prefill_node": 1}',
                             "--decode-resources", "CPU=2,decode_node=1")
    assert error is None
    assert (args.prefill_cpus, args.prefill_gpus, args.prefill_role.custom) == (1.0, 1.0, {"prefill_node": 1.0})
    assert (args.decode_cpus, args.decode_gpus, args.decode_role.custom) == (2.0, 0.0, {"decode_node": 1.0})


@pytest.mark.parametrize("flags,message", [
    (["--decode-resources", "GPU=1", "--decode-gpus", "1"], "sets GPU and so does --decode-gpus"),
    (["--mode", "disaggregated", "--prefill-resources", "CPU=1", "--prefill-cpus", "2"], "--prefill-cpus"),
    (["--prefill-resources", "GPU=1"], "--prefill-resources applies to --mode disaggregated only"),
    (["--decode-resources", "GPU=lots"], "GPU must be a number"),
])
def test_conflicting_or_misplaced_flags_are_errors(flags, message):
    _, error = serve_args(*flags)
    assert error is not None and message in error


def test_serve_fails_fast_naming_the_missing_resource(local_ray, capsys):
    # A colocated worker that wants a node type the (local) Ray cluster lacks: the real command
    # stops at its check, before any actor starts, and says what is missing.
    code = cli.main(["serve", "--decode-resources", '{"CPU": 0.1, "decode_node": 1}', "--port", "0",
                     "--metrics-port", "off", "--model", "default"])
    assert code == 1
    err = capsys.readouterr().err
    assert 'asks for {"CPU": 0.1, "decode_node": 1.0} but no node of the Ray cluster has decode_node' in err


GPU_NODE = {"CPU": 8.0, "GPU": 1.0, "prefill_node": 1.0}
DECODE_NODE = {"CPU": 48.0, "GPU": 4.0, "decode_node": 4.0}


def test_unplaceable_checks_single_nodes_not_totals():
    prefill = RoleResources(1, 1, {"prefill_node": 1})
    decode = RoleResources(1, 1, {"decode_node": 1})
    nodes = [GPU_NODE, DECODE_NODE]
    assert unplaceable([("prefill", 1, prefill), ("decode", 4, decode)], nodes) is None
    assert "room for 4 of the 5 decode workers" in unplaceable([("decode", 5, decode)], nodes)
    # 2 GPUs in all, but no node holds 2: an actor runs on one node.
    assert "the largest amount of GPU on one node is 1" in unplaceable(
        [("prefill", 1, RoleResources(1, 2))], [GPU_NODE, GPU_NODE])
    # Every resource exists, but never on one node together.
    assert "no single node has all of it" in unplaceable(
        [("prefill", 1, RoleResources(1, 1, {"decode_node": 1, "prefill_node": 1}))], nodes)
    assert "no node of the Ray cluster has tpu" in unplaceable([("decode", 1, RoleResources(1, 0, {"tpu": 1}))], nodes)
