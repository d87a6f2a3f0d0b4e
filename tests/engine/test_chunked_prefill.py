"""ModelRunner.execute over a flat batch: chunked prefill equals whole prefill, and a batched
decode step equals the same steps run one sequence at a time.

These drive the runner directly with hand-built ``BatchItem``s, as a scheduler does. Float32
results of differently shaped matrix products differ by a few ulps (measured: at most 1.2e-5 on
logits of magnitude 8), so "the same" is ``allclose`` with an absolute tolerance of 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.block_allocator import BlockTable, slot_ids
from pdserve.engine.model_runner import BatchItem

ATOL = 1e-4
KINDS = ["llama", "mistral", "gpt2"]  # plain causal, sliding window, learned positions


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, atol=ATOL, rtol=0)


def new_table(runner, num_tokens: int) -> BlockTable:
    t = BlockTable(runner.block_size)
    t.reserve(runner.allocator, num_tokens)
    t.num_tokens = num_tokens
    return t


def grow(runner, table: BlockTable, num_tokens: int) -> None:
    assert table.reserve(runner.allocator, num_tokens) == []
    table.num_tokens = num_tokens


def prefill(runner, tokens: list[int], chunk: int | None, every_chunk: bool = False):
    """Prefill ``tokens`` in chunks of ``chunk`` (``None``: at once); return the block table and
    the logits after every chunk (``every_chunk``) or after the last one."""
    table = BlockTable(runner.block_size)
    out = []
    step = chunk or len(tokens)
    for start in range(0, len(tokens), step):
        end = min(start + step, len(tokens))
        grow(runner, table, end)
        sample = every_chunk or end == len(tokens)
        logits = runner.execute([BatchItem(tokens[start:end], start, table.blocks, sample=sample)])
        assert logits.shape[0] == int(sample)
        if sample:
            out.append(logits[0])
    return table, out


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_prefill_equals_whole_prefill(kind, tiny_model, random_prompts):
    tiny = tiny_model(kind)
    runner = tiny.runner(num_blocks=256, block_size=4)
    prompt = random_prompts([100], seed=20)[0]
    n = len(prompt)
    whole_table, (whole,) = prefill(runner, prompt, None)
    with torch.no_grad():
        hf_logits = tiny.hf(torch.tensor([prompt])).logits[0]
    assert close(whole, hf_logits[-1])
    for chunk in (1, 3, 7, 16, 33):
        table, per_chunk = prefill(runner, prompt, chunk, every_chunk=True)
        assert close(per_chunk[-1], whole), f"chunk {chunk}"
        ends = [min(s + chunk, n) for s in range(0, n, chunk)]
        for end, logits in zip(ends, per_chunk):  # every intermediate chunk is right too
            assert close(logits, hf_logits[end - 1]), f"chunk {chunk}, position {end - 1}"
        # the KV written chunk by chunk equals the KV written at once
        a, b = (slot_ids(t.blocks, t.block_size, 0, n) for t in (table, whole_table))
        for layer in range(runner.kv.num_layers):
            k, v = runner.kv.layer_slots(layer)
            assert close(k[a], k[b]) and close(v[a], v[b]), f"chunk {chunk}, layer {layer}"
        table.release(runner.allocator)
    whole_table.release(runner.allocator)
    assert runner.allocator.num_free == runner.allocator.num_blocks


@pytest.mark.parametrize("kind", KINDS)
def test_batched_decode_equals_one_at_a_time(kind, tiny_model, random_prompts):
    tiny = tiny_model(kind)
    # shorter than, equal to and longer than a block (4) and than Mistral's window (16)
    lengths = [1, 2, 5, 9, 16, 17, 30, 41]
    prompts = random_prompts(lengths, seed=21)
    batched, single = tiny.runner(block_size=4), tiny.runner(block_size=4)
    tables_b = [prefill(batched, p, None)[0] for p in prompts]
    tables_s = [prefill(single, p, None)[0] for p in prompts]
    lens = list(lengths)
    for step in range(6):
        new = random_prompts([1] * len(prompts), seed=100 + step)
        for i in range(len(prompts)):
            grow(batched, tables_b[i], lens[i] + 1)
            grow(single, tables_s[i], lens[i] + 1)
        together = batched.execute([BatchItem(new[i], lens[i], tables_b[i].blocks) for i in range(len(prompts))])
        assert together.shape == (len(prompts), batched.vocab_size)
        for i in range(len(prompts)):
            (alone,) = single.execute([BatchItem(new[i], lens[i], tables_s[i].blocks)])
            assert close(together[i], alone), f"step {step}, sequence {i} of length {lens[i]}"
        lens = [n + 1 for n in lens]


def test_mixed_step_of_decodes_and_prefill_chunks(tiny_model, random_prompts):
    """Colocated mode mixes decode tokens and prefill chunks in one step: each item's logits are
    those of its whole sequence run alone, and rows come back in the order of the items given,
    whatever layout the runner uses inside."""
    tiny = tiny_model("qwen2")
    prompts = random_prompts([12, 25, 6, 19], seed=22)
    runner = tiny.runner(block_size=4)
    # tokens of each sequence already in the cache before the mixed step: 0 and 2 decode their
    # last token, 1 prefills from scratch, 3 prefills its second part after a first chunk
    done = {0: 11, 1: 0, 2: 5, 3: 10}
    tables = {}
    for i, d in done.items():
        tables[i] = new_table(runner, len(prompts[i]))
        if d:
            runner.execute([BatchItem(prompts[i][:d], 0, tables[i].blocks, sample=False)])
    order = [1, 0, 3, 2]  # prefills before decodes: the runner puts decodes first internally
    together = runner.execute([BatchItem(prompts[i][done[i]:], done[i], tables[i].blocks) for i in order])
    assert together.shape[0] == 4
    with torch.no_grad():
        for row, i in enumerate(order):
            expected = tiny.hf(torch.tensor([prompts[i]])).logits[0, -1]
            assert close(together[row], expected), f"row {row} (sequence {i})"


def test_items_without_sample_return_no_logits(tiny_model, random_prompts):
    runner = tiny_model("llama").runner()
    a, b = random_prompts([5, 8], seed=23)
    ta, tb = new_table(runner, 5), new_table(runner, 8)
    logits = runner.execute([BatchItem(a, 0, ta.blocks, sample=False), BatchItem(b, 0, tb.blocks)])
    assert logits.shape == (1, runner.vocab_size)
    other = tiny_model("llama").runner()
    (only_b,) = other.execute([BatchItem(b, 0, new_table(other, 8).blocks)])
    assert close(logits[0], only_b)
    assert runner.execute([]).shape == (0, runner.vocab_size)
