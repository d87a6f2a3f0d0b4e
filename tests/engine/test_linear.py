"""Packed projection weights (engine/linear.py): the same numbers as the plain product.

With MKL (``PDSERVE_GEMM=mkl``) a packed weight must give bit-identical results to ``x @ w`` (and
``addmm`` with a bias) for every row count from two up, whatever row count it was packed for. With
oneDNN (the default) the sums run in another order, so the result must be as close to the exact
(float64) product as MKL's own is, within a factor of two. Single-row products must take the plain
weight. The models' parity tests against Hugging Face cover the end-to-end effect.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import linear as lin

pytestmark = pytest.mark.skipif(not lin.packing_available(torch.device("cpu"), torch.float32),
                                reason="this torch build has neither oneDNN nor MKL (or PDSERVE_PACKED_WEIGHTS=0)")

_OK = {"onednn": lin._onednn_ok, "mkl": lin._mkl_ok}
BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(not _OK[b](), reason=f"this torch build has no {b}"))
            for b in lin.BACKENDS]


def assert_same_product(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, backend: str):
    want = torch.addmm(b, x, w) if b is not None else x @ w
    assert got.shape == want.shape
    if backend == "mkl":
        assert torch.equal(got, want)
        return
    exact = x.double() @ w.double() + (b.double() if b is not None else 0)
    plain_err = (want.double() - exact).abs().max().item()
    assert (got.double() - exact).abs().max().item() <= 2 * plain_err + 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows", [2, 3, 8, 21, 64, 65, 300])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_packed_matches_plain(rows, bias, backend):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 160, generator=g)
    b = torch.randn(160, generator=g) if bias else None
    x = torch.randn(rows, 96, generator=g)
    packed = lin.PackedWeight(w, backend)
    assert packed.backend == backend
    assert_same_product(lin.linear(x, packed, b), x, w, b, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_matches_for_strided_input_and_other_thread_counts(backend):
    """Packed under one thread count, used under another, with a transposed (strided) input."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        w = torch.randn(96, 160)
        packed = lin.PackedWeight(w, backend)
        torch.set_num_threads(2)
        for rows in (2, 5, 64, 300):
            x = torch.randn(96, rows).t()
            assert not x.is_contiguous()
            assert_same_product(lin.linear(x, packed), x, w, None, backend)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows", [0, 1])
def test_zero_and_one_row_use_the_plain_weight(rows, backend, monkeypatch):
    w = torch.randn(32, 48)
    packed = lin.PackedWeight(w, backend)
    calls = []
    monkeypatch.setattr(torch.ops.mkl, "_mkl_linear", lambda *a: calls.append(a), raising=False)
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(a), raising=False)
    x = torch.randn(rows, 32)
    assert torch.equal(lin.linear(x, packed), x @ w)
    assert calls == []


def test_gemm_backend_follows_the_environment(monkeypatch):
    monkeypatch.delenv("PDSERVE_GEMM", raising=False)
    default = lin.gemm_backend()
    assert default == ("onednn" if lin._onednn_ok() else "mkl")
    for name in lin.BACKENDS:
        monkeypatch.setenv("PDSERVE_GEMM", name)
        assert lin.gemm_backend() == (name if _OK[name]() else default)
        assert lin.prepare(torch.randn(8, 16), pack=True).backend == lin.gemm_backend()
    monkeypatch.setenv("PDSERVE_GEMM", "openblas")
    with pytest.raises(ValueError, match="PDSERVE_GEMM must be one of onednn, mkl; got 'openblas'"):
        lin.gemm_backend()


def test_not_packed_when_disabled_or_not_cpu_float32(monkeypatch):
    assert not lin.packing_available(torch.device("cpu"), torch.bfloat16)
    assert not lin.packing_available(torch.device("cuda"), torch.float32)
    monkeypatch.setattr(lin, "_DISABLED", True)
    assert not lin.packing_available(torch.device("cpu"), torch.float32)
    w = torch.randn(8, 8)
    assert lin.prepare(w, pack=False) is w


@pytest.mark.parametrize("backend", BACKENDS)
def test_llama_weights_are_packed_and_forward_matches_unpacked(backend, monkeypatch):
    """The same tiny Llama built with and without packing gives the same logits for a batch of
    several rows (bit for bit with MKL, to float32 rounding with oneDNN) and on a single row."""
    from transformers import LlamaConfig

    from pdserve.engine.models.llama import LlamaModel

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (128, 64), "model.norm.weight": (64,)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (64,), p + "post_attention_layernorm.weight": (64,),
                       p + "self_attn.q_proj.weight": (64, 64), p + "self_attn.k_proj.weight": (32, 64),
                       p + "self_attn.v_proj.weight": (32, 64), p + "self_attn.o_proj.weight": (64, 64),
                       p + "mlp.gate_proj.weight": (96, 64), p + "mlp.up_proj.weight": (96, 64),
                       p + "mlp.down_proj.weight": (64, 96)})
    state = {k: torch.randn(s, generator=g) * 0.2 for k, s in shapes.items()}
    monkeypatch.setenv("PDSERVE_GEMM", backend)
    packed = LlamaModel(cfg, state, torch.float32, "cpu", 64)
    monkeypatch.setattr(lin, "_DISABLED", True)
    plain = LlamaModel(cfg, state, torch.float32, "cpu", 64)
    assert isinstance(packed.layers[0].wgu, lin.PackedWeight) and isinstance(packed.lm_head, lin.PackedWeight)
    assert isinstance(plain.layers[0].wgu, torch.Tensor)
    hidden = torch.randn(5, 64, generator=g)
    assert packed.lm_head.backend == backend
    if backend == "mkl":
        assert torch.equal(packed.logits(hidden), plain.logits(hidden))
    else:
        assert torch.allclose(packed.logits(hidden), plain.logits(hidden), rtol=1e-5, atol=1e-5)
    assert torch.equal(packed.logits(hidden[:1]), plain.logits(hidden[:1]))
