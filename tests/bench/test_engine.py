"""`pdserve bench engine`'s bandwidth bound counts the weight bytes a decode step reads: each
weight once, as the copy a single-row product reads (its 4-bit groups when it has them)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pdserve.bench.engine import weight_bytes_per_step
from pdserve.engine import linear as lin
from pdserve.engine import quantized as qz

needs_packing = pytest.mark.skipif(not lin.packing_available(torch.device("cpu"), torch.float32),
                                   reason="this torch build has neither oneDNN nor MKL (or PDSERVE_PACKED_WEIGHTS=0)")
needs_kernel = pytest.mark.skipif(qz.kernel() is None, reason=f"quantized kernel unavailable: {qz.unavailable_reason()}")


@needs_packing
def test_a_packed_weight_counts_once(monkeypatch):
    """The weight bytes a decode step reads are the same whether the weights are packed or not
    (a step reads one of the two copies)."""
    from transformers import GPT2Config

    from pdserve.engine.models.gpt2 import GPT2Model

    cfg = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    g = torch.Generator().manual_seed(1)
    state = {"wte.weight": torch.randn(64, 32, generator=g), "wpe.weight": torch.randn(32, 32, generator=g),
             "ln_f.weight": torch.ones(32), "ln_f.bias": torch.zeros(32)}
    for i in range(2):
        p = f"h.{i}."
        for name, shape in (("ln_1.weight", (32,)), ("ln_1.bias", (32,)), ("ln_2.weight", (32,)), ("ln_2.bias", (32,)),
                            ("attn.c_attn.weight", (32, 96)), ("attn.c_attn.bias", (96,)),
                            ("attn.c_proj.weight", (32, 32)), ("attn.c_proj.bias", (32,)),
                            ("mlp.c_fc.weight", (32, 128)), ("mlp.c_fc.bias", (128,)),
                            ("mlp.c_proj.weight", (128, 32)), ("mlp.c_proj.bias", (32,))):
            state[p + name] = torch.randn(shape, generator=g)
    packed = GPT2Model(cfg, state, torch.float32, "cpu", 32)
    monkeypatch.setattr(lin, "_DISABLED", True)
    plain = GPT2Model(cfg, state, torch.float32, "cpu", 32)
    assert isinstance(packed.layers[0].wfc, lin.PackedWeight) and isinstance(plain.layers[0].wfc, torch.Tensor)
    per_layer = (32 * 96 + 96 + 32 * 32 + 32 + 32 * 128 + 128 + 128 * 32 + 32 + 4 * 32) * 4
    want = 2 * per_layer + (64 * 32 + 2 * 32) * 4  # layers, the output head, the final norm
    assert weight_bytes_per_step(SimpleNamespace(model=packed)) == want
    assert weight_bytes_per_step(SimpleNamespace(model=plain)) == want


def q4_1_weight(k: int, n: int, seed: int = 0) -> torch.Tensor:
    """A float32 ``[in, out]`` weight whose every group of 32 inputs of an output is Q4_1 (float16
    ``d`` and ``m``, ``q`` in 0..15 with both ends present), as llama.cpp quantizes."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.02).half().float()
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g)
    q[..., 5], q[..., 20] = 0, 15
    m = (-torch.rand(n, k // 32, 1, generator=g) * 0.15).half().float()
    return (q.float() * d + m).reshape(n, k).t().contiguous()


@needs_kernel
@needs_packing
def test_a_quantized_weight_counts_as_its_4_bit_groups_and_a_shared_one_once():
    pw = lin.prepare(q4_1_weight(64, 32, seed=5), pack=True)
    plain = lin.prepare(torch.randn(64, 32), pack=True)
    assert pw.quant is not None and plain.quant is None
    layer = SimpleNamespace(__slots__=("a", "b"), a=pw, b=pw)  # one weight under two names: once
    model = SimpleNamespace(layers=[layer], head=plain)
    assert weight_bytes_per_step(SimpleNamespace(model=model)) == pw.step_bytes + plain.step_bytes
