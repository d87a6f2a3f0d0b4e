"""`pdserve bench engine`: pdserve's engine against Hugging Face generate(), in one run.

Both run the same model directory with the same thread count, one after the other in rounds
(ours, HF, ours, HF, ...), and the medians are reported, so machine noise hits both alike.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from pdserve.bench.common import Table, median_seconds
from pdserve.engine.config import EngineConfig
from pdserve.engine.linear import PackedWeight
from pdserve.engine.memory import describe_peak, peak_memory_bytes
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.models import named_parts
from pdserve.engine.offline import generate
from pdserve.engine.sampling_params import SamplingParams


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 10) -> float:
    """Bytes per second of a large tensor copy (size / time: each byte is read once, written once),
    with torch's current threads (the caller sets the same threads as the engine's)."""
    a = torch.ones(nbytes // 4)
    b = torch.empty_like(a)
    return nbytes / median_seconds(lambda: b.copy_(a), repeats)


def read_bandwidth(nbytes: int = 256 << 20, repeats: int = 10) -> float:
    """Bytes per second of reading a large tensor once (a sum), with torch's current threads.

    A decode step only reads its weights; a copy also writes, so the copy rate (bytes copied per
    second) is below the rate at which memory can be read, and a bound from it is a lenient one.
    This figure is printed next to it for that reason."""
    a = torch.ones(nbytes // 4)
    return nbytes / median_seconds(a.sum, repeats)


def weight_bytes_per_step(runner: ModelRunner) -> int:
    """Bytes of weights a decode step reads: every parameter except the embedding table, which a
    step only gathers rows from (when it is tied to the output head, the head reads it whole). A
    packed weight (``engine.linear``) counts once, as the copy a single-row product reads: its
    4-bit groups where it has them, else its plain float32 copy."""
    seen, total = set(), 0
    m = runner.model
    named = [(name, t) for name, t in named_parts(m) if name not in ("embed", "wte", "wpe", "cos", "sin")]
    for _, t in named:
        if isinstance(t, PackedWeight):
            if id(t) not in seen:
                seen.add(id(t))
                total += t.step_bytes
            continue
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 1, (n,), generator=g).tolist()


def measure(model: str = "default", threads: int = 2, rounds: int = 3, decode_prompt: int = 128,
        new_tokens: int = 64, prefill_lens: tuple[int, ...] = (128, 512)) -> dict:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    runner = ModelRunner(EngineConfig(model=model, threads=threads, show_progress=False))
    hf = AutoModelForCausalLM.from_pretrained(str(runner.model_dir), dtype=torch.float32).eval()
    vocab = runner.vocab_size
    prompt = _prompt(decode_prompt, vocab)
    greedy = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    ids = torch.tensor([prompt])

    def ours_gen(params):
        t = time.perf_counter()
        out = generate(runner, [prompt], params)
        return time.perf_counter() - t, out[0].output_token_ids

    def hf_gen(n):
        t = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - t, out[0, len(prompt):].tolist()

    copy_bw_before, read_bw_before = copy_bandwidth(), read_bandwidth()
    ours_gen(one), hf_gen(1)  # warm up both
    ours_dec, hf_dec = [], []
    same = True
    for _ in range(rounds):
        t1, _ = ours_gen(one)
        tn, toks = ours_gen(greedy)
        ours_dec.append((new_tokens - 1) / (tn - t1))
        h1, _ = hf_gen(1)
        hn, htoks = hf_gen(new_tokens)
        hf_dec.append((new_tokens - 1) / (hn - h1))
        same &= toks == htoks

    prefill = {}
    for n in prefill_lens:
        p = _prompt(n, vocab, seed=n)
        pt = torch.tensor([p])
        o, h = [], []
        for _ in range(rounds):
            t = time.perf_counter()
            generate(runner, [p], one)
            o.append(n / (time.perf_counter() - t))
            t = time.perf_counter()
            with torch.inference_mode():
                hf(pt, use_cache=True)
            h.append(n / (time.perf_counter() - t))
        prefill[n] = (statistics.median(o), statistics.median(h))

    # Measured before and after the runs, same process and threads; the better of the two is the
    # machine's rate (noise from other processes only ever lowers it).
    bws = [copy_bw_before, copy_bandwidth()]
    bw = max(bws)
    rbw = max(read_bw_before, read_bandwidth())
    wbytes = weight_bytes_per_step(runner)
    bound = bw / wbytes
    ours_d, hf_d = statistics.median(ours_dec), statistics.median(hf_dec)
    result = {
        "model": str(runner.model_dir.name),
        "threads": threads,
        "rounds": rounds,
        "decode": {
            "prompt_tokens": decode_prompt,
            "new_tokens": new_tokens,
            "pdserve_tokens_per_s": round(ours_d, 2),
            "hf_tokens_per_s": round(hf_d, 2),
            "ratio": round(ours_d / hf_d, 3),
            "greedy_tokens_identical": same,
        },
        "bandwidth_bound": {
            "copy_bandwidth_gb_per_s": round(bw / 1e9, 2),
            "copy_bandwidth_gb_per_s_runs": [round(x / 1e9, 2) for x in bws],
            "read_bandwidth_gb_per_s": round(rbw / 1e9, 2),
            "read_bound_tokens_per_s": round(rbw / wbytes, 2),
            "pdserve_fraction_of_read_bound": round(ours_d / (rbw / wbytes), 3),
            "weight_bytes_per_step": wbytes,
            "bound_tokens_per_s": round(bound, 2),
            "pdserve_fraction_of_bound": round(ours_d / bound, 3),
        },
        "prefill": {
            str(n): {
                "pdserve_tokens_per_s": round(o, 1),
                "hf_tokens_per_s": round(h, 1),
                "ratio": round(o / h, 3),
            }
            for n, (o, h) in prefill.items()
        },
        # One process runs both engines: its peak holds pdserve's weights and KV pool and HF's model.
        "peak_memory": {"device": runner.device.type, "bytes": peak_memory_bytes(runner.device)},
    }
    return result


def format_table(r: dict) -> str:
    d, b = r["decode"], r["bandwidth_bound"]
    table = Table([34, 12, 12, 9])
    lines = [
        f"model {r['model']}, {r['threads']} threads, median of {r['rounds']} rounds",
        table.row("measure", "pdserve", "HF", "ratio"),
        table.row(f"decode tok/s (prompt {d['prompt_tokens']}, {d['new_tokens']} new)",
                  f"{d['pdserve_tokens_per_s']:.2f}", f"{d['hf_tokens_per_s']:.2f}", f"{d['ratio']:.3f}"),
    ]
    for n, p in r["prefill"].items():
        lines.append(table.row(f"prefill tok/s ({n} tokens)", f"{p['pdserve_tokens_per_s']:.1f}",
                               f"{p['hf_tokens_per_s']:.1f}", f"{p['ratio']:.3f}"))
    lines.append(
        f"bandwidth bound: {b['weight_bytes_per_step'] / 1e6:.0f} MB of weights per step / "
        f"{b['copy_bandwidth_gb_per_s']:.2f} GB/s copy = {b['bound_tokens_per_s']:.2f} tok/s; "
        f"pdserve decode at {100 * b['pdserve_fraction_of_bound']:.1f}% of it"
    )
    lines.append(
        f"(read-only rate, a stricter bound: {b['read_bandwidth_gb_per_s']:.2f} GB/s sum = "
        f"{b['read_bound_tokens_per_s']:.2f} tok/s; pdserve at {100 * b['pdserve_fraction_of_read_bound']:.1f}%)"
    )
    lines.append(f"greedy tokens identical to HF: {d['greedy_tokens_identical']}")
    if "peak_memory" in r:
        m = r["peak_memory"]
        lines.append(f"peak memory of this process (pdserve engine and HF model together): "
                     f"{describe_peak(m['bytes'], m['device'])}")
    return "\n".join(lines)


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="default", help="model to measure (default: the embedded default)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for both engines (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="measurement rounds; medians are reported (default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args) -> int:
    r = measure(model=args.model, threads=args.threads, rounds=args.rounds)
    print(json.dumps(r, indent=2) if args.json else format_table(r))
    return 0
