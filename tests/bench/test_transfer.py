"""`pdserve bench transfer --quick` runs end to end through the CLI (a smoke test of the benchmark,
not a speed check): every transport (and, beside each, its library alone: the bare grpcio stream and
the bare gloo sends) gets a row per prompt size next to the raw TCP copy, and the
TTFT rows compare colocated and disaggregated on the same prompts. It runs in this process, on the
session's Ray, to spare a second Ray start (the command starts its own when none is running)."""

from __future__ import annotations

import json

from pdserve.bench.transfer import BARE_GLOO, BARE_GRPC
from pdserve.cli import main
from pdserve.kv_transfer import TRANSPORTS


def test_bench_transfer_quick_prints_every_field(ray_cluster, tiny_llama, capsys):
    code = main(["bench", "transfer", "--quick", "--json", "--model", str(tiny_llama), "--threads", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    r = json.loads(out)
    assert r["bench"] == "transfer" and r["quick"] is True and r["rounds"] == 2
    assert r["date"] and r["machine"] and r["model"] == tiny_llama.name
    g = r["kv_geometry"]
    assert (g["num_layers"], g["num_kv_heads"], g["head_dim"], g["block_size"]) == (2, 2, 16, 16)
    assert g["bytes_per_token"] == 2 * 2 * 2 * 16 * 4

    sizes = [32, 64]
    rows = {(row["transport"], row["prompt_tokens"]): row for row in r["transfer"]}
    # Every transport, and each one's ceiling (its library alone), per prompt size.
    assert set(rows) == {(t, n) for t in [*TRANSPORTS, BARE_GRPC, BARE_GLOO] for n in sizes}
    for (_, n), row in rows.items():
        assert row["bytes"] == -(-n // 16) * 16 * g["bytes_per_token"]
        assert row["pieces"] >= 1 and row["median_s"] > 0
        assert row["mb_per_s"] > 0 and row["raw_tcp_mb_per_s"] > 0
        # The ratio is of the unrounded rates, and both rates are rounded to 0.1 MB/s, a large part
        # of a slow tiny push: the tolerance is what that rounding can make of their quotient.
        printed = row["mb_per_s"] / row["raw_tcp_mb_per_s"]
        rounding = 1.1 * printed * (0.05 / row["mb_per_s"] + 0.05 / row["raw_tcp_mb_per_s"]) + 5e-4
        assert abs(row["ratio_to_raw_tcp"] - printed) <= rounding
        assert row["warmup_pushes"] >= 1  # at least one untimed push, for at least warmup_s
    assert r["warmup_s"] == 0.1

    assert [row["prompt_tokens"] for row in r["ttft"]] == sizes
    for row in r["ttft"]:
        assert row["prompts"] == 2 and row["colocated_s"] > 0 and row["disaggregated_s"] > 0
        assert row["kv_stream_s"] > 0
        expected = 100 * (row["disaggregated_s"] - row["colocated_s"]) / row["colocated_s"]
        assert abs(row["overhead_pct"] - expected) < 1.0
        # The paired overhead is the median of each prompt's own overhead (its two runs back to back).
        c, d = row["colocated_each_s"], row["disaggregated_each_s"]
        assert len(c) == len(d) == 2
        each = sorted(100 * (y - x) / x for x, y in zip(c, d))
        assert abs(row["paired_overhead_pct"] - (each[0] + each[1]) / 2) < 0.1
    # Each worker actor's peak memory: its process's peak RSS on CPU (torch alone is > 100 MB).
    assert {role: m["device"] for role, m in r["peak_memory"].items()} == dict.fromkeys(
        ("colocated", "decode", "prefill"), "cpu")
    assert all(m["bytes"] > 100e6 for m in r["peak_memory"].values())


def test_bench_transfer_is_registered_in_the_cli():
    from pdserve.cli import BENCH_COMMANDS

    assert ("transfer", "pdserve.bench.transfer") in [(n, m) for n, m, _ in BENCH_COMMANDS]


def test_each_ceiling_row_only_beside_its_transport(ray_cluster):
    """bare-grpcio is the gRPC transport's ceiling and bare-gloo the collective one's: a run of one
    transport has its own ceiling row and not the other's, and every row moved the same bytes."""
    import ray

    from pdserve.bench.transfer import measure_transfer

    geo = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "block_size": 16, "dtype": "float32"}
    for transport, ceiling in (("collective", BARE_GLOO), ("grpc", BARE_GRPC)):
        rows = measure_transfer(ray, geo, [32, 64], [transport], rounds=1, frame_bytes=1 << 20, warmup_s=0.0)
        assert [(r["transport"], r["prompt_tokens"]) for r in rows] == [
            (transport, 32), (ceiling, 32), (transport, 64), (ceiling, 64)]
        for n in (32, 64):
            assert len({r["bytes"] for r in rows if r["prompt_tokens"] == n}) == 1
