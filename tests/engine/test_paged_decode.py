"""The in-place paged decode kernel (engine/paged_decode.py) against the torch gather path.

The kernel reads each sequence's keys and values from scattered pool blocks; the reference
gathers them into a padded batch and calls ``scaled_dot_product_attention``. Both are float32
with different summation orders, so they agree to a tolerance, not bit for bit.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pdserve.engine import paged_decode
from pdserve.engine.model_runner import BatchItem

pytestmark = pytest.mark.skipif(not paged_decode.available(torch.device("cpu"), torch.float32),
                                reason="numba not importable or PDSERVE_PAGED_DECODE=0")


def reference(q, k_pool, v_pool, tables, start, end):
    """Per sequence: gather its context slots, attend with SDPA (GQA by repeating KV heads)."""
    bs, kvh = k_pool.shape[1], k_pool.shape[2]
    kc, vc = k_pool.reshape(-1, kvh, k_pool.shape[3]), v_pool.reshape(-1, kvh, v_pool.shape[3])
    outs = []
    for b in range(q.shape[0]):
        slots = torch.tensor([tables[b][p // bs] * bs + p % bs for p in range(start[b], end[b])])
        k, v = kc[slots].transpose(0, 1), vc[slots].transpose(0, 1)
        o = F.scaled_dot_product_attention(q[b][:, None], k, v, enable_gqa=True)
        outs.append(o[:, 0])
    return torch.stack(outs)


@pytest.mark.parametrize("serial", [True, False], ids=["serial", "parallel"])
@pytest.mark.parametrize("heads,kv_heads,window", [(4, 2, None), (6, 6, None), (9, 3, 20)])
def test_kernel_matches_sdpa_over_scattered_blocks(heads, kv_heads, window, serial, monkeypatch):
    monkeypatch.setattr(paged_decode, "SERIAL_BELOW", 1 << 30 if serial else 0)
    rng = random.Random(heads)
    bs, d, num_blocks = 4, 16, 200
    k_pool, v_pool = torch.randn(num_blocks, bs, kv_heads, d), torch.randn(num_blocks, bs, kv_heads, d)
    lens = [1, 3, 4, 5, 17, 40, 63]
    free = list(range(num_blocks))
    rng.shuffle(free)  # blocks scattered all over the pool, as after many allocations and frees
    tables = []
    for n in lens:
        k = -(-n // bs)
        tables.append(free[:k])
        free = free[k:]
    padded = np.zeros((len(lens), max(map(len, tables))), dtype=np.int64)
    for i, t in enumerate(tables):
        padded[i, : len(t)] = t
    end = np.array(lens, dtype=np.int64)
    start = np.zeros_like(end) if window is None else np.maximum(end - window, 0)
    q = torch.randn(len(lens), heads, d)
    out = paged_decode.decode_attention(q, k_pool, v_pool, padded, start, end)
    assert torch.allclose(out, reference(q, k_pool, v_pool, tables, start, end), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "mistral", "gpt2"])
def test_runner_decode_step_same_with_and_without_the_kernel(kind, tiny_model, random_prompts):
    """A whole decode step through the runner: the kernel path and the torch gather path give the
    same logits (the torch path is what CUDA and non-float32 dtypes use)."""
    runner = tiny_model(kind).runner(block_size=4)
    assert runner.paged_decode
    prompts = random_prompts([3, 8, 21, 30], seed=31)
    tables = []
    for p in prompts:
        table = runner.allocator.allocate(-(-(len(p) + 1) // 4))
        runner.execute([BatchItem(p[:-1], 0, table, sample=False)])
        tables.append(table)
    items = [BatchItem(p[-1:], len(p) - 1, t) for p, t in zip(prompts, tables)]
    fast = runner.execute(items)
    runner.paged_decode = False
    slow = runner.execute(items)
    assert torch.allclose(fast, slow, atol=1e-4, rtol=0)


def test_vectorized_exp_within_a_few_ulp_of_exact():
    """The kernel's softmax ``exp`` (``_exp_shifted``: polynomial, not libm) against float64, over
    the whole range a max-subtracted score takes, including the clamp below -87 and exactly 0."""
    rng = np.random.default_rng(3)
    x = np.concatenate([-rng.random(200_000) * 90, -rng.random(10_000) * 1e-3, [0.0, -1e-30, -87.0, -200.0]])
    for m in (0.0, 1.5, -3.25):  # the kernel subtracts the row's maximum itself
        row = (x + m).astype(np.float32)
        shifted = (row - np.float32(m)).astype(np.float64)  # what the kernel exponentiates, exactly
        bits = np.empty(len(row), dtype=np.int32)
        paged_decode._exp_shifted(row, len(row), np.float32(m), bits)
        inside = shifted >= -87.0
        rel = np.abs(row[inside] - np.exp(shifted[inside])) / np.exp(shifted[inside])
        assert rel.max() < 4e-7, (m, rel.max())  # measured 3.0e-7 at worst: a few ulp
        assert np.all(row[~inside] > 0) and np.all(row[~inside] < 2e-38)
        assert row[np.flatnonzero(shifted == 0.0)].tolist() == [1.0] * int((shifted == 0.0).sum())
