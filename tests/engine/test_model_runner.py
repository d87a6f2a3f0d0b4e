"""ModelRunner as the workers use it: KV moved between runners, prefix sharing with copy on
write, context limits, and the errors a scheduler bug would hit."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.block_allocator import BlockTable
from pdserve.engine.model_runner import BatchItem
from pdserve.engine.offline import generate
from pdserve.engine.sampling_params import SamplingParams

ATOL = 1e-4


def table_for(runner, num_tokens: int) -> BlockTable:
    t = BlockTable(runner.block_size)
    t.reserve(runner.allocator, num_tokens)
    t.num_tokens = num_tokens
    return t


def greedy_decode(runner, table: BlockTable, first_token: int, pos: int, steps: int) -> list[int]:
    out, tok = [], first_token
    for _ in range(steps):
        runner.kv.copy_blocks(table.reserve(runner.allocator, pos + 1))
        table.num_tokens = pos + 1
        (logits,) = runner.execute([BatchItem([tok], pos, table.blocks)])
        tok = int(logits.argmax())
        out.append(tok)
        pos += 1
    return out


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_kv_exported_from_a_prefill_runner_continues_on_a_decode_runner(kind, tiny_model, random_prompts):
    """The disaggregated path at engine level: prefill on one runner, ship the blocks (layer by
    layer), decode on another into different block ids; tokens equal decoding in place."""
    tiny = tiny_model(kind)
    prefill_runner, decode_runner = tiny.runner(block_size=4), tiny.runner(block_size=4)
    prompt = random_prompts([23], seed=30)[0]
    n = len(prompt)
    decode_runner.allocator.allocate(5)  # so the decode side's block ids differ from the prefill's
    src = table_for(prefill_runner, n)
    (logits,) = prefill_runner.execute([BatchItem(prompt, 0, src.blocks)])
    first = int(logits.argmax())
    dst = table_for(decode_runner, n)
    assert dst.blocks != src.blocks
    for layer in range(prefill_runner.kv.num_layers):
        r = range(layer, layer + 1)
        decode_runner.kv.import_blocks(dst.blocks, r, prefill_runner.kv.export_blocks(src.blocks, r))
    shipped = greedy_decode(decode_runner, dst, first, n, 10)
    in_place = greedy_decode(prefill_runner, src, first, n, 10)
    assert shipped == in_place
    expected = generate(tiny.runner(), [prompt], SamplingParams(max_tokens=11, ignore_eos=True))[0]
    assert [first] + shipped == expected.output_token_ids


def test_forked_sequences_share_a_prefix_and_copy_on_write(tiny_model, random_prompts):
    """Two continuations of one prompt share its blocks; the shared partial block is copied
    before either writes, so each continuation equals the same sequence run on its own."""
    tiny = tiny_model("llama")
    runner = tiny.runner(num_blocks=64, block_size=4)
    prompt = random_prompts([10], seed=31)[0]  # 2.5 blocks: the last one is partial
    a = table_for(runner, len(prompt))
    runner.execute([BatchItem(prompt, 0, a.blocks, sample=False)])
    b = a.fork(runner.allocator)
    free_before = runner.allocator.num_free
    xa, xb = random_prompts([2], seed=32)[0]
    cont_a = greedy_decode(runner, a, xa, len(prompt), 8)
    cont_b = greedy_decode(runner, b, xb, len(prompt), 8)
    assert runner.allocator.num_free < free_before  # the copy and the new blocks
    assert a.blocks[:2] == b.blocks[:2] and a.blocks[2] != b.blocks[2]  # full blocks still shared
    fresh = tiny.runner(num_blocks=64, block_size=4)
    for x, cont in ((xa, cont_a), (xb, cont_b)):
        t = table_for(fresh, len(prompt))
        fresh.execute([BatchItem(prompt, 0, t.blocks, sample=False)])
        assert greedy_decode(fresh, t, x, len(prompt), 8) == cont
    a.release(runner.allocator)
    b.release(runner.allocator)
    assert runner.allocator.num_free == runner.allocator.num_blocks


def test_generation_stops_at_max_model_len(tiny_model, random_prompts):
    runner = tiny_model("llama").runner(max_model_len=20)
    assert runner.max_model_len == 20
    seqs = generate(runner, random_prompts([5, 15, 19], seed=33), SamplingParams(max_tokens=50, ignore_eos=True))
    assert [len(s.token_ids) for s in seqs] == [20, 20, 20]
    assert all(s.finish_reason == "length" for s in seqs)


def test_max_model_len_is_capped_by_the_model(tiny_model):
    assert tiny_model("llama").runner(max_model_len=10**6).max_model_len == 256
    assert tiny_model("gpt2").runner().max_model_len == 256  # n_positions


def test_execute_rejects_a_block_table_too_small(tiny_model):
    runner = tiny_model("llama").runner(block_size=4)
    t = table_for(runner, 4)
    with pytest.raises(ValueError, match="cannot hold 5 tokens"):
        runner.execute([BatchItem([3, 4, 5, 6, 7], 0, t.blocks)])


def test_execute_rejects_positions_past_the_context(tiny_model):
    runner = tiny_model("llama").runner(block_size=4, max_model_len=8)
    t = table_for(runner, 8)
    with pytest.raises(ValueError, match="past the model's context of 8"):
        runner.execute([BatchItem([3, 4], 7, t.blocks)])


def test_kv_pool_sized_from_bytes(tiny_model):
    tiny = tiny_model("llama")
    runner = tiny.runner(num_blocks=None, block_size=4, kv_cache_bytes=1 << 20)
    # 2 layers x (k, v) x 4 tokens x 2 kv heads x 16 dims x 4 bytes = 2 KiB per block
    assert runner.kv.num_blocks == runner.allocator.num_blocks == (1 << 20) // 2048
    assert runner.kv.k.dtype == torch.float32


def test_bfloat16_runs_on_cpu_with_a_bfloat16_cache(tiny_model, random_prompts):
    tiny = tiny_model("llama")
    runner = tiny.runner(dtype="bfloat16")
    assert runner.kv.k.dtype == torch.bfloat16
    prompt = random_prompts([9], seed=34)[0]
    t = table_for(runner, len(prompt))
    (logits,) = runner.execute([BatchItem(prompt, 0, t.blocks)])
    assert logits.dtype == torch.float32  # the sampler always sees float32
    with torch.no_grad():
        reference = tiny.hf(torch.tensor([prompt])).logits[0, -1]
    # bfloat16 precision (measured max error 0.26 on logits of magnitude 8), not parity
    assert torch.allclose(logits, reference, atol=1.0)


def test_unknown_dtype_is_rejected(tiny_model):
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16, float16"):
        tiny_model("llama").runner(dtype="float64")


def test_runner_names_the_cpu_paths_it_runs(tiny_model, monkeypatch):
    """The start-up log line says which GEMM library, weight form and attention paths a worker uses."""
    from pdserve.engine import linear, prefill_attention

    runner = tiny_model("llama").runner(block_size=4)
    text = runner.kernels()
    gemm = linear.gemm_backend() if linear.packing_available(torch.device("cpu"), torch.float32) else "torch.matmul"
    assert text.startswith(f"CPU paths: GEMM {gemm}, no quantized weights")  # random float32 weights
    assert ("prefill attention kernel" in text) == (prefill_attention.kernel() is not None)
    assert ("paged decode kernel" in text) == runner.paged_decode
    monkeypatch.setattr(prefill_attention._kernel, "lib", None)
    monkeypatch.setattr(prefill_attention._kernel, "error", "no compiler")
    assert "prefill attention SDPA (no compiler)" in runner.kernels()
