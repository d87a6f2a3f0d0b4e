"""The prefill attention kernel (engine/prefill_attention.py, engine/csrc/prefill_attention.c).

Against an exact (float64) causal softmax attention, the kernel's error must stay within twice
SDPA's own (float32) error, for whole prompts and for chunks that also see earlier keys, grouped
heads, head sizes of 16 to 256, and lengths that are not multiples of the kernel's 16-row tiles.
``paged_attention`` must take it for plain causal chunks only, and everything must fall back to
SDPA where the kernel is unavailable. The models' parity tests against Hugging Face
(test_parity_tiny.py, test_parity_default.py, test_chunked_prefill.py) cover the end-to-end effect.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine import attention as attn
from pdserve.engine import prefill_attention as pa

needs_kernel = pytest.mark.skipif(pa.kernel() is None, reason=f"prefill attention kernel unavailable: "
                                                               f"{pa.unavailable_reason()}")


def exact(q, k, v, scale):
    q, k, v = q.double(), k.double(), v.double()
    Lq, H, D = q.shape
    Lk, KVH, _ = k.shape
    kk, vv = k.repeat_interleave(H // KVH, 1), v.repeat_interleave(H // KVH, 1)
    s = torch.einsum("ihd,jhd->hij", q, kk) * scale
    allowed = torch.arange(Lk)[None, :] <= torch.arange(Lk - Lq, Lk)[:, None]
    return torch.einsum("hij,jhd->ihd", s.masked_fill(~allowed, float("-inf")).softmax(-1), vv)


def sdpa(q, k, v, scale):
    Lq, Lk = q.shape[0], k.shape[0]
    allowed = torch.arange(Lk)[None, :] <= torch.arange(Lk - Lq, Lk)[:, None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       attn_mask=allowed, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


@needs_kernel
@pytest.mark.parametrize("Lq,Lk,H,KVH,D", [
    (1, 1, 4, 2, 16),  # one token
    (5, 5, 4, 2, 16),
    (16, 16, 9, 3, 64),  # exactly one tile
    (17, 17, 9, 3, 64),  # one row past it
    (200, 200, 9, 3, 64),  # the default model's heads
    (33, 50, 9, 3, 64),  # a chunk after 17 earlier tokens
    (1, 40, 8, 8, 32),  # one new token after 39 (no grouping)
    (100, 300, 4, 1, 128),
    (7, 7, 2, 1, 80),  # a head size that is a multiple of 16 but not of 64
    (3, 9, 2, 2, 256),  # the largest head size it takes
])
def test_kernel_matches_exact_attention_as_well_as_sdpa(Lq, Lk, H, KVH, D):
    g = torch.Generator().manual_seed(Lq * 1000 + Lk)
    q, k, v = (torch.randn(n, h, D, generator=g) * 2 for n, h in ((Lq, H), (Lk, KVH), (Lk, KVH)))
    scale = 1 / math.sqrt(D)
    assert pa.supports(q, k)
    want = exact(q, k, v, scale)
    got = pa.causal_attention(q, k, v, scale)
    assert got.shape == (Lq, H, D) and got.dtype == torch.float32
    sdpa_err = (sdpa(q, k, v, scale).double() - want).abs().max().item()
    assert (got.double() - want).abs().max().item() <= 2 * sdpa_err + 1e-6


@needs_kernel
def test_kernel_takes_strided_rows_and_any_thread_count():
    """Queries and keys as views into a fused projection (token stride wider than the heads), one
    and two threads: the same result as from contiguous copies."""
    g = torch.Generator().manual_seed(7)
    T, H, KVH, D = 45, 6, 2, 32
    fused = torch.randn(T, H + 2 * KVH, D, generator=g)
    q, k, v = fused[:, :H], fused[:, H:H + KVH], fused[:, H + KVH:]
    assert not q.is_contiguous()
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(pa.causal_attention(q, k, v))
        want = pa.causal_attention(q.contiguous(), k.contiguous(), v.contiguous())
    finally:
        torch.set_num_threads(before)
    for got in results:
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)


def test_kernel_refuses_what_it_does_not_cover():
    q, k = torch.randn(4, 4, 64), torch.randn(4, 2, 64)
    assert not pa.supports(q.bfloat16(), k.bfloat16())
    assert not pa.supports(torch.randn(4, 4, 24), torch.randn(4, 2, 24))  # head size not a multiple of 16
    assert not pa.supports(torch.randn(4, 4, 272), torch.randn(4, 2, 272))  # above 256
    assert not pa.supports(torch.randn(4, 3, 64), torch.randn(4, 2, 64))  # heads not a multiple of KV heads
    if pa.kernel() is not None:
        with pytest.raises(ValueError, match="at least as many keys"):
            pa.causal_attention(torch.randn(5, 2, 16), torch.randn(4, 2, 16), torch.randn(4, 2, 16))


def _step(monkeypatch, use_kernel: bool, sliding_window=None):
    """``paged_attention`` over a decode token and two prefill chunks (one fresh, one after earlier
    context), with the kernel on or off; returns the output and the calls the kernel got."""
    calls = []
    if use_kernel:
        real = pa.causal_attention
        monkeypatch.setattr(pa, "causal_attention", lambda *a: calls.append(a[0].shape) or real(*a))
    else:
        monkeypatch.setattr(pa, "supports", lambda q, k: False)
    g = torch.Generator().manual_seed(3)
    H, KVH, D, bs = 4, 2, 16, 4
    k_cache = torch.randn(64, KVH, D, generator=g)
    v_cache = torch.randn(64, KVH, D, generator=g)
    # chunk A: 6 fresh tokens at slots 0..5; chunk B: 5 tokens at positions 7..11 of a sequence
    # whose earlier KV (positions 0..6) is in slots 20..26, its new tokens going to 27..31
    slots = list(range(6)) + list(range(27, 32))
    meta = attn.AttentionMetadata.build(slots, [], [(0, 6, 0, list(range(6))), (6, 11, 7, list(range(20, 32)))],
                                        torch.device("cpu"), sliding_window)
    q = torch.randn(11, H, D, generator=g)
    k = torch.randn(11, KVH, D, generator=g)
    v = torch.randn(11, KVH, D, generator=g)
    out = attn.paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta)
    return out, calls


@needs_kernel
def test_paged_attention_takes_the_kernel_for_causal_chunks(monkeypatch):
    with monkeypatch.context() as m:
        got, calls = _step(m, use_kernel=True)
    assert calls == [(6, 4, 16), (5, 4, 16)]
    with monkeypatch.context() as m:
        want, _ = _step(m, use_kernel=False)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_sliding_windows_stay_on_sdpa(monkeypatch):
    _, calls = _step(monkeypatch, use_kernel=True, sliding_window=3)
    assert calls == []


def test_no_compiler_means_sdpa(monkeypatch, tmp_path):
    monkeypatch.setattr(pa._kernel, "lib", None)
    monkeypatch.setattr(pa._kernel, "error", None)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    assert pa.kernel() is None
    assert "no-such-cc" in pa.unavailable_reason()
    assert not pa.supports(torch.randn(4, 4, 64), torch.randn(4, 2, 64))
