"""The `pdserve` command line: parsing and the checks made before anything starts."""

from __future__ import annotations

import argparse
import sys
import types

import pytest

from pdserve import cli, serve


def test_sizes():
    assert cli.parse_size("512MiB") == 512 * 2**20
    assert cli.parse_size("2GB") == 2 * 10**9
    assert cli.parse_size("1g") == 2**30
    assert cli.parse_size("1048576") == 2**20
    with pytest.raises(argparse.ArgumentTypeError):
        cli.parse_size("lots")


def test_serve_defaults():
    args = cli.build_parser().parse_args(["serve"])
    assert (args.mode, args.decode, args.prefill, args.model, args.port, args.address) == (
        "colocated", 1, None, "default", cli.DEFAULT_PORT, None)


def test_serve_rejects_bad_counts(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--decode", "0"])
    assert "expected an integer >= 1, got 0" in capsys.readouterr().err


def test_disaggregated_defaults():
    args = cli.build_parser().parse_args(["serve", "--mode", "disaggregated", "--decode", "2"])
    assert serve.check_serve_args(args) is None
    assert (args.prefill, args.decode, args.transport) == (1, 2, "grpc")
    assert (args.prefill_cpus, args.prefill_gpus, args.decode_cpus, args.decode_gpus) == (1.0, 0.0, 1.0, 0.0)


@pytest.mark.parametrize("flags,transport", [
    (["--prefill-gpus", "1", "--decode-gpus", "1"], "collective"),  # both on CUDA: NCCL, GPU to GPU
    (["--prefill-resources", "GPU=1", "--decode-resources", '{"GPU": 0.5}'], "collective"),
    (["--prefill-gpus", "1"], "grpc"),  # a CPU decode side cannot join NCCL
    (["--decode-gpus", "1"], "grpc"),
    ([], "grpc"),
    (["--prefill-gpus", "1", "--decode-gpus", "1", "--transport", "grpc"], "grpc"),  # asked for: kept
])
def test_the_default_transport_is_collective_when_both_roles_run_on_gpus(flags, transport):
    args = cli.build_parser().parse_args(["serve", "--mode", "disaggregated", *flags])
    assert serve.check_serve_args(args) is None
    assert args.transport == transport


@pytest.mark.parametrize("flags,kv_push", [([], "chunk"), (["--kv-push", "layer"], "layer")])
def test_kv_push_reaches_the_prefill_workers_config(flags, kv_push):
    args = cli.build_parser().parse_args(["serve", "--mode", "disaggregated", *flags])
    assert serve.check_serve_args(args) is None
    assert serve.actor_factory(args).configs["prefill"].kv_push == kv_push


def test_per_role_resources():
    args = cli.build_parser().parse_args(["serve", "--mode", "disaggregated", "--prefill", "3", "--prefill-cpus",
                                          "0.5", "--prefill-gpus", "1", "--decode-cpus", "2", "--transport", "grpc"])
    assert serve.check_serve_args(args) is None
    assert (args.prefill, args.prefill_cpus, args.prefill_gpus, args.decode_cpus) == (3, 0.5, 1.0, 2.0)


@pytest.mark.parametrize("flags,name", [(["--prefill", "2"], "--prefill"), (["--prefill-cpus", "1"], "--prefill-cpus"),
                                        (["--prefill-gpus", "1"], "--prefill-gpus"), (["--transport", "grpc"], "--transport"),
                                        (["--kv-push", "layer"], "--kv-push")])
def test_disaggregated_flags_without_disaggregated_mode_are_refused(capsys, flags, name):
    assert cli.main(["serve", *flags]) == 2
    assert f"{name} applies to --mode disaggregated only" in capsys.readouterr().err


def test_unknown_transport_and_negative_resources_are_refused(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--mode", "disaggregated", "--transport", "carrier-pigeon"])
    assert "invalid choice: 'carrier-pigeon'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["serve", "--decode-cpus", "-1"])
    assert "expected a number >= 0, got -1.0" in capsys.readouterr().err


def test_actors_that_cannot_fit_the_cluster_are_refused(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"CPU": 2.0}}])
    args = cli.build_parser().parse_args(["serve", "--mode", "disaggregated", "--prefill", "2"])
    serve.check_serve_args(args)
    error = serve.check_resources(args, strict=True)
    assert "the workers ask for 3 CPUs in all but the Ray cluster has 2" in error
    assert serve.check_resources(args, strict=False) is None  # --resource-wait: the cluster may grow
    args.prefill_cpus = 0.5
    assert serve.check_resources(args, strict=True) is None
    args.prefill_gpus = 1
    assert "ask for 2 GPUs" in serve.check_resources(args, strict=True)


def test_generate_needs_some_input(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", types.SimpleNamespace(isatty=lambda: True))
    assert cli.main(["generate"]) == 2
    assert "give TEXT" in capsys.readouterr().err


def test_generate_reads_messages_file(tmp_path):
    f = tmp_path / "m.json"
    f.write_text('[{"role": "system", "content": "Be brief."}]')
    args = cli.build_parser().parse_args(["generate", "--messages", str(f), "Hi"])
    assert cli._request_input(args) == {"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
    f.write_text('{"role": "user"}')
    with pytest.raises(ValueError, match="expected a JSON list"):
        cli._request_input(args)


def test_generate_chat_wraps_text():
    args = cli.build_parser().parse_args(["generate", "--chat", "Hello"])
    assert cli._request_input(args) == {"messages": [{"role": "user", "content": "Hello"}]}


def test_unreachable_server_is_reported(capsys):
    assert cli.main(["generate", "--target", "127.0.0.1:1", "--timeout", "5", "hi"]) == 1
    err = capsys.readouterr().err
    assert "UNAVAILABLE" in err and "is `pdserve serve` running at 127.0.0.1:1?" in err


def test_registered_commands_load_only_when_chosen(monkeypatch):
    mod = types.ModuleType("fake_bench_cmd")
    mod.add_arguments = lambda p: p.add_argument("--steps", type=int, default=3)
    mod.run = lambda args: args.steps
    monkeypatch.setitem(sys.modules, "fake_bench_cmd", mod)
    monkeypatch.setattr(cli, "BENCH_COMMANDS", [("toy", "fake_bench_cmd", "a toy benchmark")])
    monkeypatch.setattr(cli, "COMMANDS", [("broken", "no.such.module", "never imported")])
    assert cli.main(["bench", "toy", "--steps", "7"]) == 7
