"""`pdserve loadtest run` against a scripted server on a real socket (one mode in the report),
and the errors for bad input (nothing starts, exit status 2)."""

from __future__ import annotations

import json
import time
from concurrent import futures

import grpc
import pytest

from pdserve.cli import main
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc


class EchoServer(pb_grpc.GenerationServicer):
    """Streams max_tokens tokens, 5 ms apart; says it is a disaggregated server."""

    def Generate(self, request, context):
        for i in range(request.sampling.max_tokens):
            time.sleep(0.005)
            yield pb.GenerateResponse(token_ids=[i % 50], text="x")
        yield pb.GenerateResponse(
            finish_reason=pb.FINISH_REASON_LENGTH,
            usage=pb.Usage(prompt_tokens=len(request.token_ids.ids), completion_tokens=request.sampling.max_tokens),
            timings=pb.Timings(prefill_s=0.001, transfer_s=0.002, decode_s=0.01, e2e_s=0.02))

    def GetServerInfo(self, request, context):
        return pb.ServerInfo(model="echo", max_model_len=4096, mode="disaggregated", num_prefill_workers=1,
                             num_decode_workers=1, transport="grpc", vocab_size=50, version="test")


@pytest.fixture
def echo_target():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    pb_grpc.add_GenerationServicer_to_server(EchoServer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


def test_run_against_a_server_writes_a_one_mode_report(echo_target, tmp_path, capsys):
    out = tmp_path / "r"
    rc = main(["loadtest", "run", "--target", echo_target, "--workload", "uniform", "-n", "8",
               "--prompt-tokens", "5:9", "--output-tokens", "3", "--arrival", "gamma", "--burstiness", "0.5",
               "--rates", "50,100", "--slo-ttft-ms", "1000", "--out", str(out), "--no-progress", "--warmup", "0"])
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    (mode,) = data["modes"].values()
    assert mode["server"]["mode"] == "disaggregated" and len(mode["runs"]) == 2
    assert all(r["output_tokens"] == 3 and 5 <= r["prompt_tokens"] <= 9 for run in mode["runs"] for r in run["requests"])
    printed = capsys.readouterr().out
    assert "gamma (burstiness 0.5) at 50, 100 req/s" in printed and "TTFT <= 1000 ms" in printed
    assert (out / "latency_cdf.png").exists() and (out / "vs_rate.png").exists()

    # `report` recomputes the same statistics from the file, and others under another SLO.
    again = tmp_path / "again"
    assert main(["loadtest", "report", str(out), "--slo-ttft-ms", "1000", "--out", str(again)]) == 0
    redone = json.loads((again / "results.json").read_text())
    (mode2,) = redone["modes"].values()
    assert [run["stats"] for run in mode2["runs"]] == [run["stats"] for run in mode["runs"]]
    assert "recomputed" in redone["meta"] and redone["meta"]["command"] == data["meta"]["command"]
    assert main(["loadtest", "report", str(out / "results.json"), "--slo-ttft-ms", "0.001"]) == 0
    strict = json.loads((out / "results.json").read_text())  # written back next to the results read
    assert all(run["stats"]["goodput"] == 0 for m in strict["modes"].values() for run in m["runs"])
    assert all(run["stats"]["goodput"] > 0 for run in mode["runs"])
    assert exit_status(["loadtest", "report", str(tmp_path / "nothing")]) == 2
    (tmp_path / "bad.json").write_text("{}")
    assert exit_status(["loadtest", "report", str(tmp_path / "bad.json")]) == 2
    assert "is not the results.json of a pdserve load test" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--prompt-tokens", "9:3"], "low <= high"),
    (["--rates", "1,-2"], "rates must be numbers > 0"),
    (["--long-share", "1.5"], "--long-share must be in [0, 1]"),
    (["--workload", "trace"], "needs --trace"),
    (["--workload", "fixed", "--prompt-tokens", "4:8"], "--workload uniform for ranges"),
    (["--slo-itl-ms", "0"], "--slo-itl-ms must be > 0"),
    (["--arrival", "gamma", "--burstiness", "0"], "--burstiness must be > 0"),
])
def test_bad_input_stops_before_anything_starts(argv, message, capsys):
    assert exit_status(["loadtest", "run", "--target", "127.0.0.1:1", "--no-progress", *argv]) == 2
    assert message in capsys.readouterr().err


def exit_status(argv) -> int:
    """``main``'s exit status, also when argparse rejects a flag (it raises SystemExit)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def test_compare_rejects_unknown_modes(capsys):
    assert main(["loadtest", "compare", "--modes", "colocated,both"]) == 2
    assert "--modes takes colocated and/or disaggregated" in capsys.readouterr().err
