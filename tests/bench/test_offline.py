"""`pdserve bench offline --quick` runs end to end on a tiny model (a smoke test, not a measurement)."""

from __future__ import annotations

import json

from pdserve.cli import main


def test_bench_offline_quick_reports_every_figure(ray_cluster, tiny_llama, one_thread, capsys):
    code = main(["bench", "offline", "--quick", "--json", "--model", str(tiny_llama), "--threads", "1",
                 "--num-requests", "6", "--seed", "3"])
    assert code == 0
    r = json.loads(capsys.readouterr().out)
    w = r["workload"]
    assert w["num_requests"] == 6 and w["seed"] == 3 and r["threads"] == 1
    for side in ("pdserve", "hf"):
        assert r[side]["wall_s"] > 0
        assert r[side]["output_tokens_per_s"] > 0
        assert r[side]["total_tokens_per_s"] > r[side]["output_tokens_per_s"]
    assert r["ratio"]["output_tokens_per_s"] > 0 and r["ratio"]["total_tokens_per_s"] > 0
    o = r["pdserve"]
    assert o["prefill"]["tokens"] == w["prompt_tokens"]  # no preemption: the pool holds the workload
    assert o["num_preemptions"] == 0
    for phase in ("prefill", "decode"):
        assert o[phase]["tokens_per_s"] > 0
        assert o[phase]["fraction_of_compute_bound"] > 0
    assert 0 < o["next_outputs_calls"] <= o["num_steps"]
    # the offline token budget unless one is given (the server's default is smaller)
    from pdserve.bench.offline import OFFLINE_MAX_NUM_BATCHED_TOKENS
    from pdserve.decode_worker.scheduler import SchedulerConfig
    assert o["max_num_batched_tokens"] == OFFLINE_MAX_NUM_BATCHED_TOKENS > SchedulerConfig().max_num_batched_tokens
    b = r["compute_bound"]
    assert b["matmul_gflops_per_s"] == max(b["matmul_gflops_per_s_by_library"].values()) > 0
    assert "torch.matmul" in b["matmul_gflops_per_s_by_library"] and len(b["matmul_gflops_per_s_runs"]) == 2
    assert b["decode_flops_per_token"] > b["prefill_flops_per_token"] > 0
    # HF runs every row of a batch to the batch's longest output; only each request's own count
    assert r["hf"]["generated_tokens"] >= w["output_tokens"]
    assert r["outputs_identical_to_hf"] == 6  # the tiny model's argmax is stable, even padded
    assert ray_cluster.is_initialized()  # it used the running Ray and left it running
    # Peak memory: the pdserve actor's process and this (HF) process, peak RSS (torch alone is > 100 MB).
    assert o["device"] == "cpu" and o["peak_memory_bytes"] > 100e6 and r["hf"]["peak_memory_bytes"] > 100e6
