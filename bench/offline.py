"""`pdserve bench offline`: continuous batching in one decode actor against HF static batches.

The workload: ``--num-requests`` requests (64), prompt lengths uniform in [32, 512] (random token
ids), output lengths uniform in [16, 256], greedy, EOS ignored, all seeded. Both sides run it in
one process tree, one after the other, on the same model with the same thread count:

- pdserve: ONE colocated worker actor (``start_workers``), driven as the router drives it: every
  request through ``add_request``, all outputs through ``next_outputs`` long polls. The KV pool is
  sized to hold the whole workload (``--kv-memory`` overrides), so the figures measure batching,
  not memory pressure (preemptions are reported). The scheduler runs with an offline token budget,
  ``OFFLINE_MAX_NUM_BATCHED_TOKENS`` (2048) tokens a step, as vLLM gives its offline ``LLM`` class a
  larger budget than its server: nobody is waiting on a stream, so larger prefill chunks (better
  matrix shapes, fewer steps) are worth their longer steps. The worker's own default (512, used
  by ``pdserve serve``) keeps inter-token latency down instead; ``--max-num-batched-tokens``
  overrides.
- Hugging Face ``generate()``: static batches of ``--hf-batch-size`` (16) in arrival order, left
  padded, each run to the longest output of its batch (``max_new_tokens`` = the batch's longest
  output, as a naive user would); only each request's own output tokens count as useful.

Reported: wall time, output and total (prompt + output) tokens/s of each, their ratio, and for
pdserve the prefill and decode rates from the engine's step counters, each as a fraction of the
machine's compute bound: 2 x the parameters a token goes through, in FLOPs, over the rate of a
large float32 matrix multiply measured here with the same threads, by the fastest library torch
has for it (``torch.matmul``, oneDNN; the best of one measurement
before and one after the runs).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch

from pdserve.bench.common import Table, local_ray, machine, max_positions, median_seconds, now
from pdserve.cli import parse_size
from pdserve.engine.memory import describe_peak, peak_memory_bytes

OFFLINE_MAX_NUM_BATCHED_TOKENS = 2048  # the scheduler's token budget for this offline run (see above)
QUICK = dict(num_requests=8, prompt_len=(16, 64), output_len=(8, 32), hf_batch_size=4, matmul_size=1024)
FULL = dict(num_requests=64, prompt_len=(32, 512), output_len=(16, 256), hf_batch_size=16, matmul_size=2048)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (__doc__ or "").split("\n\n")[0]
    p.add_argument("--model", default="default", metavar="PATH",
                   help="'default' (SmolLM2-135M-Instruct), a Hugging Face model directory or a .gguf file")
    p.add_argument("--threads", type=int, default=2, help="torch threads, for both sides (default 2)")
    p.add_argument("--num-requests", type=int, default=None, metavar="N", help="requests (default 64; 8 with --quick)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--hf-batch-size", type=int, default=None, metavar="N",
                   help="static batch size of the HF baseline (default 16; 4 with --quick)")
    p.add_argument("--max-num-seqs", type=int, default=None, metavar="N",
                   help="scheduler: most sequences per step (default: the worker's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help=f"scheduler: token budget per step (default {OFFLINE_MAX_NUM_BATCHED_TOKENS}, an offline "
                        "budget; `pdserve serve` uses the worker's 512)")
    p.add_argument("--kv-memory", type=parse_size, default=None, metavar="SIZE",
                   help="KV pool size, e.g. 1GiB (default: exactly what the workload needs)")
    p.add_argument("--quick", action="store_true",
                   help="a few short requests: a smoke test of the benchmark itself, not a measurement")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    result = run_bench(
        model=args.model, threads=args.threads, num_requests=args.num_requests, seed=args.seed,
        hf_batch_size=args.hf_batch_size, quick=args.quick, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, kv_memory=args.kv_memory,
    )
    print(json.dumps(result, indent=2) if args.json else format_table(result), flush=True)
    return 0


# ---- workload ----------------------------------------------------------------------------------


def make_workload(num_requests: int, vocab_size: int, seed: int, prompt_len: tuple[int, int],
                  output_len: tuple[int, int]) -> list[tuple[list[int], int]]:
    """``(prompt token ids, output length)`` per request; ids avoid the first few (special) ids."""
    rng = random.Random(seed)
    low = min(100, vocab_size // 4)
    work = []
    for _ in range(num_requests):
        n = rng.randint(*prompt_len)
        work.append(([rng.randrange(low, vocab_size) for _ in range(n)], rng.randint(*output_len)))
    return work


def matmul_rates(n: int, repeats: int = 5) -> dict[str, float]:
    """FLOP/s of an ``n x n @ n x n`` float32 matmul with torch's current threads (median), by each
    library torch can run it with here: ``torch.matmul`` (torch's BLAS: MKL in the PyPI wheels), and
    oneDNN's packed product when torch has it (what the engine multiplies with, ``engine/linear.py``).
    The machine's compute bound is the best of them: a library that leaves the CPU's vector units
    half idle (MKL on AMD CPUs) does not set it."""
    from pdserve.engine import linear

    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    rates = {"torch.matmul": 2 * n**3 / median_seconds(lambda: torch.matmul(a, b, out=out), repeats)}
    if linear._onednn_ok():
        packed = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous(), n)
        rates["oneDNN"] = 2 * n**3 / median_seconds(
            lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""), repeats)
    return rates


def flops_per_token(hf_model) -> tuple[int, int, int]:
    """``(parameters, prefill FLOPs/token, decode FLOPs/token)``: 2 x the weights a token is
    multiplied with. A prompt token goes through every layer; a decoded token also through the
    output head (a prompt's logits are computed for its last token only). The embedding lookup and
    attention over the context are not counted."""
    seen, total = set(), 0
    for p in hf_model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel()
    embed = hf_model.get_input_embeddings().weight
    head = hf_model.get_output_embeddings().weight
    body = total - embed.numel() - (head.numel() if head.data_ptr() != embed.data_ptr() else 0)
    return total, 2 * body, 2 * (body + head.numel())


# ---- pdserve -----------------------------------------------------------------------------------


def run_pdserve(model: str, threads: int, work: list[tuple[list[int], int]], num_blocks: int | None,
                kv_bytes: int | None, max_num_seqs: int | None, max_num_batched_tokens: int | None) -> dict:
    import ray

    from pdserve.decode_worker.messages import WorkerRequest
    from pdserve.decode_worker.scheduler import SchedulerConfig
    from pdserve.decode_worker.worker import WorkerConfig, start_workers
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.sampling_params import SamplingParams

    engine = EngineConfig(model=model, threads=threads, num_blocks=num_blocks, show_progress=False)
    if kv_bytes is not None:
        engine.kv_cache_bytes = kv_bytes
    sched = SchedulerConfig()
    if max_num_seqs:
        sched.max_num_seqs = max_num_seqs
    sched.max_num_batched_tokens = max_num_batched_tokens or OFFLINE_MAX_NUM_BATCHED_TOKENS
    (worker,) = start_workers(WorkerConfig(engine=engine, scheduler=sched), num_workers=1, num_cpus=1,
                              name_prefix=f"pdserve-bench-offline-{os.getpid()}")
    try:
        info = ray.get(worker.model_info.remote())

        def drive(requests: list[WorkerRequest]) -> tuple[dict[str, list[int]], int]:
            ray.get([worker.add_request.remote(r) for r in requests])
            outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
            left, calls = set(outputs), 0
            while left:
                deltas = ray.get(worker.next_outputs.remote(1.0))
                calls += bool(deltas)
                for d in deltas:
                    if d.error:
                        raise RuntimeError(f"request {d.request_id} failed: {d.error}")
                    outputs[d.request_id].extend(d.token_ids)
                    if d.finish_reason is not None:
                        left.discard(d.request_id)
            return outputs, calls

        def requests(tag: str, items) -> list[WorkerRequest]:
            now = time.time()
            return [WorkerRequest(f"{tag}-{i}", p, SamplingParams(max_tokens=n, ignore_eos=True), now)
                    for i, (p, n) in enumerate(items)]

        drive(requests("warmup", [(work[0][0][:16], 4)]))  # first-call costs out of the timing
        before = ray.get(worker.counters.remote())
        start = time.perf_counter()
        outputs, calls = drive(requests("r", work))
        wall = time.perf_counter() - start
        after = ray.get(worker.counters.remote())
        stats = ray.get(worker.stats.remote())
    finally:
        ray.kill(worker)
    delta = {k: getattr(after, k) - getattr(before, k) for k in vars(after)}
    return {"wall_s": wall, "outputs": [outputs[f"r-{i}"] for i in range(len(work))],
            "next_outputs_calls": calls, "counters": delta, "num_blocks": info["num_blocks"],
            "block_size": info["block_size"], "scheduler": vars(sched),
            "peak_memory_bytes": stats.peak_memory_bytes, "device": stats.device}


# ---- Hugging Face --------------------------------------------------------------------------------


def run_hf(hf_model, work: list[tuple[list[int], int]], batch_size: int, pad_id: int) -> dict:
    """Static batches, left padded, each to its longest output; EOS off (every row runs to the end)."""
    hf_model.generation_config.eos_token_id = None

    def generate(batch):
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (p, _) in enumerate(batch):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        new = max(n for _, n in batch)
        with torch.inference_mode():
            out = hf_model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                                    pad_token_id=pad_id)
        return [out[i, width:width + n].tolist() for i, (_, n) in enumerate(batch)], len(batch) * new

    generate([(work[0][0][:16], 4)])  # warm up
    outputs, generated = [], 0
    start = time.perf_counter()
    for b in range(0, len(work), batch_size):
        outs, gen = generate(work[b:b + batch_size])
        outputs.extend(outs)
        generated += gen
    return {"wall_s": time.perf_counter() - start, "outputs": outputs, "generated_tokens": generated}


# ---- the run -------------------------------------------------------------------------------------


def run_bench(model: str = "default", threads: int = 2, num_requests: int | None = None, seed: int = 0,
              hf_batch_size: int | None = None, quick: bool = False, max_num_seqs: int | None = None,
              max_num_batched_tokens: int | None = None, kv_memory: int | None = None) -> dict:
    """Run both sides on one workload and return every figure; ``kv_memory``: the KV pool's bytes
    (default: exactly what the workload needs)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from pdserve.engine.model_loader import load_config, resolve_model_dir

    hf_logging.set_verbosity_error()
    shape = QUICK if quick else FULL
    num_requests = num_requests or shape["num_requests"]
    hf_batch_size = hf_batch_size or shape["hf_batch_size"]
    torch.set_num_threads(threads)
    model_dir = resolve_model_dir(model)
    cfg = load_config(model_dir)
    work = make_workload(num_requests, cfg.vocab_size, seed, shape["prompt_len"], shape["output_len"])
    limit = max_positions(cfg)
    if limit and shape["prompt_len"][1] + shape["output_len"][1] > limit:
        raise SystemExit(f"pdserve: error: the workload needs {shape['prompt_len'][1] + shape['output_len'][1]} "
                         f"positions; the model has {limit}")

    kv_bytes, num_blocks = kv_memory, None
    block_size = 16
    if kv_memory is None:  # the whole workload at once: no request ever waits for memory
        num_blocks = sum(-(-(len(p) + n) // block_size) for p, n in work)

    rates = [matmul_rates(shape["matmul_size"])]  # again at the end: the bound is the best rate
    with local_ray(num_cpus=max(2, threads)):
        ours = run_pdserve(str(model_dir), threads, work, num_blocks, kv_bytes, max_num_seqs,
                           max_num_batched_tokens)

    hf_model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    pad = cfg.pad_token_id if getattr(cfg, "pad_token_id", None) is not None else 0
    theirs = run_hf(hf_model, work, hf_batch_size, pad)
    hf_peak = peak_memory_bytes("cpu")  # this process: HF's model and batches (pdserve ran in its actor)
    params, prefill_flops, decode_flops = flops_per_token(hf_model)
    del hf_model
    rates.append(matmul_rates(shape["matmul_size"]))
    rate = max(max(r.values()) for r in rates)
    best_by_library = {lib: max(r[lib] for r in rates) for lib in rates[0]}

    prompt_tokens = sum(len(p) for p, _ in work)
    output_tokens = sum(n for _, n in work)
    c = ours["counters"]
    prefill_rate = c["prefill_tokens"] / c["prefill_step_s"] if c["prefill_step_s"] else 0.0
    pure_decode = c["decode_tokens"] - c["decode_tokens_in_prefill_steps"]
    decode_rate = pure_decode / c["decode_step_s"] if c["decode_step_s"] else 0.0

    def side(r: dict) -> dict:
        return {"wall_s": round(r["wall_s"], 3),
                "output_tokens_per_s": round(output_tokens / r["wall_s"], 2),
                "total_tokens_per_s": round((prompt_tokens + output_tokens) / r["wall_s"], 2)}

    identical = sum(a == b for a, b in zip(ours["outputs"], theirs["outputs"]))
    return {
        "benchmark": "offline",
        "date": now(),
        "machine": machine(),
        "model": model if model != str(model_dir) else model_dir.name,
        "threads": threads,
        "quick": quick,
        "workload": {
            "num_requests": num_requests, "seed": seed,
            "prompt_len_range": list(shape["prompt_len"]), "output_len_range": list(shape["output_len"]),
            "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        },
        "pdserve": {
            **side(ours),
            "num_steps": c["num_steps"],
            "num_preemptions": c["num_preemptions"],
            "next_outputs_calls": ours["next_outputs_calls"],
            "kv_blocks": ours["num_blocks"], "block_size": ours["block_size"],
            "max_num_seqs": ours["scheduler"]["max_num_seqs"],
            "max_num_batched_tokens": ours["scheduler"]["max_num_batched_tokens"],
            "peak_memory_bytes": ours["peak_memory_bytes"], "device": ours["device"],
            "prefill": {
                "tokens": c["prefill_tokens"],
                "step_seconds": round(c["prefill_step_s"], 3),
                "decode_tokens_in_these_steps": c["decode_tokens_in_prefill_steps"],
                "tokens_per_s": round(prefill_rate, 1),
                "fraction_of_compute_bound": _significant(prefill_rate * prefill_flops / rate),
            },
            "decode": {
                "tokens": pure_decode,
                "step_seconds": round(c["decode_step_s"], 3),
                "tokens_per_s": round(decode_rate, 1),
                "fraction_of_compute_bound": _significant(decode_rate * decode_flops / rate),
            },
        },
        "hf": {**side(theirs), "batch_size": hf_batch_size, "generated_tokens": theirs["generated_tokens"],
               "peak_memory_bytes": hf_peak},
        "ratio": {
            "output_tokens_per_s": round(theirs["wall_s"] / ours["wall_s"], 3),
            "total_tokens_per_s": round(theirs["wall_s"] / ours["wall_s"], 3),
        },
        "compute_bound": {
            "matmul_size": shape["matmul_size"],
            "matmul_gflops_per_s": round(rate / 1e9, 2),
            "matmul_gflops_per_s_by_library": {lib: round(x / 1e9, 2) for lib, x in best_by_library.items()},
            "matmul_gflops_per_s_runs": [{lib: round(x / 1e9, 2) for lib, x in r.items()} for r in rates],
            "parameters": params,
            "prefill_flops_per_token": prefill_flops,
            "decode_flops_per_token": decode_flops,
            "prefill_tokens_per_s": round(rate / prefill_flops, 1),
            "decode_tokens_per_s": round(rate / decode_flops, 1),
        },
        "outputs_identical_to_hf": identical,
    }


def format_table(r: dict) -> str:
    w, o, h, b = r["workload"], r["pdserve"], r["hf"], r["compute_bound"]
    table = Table([38, 9, 14, 13])
    lines = [
        f"pdserve bench offline{' --quick' if r['quick'] else ''}: {r['date']}, {r['machine']}",
        f"model {r['model']}, {r['threads']} threads; {w['num_requests']} requests (seed {w['seed']}), "
        f"prompts {w['prompt_len_range'][0]}-{w['prompt_len_range'][1]} tokens ({w['prompt_tokens']} in all), "
        f"outputs {w['output_len_range'][0]}-{w['output_len_range'][1]} ({w['output_tokens']}), greedy, EOS ignored",
        "",
        table.row("", "wall s", "output tok/s", "total tok/s"),
        table.row("pdserve, 1 colocated actor", f"{o['wall_s']:.2f}", f"{o['output_tokens_per_s']:.1f}",
                  f"{o['total_tokens_per_s']:.1f}"),
        table.row(f"HF generate, static batches of {h['batch_size']}", f"{h['wall_s']:.2f}",
                  f"{h['output_tokens_per_s']:.1f}", f"{h['total_tokens_per_s']:.1f}"),
        table.row("ratio (pdserve / HF)", "", f"{r['ratio']['output_tokens_per_s']:.2f}",
                  f"{r['ratio']['total_tokens_per_s']:.2f}"),
        "",
        f"compute bound: {b['matmul_gflops_per_s']:.1f} GFLOP/s (the best {b['matmul_size']}^3 float32 matmul: "
        + ", ".join(f"{lib} {x:.1f}" for lib, x in b["matmul_gflops_per_s_by_library"].items()) + "); "
        f"{b['parameters'] / 1e6:.1f} M parameters -> {b['prefill_tokens_per_s']:.0f} prefill / "
        f"{b['decode_tokens_per_s']:.0f} decode tok/s",
        f"pdserve prefill: {o['prefill']['tokens']} tokens in {o['prefill']['step_seconds']:.2f} s of steps "
        f"with prefill = {o['prefill']['tokens_per_s']:.0f} tok/s, "
        f"{100 * o['prefill']['fraction_of_compute_bound']:.1f}% of the bound",
        f"pdserve decode:  {o['decode']['tokens']} tokens in {o['decode']['step_seconds']:.2f} s of decode-only "
        f"steps = {o['decode']['tokens_per_s']:.0f} tok/s, "
        f"{100 * o['decode']['fraction_of_compute_bound']:.1f}% of the bound",
        f"pdserve: {o['num_steps']} steps (at most {o['max_num_seqs']} sequences and "
        f"{o['max_num_batched_tokens']} tokens each), {o['next_outputs_calls']} next_outputs answers, "
        f"{o['num_preemptions']} preemptions, {o['kv_blocks']} KV blocks of {o['block_size']}; "
        f"HF computed {h['generated_tokens']} output tokens for {w['output_tokens']} useful",
        f"outputs identical to HF's: {r['outputs_identical_to_hf']} of {w['num_requests']} requests "
        "(padded batches can differ from unpadded ones by float rounding)",
    ]
    if "peak_memory_bytes" in o:
        lines.append(f"peak memory: pdserve actor {describe_peak(o['peak_memory_bytes'], o['device'])}, "
                     f"HF process {describe_peak(h['peak_memory_bytes'])}")
    return "\n".join(lines)


def _significant(x: float, digits: int = 4) -> float:
    """``x`` to ``digits`` significant digits: a tiny test model's fraction of the bound (1e-5)
    must not round to 0."""
    return float(f"{x:.{digits}g}")
