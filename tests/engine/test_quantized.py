"""4-bit projection weights (engine/quantized.py, engine/csrc/q4_gemm.c).

A weight qualifies only when its float32 values are Q4_1 groups, and then the kernel must rebuild
every weight bit for bit and multiply as accurately as float32 MKL does. ``linear`` must take the
kernel for decode-sized products and MKL for larger ones. End to end, the default model's parity
tests against Hugging Face (test_parity_default.py) run through this kernel.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import linear as lin
from pdserve.engine import quantized as q4

needs_kernel = pytest.mark.skipif(q4.kernel() is None, reason=f"4-bit kernel unavailable: {q4.unavailable_reason()}")


def q4_1_weight(k: int, n: int, seed: int = 0) -> torch.Tensor:
    """A float32 ``[in, out]`` weight made as llama.cpp's Q4_1 makes one: per group of 32 inputs of an
    output, float16 ``d`` and ``m``, ``q`` in 0..15 with both 0 (the minimum) and 15 (the maximum)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g)
    q[..., 5], q[..., 20] = 0, 15
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.02).half().float()
    m = (-torch.rand(n, k // 32, 1, generator=g) * 0.15).half().float()
    d[0, 0] = 0.0  # a group whose 32 weights are all equal
    return (q.float() * d + m).reshape(n, k).t().contiguous()


def test_pack_accepts_q4_1_values_only():
    w = q4_1_weight(64, 32)
    packed = q4.pack_q4_1(w)
    assert packed is not None and packed.nbytes == 64 * 32 * 5 // 8  # 0.625 bytes a weight
    assert q4.pack_q4_1(torch.randn(64, 32)) is None  # not Q4_1
    off = w.clone()
    off[7, 3] = torch.nextafter(off[7, 3], torch.tensor(1.0))  # one weight one ulp off
    assert q4.pack_q4_1(off) is None
    assert q4.pack_q4_1(w[:48].contiguous()) is None  # inputs not a multiple of 32
    assert q4.pack_q4_1(w[:, :24].contiguous()) is None  # outputs not a multiple of 16
    assert q4.pack_q4_1(w.double()) is None


@needs_kernel
def test_kernel_rebuilds_every_weight_exactly():
    w = q4_1_weight(96, 48, seed=1)
    packed = q4.pack_q4_1(w)
    eye = torch.eye(96)
    for start in range(0, 96, 24):  # unit rows pick out rows of the weight
        rows = eye[start:start + 24]
        assert torch.equal(q4.q4_linear(rows, packed), w[start:start + 24])


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 7, 24, 25, 40, 49])
def test_kernel_as_accurate_as_float32_gemm(rows):
    k, n = 1536, 96
    w = q4_1_weight(k, n, seed=rows)
    packed = q4.pack_q4_1(w)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    exact = x.double() @ w.double()
    got = q4.q4_linear(x, packed)
    mkl_err = (x @ w - exact).abs().max().item()
    assert got.shape == (rows, n)
    assert (got.double() - exact).abs().max().item() <= 2 * mkl_err + 1e-6


@needs_kernel
def test_linear_uses_the_kernel_for_few_rows_and_mkl_for_many(monkeypatch):
    if not lin.packing_available(torch.device("cpu"), torch.float32):
        pytest.skip("this torch build has no MKL (or PDSERVE_PACKED_WEIGHTS=0)")
    w = q4_1_weight(64, 32, seed=3)
    b = torch.randn(32)
    pw = lin.prepare(w, pack=True)
    assert pw.q4 is not None
    calls = []
    real = q4.q4_linear
    monkeypatch.setattr(q4, "q4_linear", lambda x, qw: calls.append(x.shape[0]) or real(x, qw))
    for rows in (1, 3, q4.MAX_ROWS, q4.MAX_ROWS + 1, 200):
        x = torch.randn(rows, 64)
        got = lin.linear(x, pw, b)
        assert torch.allclose(got, torch.addmm(b, x, w), rtol=1e-5, atol=1e-5)
    assert calls == [1, 3, q4.MAX_ROWS]
    assert lin.prepare(torch.randn(64, 32), pack=True).q4 is None  # float32 values: MKL only


@needs_kernel
def test_kernel_takes_strided_input_and_any_thread_count():
    w = q4_1_weight(64, 32, seed=4)
    packed = q4.pack_q4_1(w)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            x = torch.randn(64, 9).t()
            assert not x.is_contiguous()
            assert torch.allclose(q4.q4_linear(x, packed), x @ w, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_a_4bit_weight_drops_its_plain_copy_and_counts_as_its_4bit_bytes():
    if not lin.packing_available(torch.device("cpu"), torch.float32):
        pytest.skip("this torch build has no MKL (or PDSERVE_PACKED_WEIGHTS=0)")
    from types import SimpleNamespace

    from pdserve.engine.bench import weight_bytes_per_step

    w = q4_1_weight(64, 32, seed=5)
    pw = lin.prepare(w, pack=True)
    plain = lin.prepare(torch.randn(64, 32), pack=True)
    assert pw.t is None and pw.shape == (64, 32) and pw.step_bytes == 64 * 32 * 5 // 8
    assert plain.q4 is None and plain.step_bytes == 64 * 32 * 4
    layer = SimpleNamespace(__slots__=("a", "b"), a=pw, b=pw)  # one weight under two names: once
    model = SimpleNamespace(layers=[layer], head=plain)
    assert weight_bytes_per_step(SimpleNamespace(model=model)) == pw.step_bytes + plain.step_bytes
