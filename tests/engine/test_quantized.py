"""Quantized weights (engine/quantized.py, engine/csrc/quant_gemm.c).

A weight qualifies only when its float32 values are Q4_1 or Q8_0 groups, and then the kernel must
rebuild every weight bit for bit and multiply as accurately as float32 MKL does. ``linear`` must
take the kernel for decode-sized products and the packed GEMM (oneDNN or MKL) for larger ones. End to end, the default model's
parity tests against Hugging Face (test_parity_default.py) run through this kernel.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import linear as lin
from pdserve.engine import quantized as qz

needs_kernel = pytest.mark.skipif(qz.kernel() is None, reason=f"quantized kernel unavailable: {qz.unavailable_reason()}")
needs_packing = pytest.mark.skipif(not lin.packing_available(torch.device("cpu"), torch.float32),
                               reason="this torch build has neither oneDNN nor MKL (or PDSERVE_PACKED_WEIGHTS=0)")
FORMATS = {"q4_1": qz.Q4_1, "q8_0": qz.Q8_0}


def quant_weight(fmt: int, k: int, n: int, seed: int = 0) -> torch.Tensor:
    """A float32 ``[in, out]`` weight made as llama.cpp quantizes, per group of 32 inputs of an
    output: Q4_1 with float16 ``d``, ``m`` and ``q`` in 0..15 (both 0, the minimum, and 15, the
    maximum, present); Q8_0 with float16 ``d`` and ``q`` in -127..127 (|q| = 127 present)."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.02).half().float()
    d[0, 0] = 0.0  # a group whose 32 weights are all equal
    if fmt == qz.Q4_1:
        q = torch.randint(0, 16, (n, k // 32, 32), generator=g)
        q[..., 5], q[..., 20] = 0, 15
        m = (-torch.rand(n, k // 32, 1, generator=g) * 0.15).half().float()
        w = q.float() * d + m
    else:
        q = torch.randint(-127, 128, (n, k // 32, 32), generator=g)
        q[..., 9] = 127 * (1 - 2 * (q[..., 3] % 2))
        w = q.float() * d
    return w.reshape(n, k).t().contiguous()


@pytest.mark.parametrize("name", FORMATS)
def test_pack_accepts_exact_group_values_only(name):
    fmt = FORMATS[name]
    w = quant_weight(fmt, 64, 32)
    packed = qz.pack(w)
    assert packed is not None and packed.fmt == fmt
    assert packed.nbytes == 64 * 32 * (5 if fmt == qz.Q4_1 else 8.5) // 8  # 0.625 / 1.0625 bytes a weight
    assert qz.pack(torch.randn(64, 32)) is None  # float32 values
    off = w.clone()
    off[7, 3] = torch.nextafter(off[7, 3], torch.tensor(1.0))  # one weight one ulp off
    assert qz.pack(off) is None
    assert qz.pack(w[:48].contiguous()) is None  # inputs not a multiple of 32
    assert qz.pack(w[:, :24].contiguous()) is None  # outputs not a multiple of 16
    assert qz.pack(w.double()) is None


@needs_kernel
@pytest.mark.parametrize("name", FORMATS)
def test_kernel_rebuilds_every_weight_exactly(name):
    w = quant_weight(FORMATS[name], 96, 48, seed=1)
    packed = qz.pack(w)
    eye = torch.eye(96)
    for start in range(0, 96, 24):  # unit rows pick out rows of the weight
        assert torch.equal(qz.quant_linear(eye[start:start + 24], packed), w[start:start + 24])
    # more rows than the registers hold: each group is rebuilt once for all row blocks
    assert torch.equal(qz.quant_linear(eye[:53], packed), w[:53])


@needs_kernel
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 7, 26, 27, 40, 53, 80])
def test_kernel_as_accurate_as_float32_gemm(name, rows):
    k, n = 1536, 96
    w = quant_weight(FORMATS[name], k, n, seed=rows)
    packed = qz.pack(w)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    exact = x.double() @ w.double()
    got = qz.quant_linear(x, packed)
    mkl_err = (x @ w - exact).abs().max().item()
    assert got.shape == (rows, n)
    assert (got.double() - exact).abs().max().item() <= 2 * mkl_err + 1e-6
    # each row is summed in the same order whatever else is in the batch: batch-invariant
    assert torch.equal(got[-1:], qz.quant_linear(x[-1:], packed))


@needs_kernel
@needs_packing
def test_linear_uses_the_kernel_for_few_rows_and_the_gemm_library_for_many(monkeypatch):
    w = quant_weight(qz.Q4_1, 64, 32, seed=3)
    b = torch.randn(32)
    pw = lin.prepare(w, pack=True)
    assert pw.quant is not None
    calls = []
    real = qz.quant_linear
    monkeypatch.setattr(qz, "quant_linear", lambda x, qw: calls.append(x.shape[0]) or real(x, qw))
    for rows in (1, 3, qz.MAX_ROWS, qz.MAX_ROWS + 1, 200):
        x = torch.randn(rows, 64)
        got = lin.linear(x, pw, b)
        assert torch.allclose(got, torch.addmm(b, x, w), rtol=1e-5, atol=1e-5)
    assert calls == [1, 3, qz.MAX_ROWS]
    assert lin.prepare(torch.randn(64, 32), pack=True).quant is None  # float32 values: the GEMM library only


@needs_kernel
def test_kernel_takes_strided_input_and_any_thread_count():
    w = quant_weight(qz.Q8_0, 64, 32, seed=4)
    packed = qz.pack(w)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            x = torch.randn(64, 9).t()
            assert not x.is_contiguous()
            assert torch.allclose(qz.quant_linear(x, packed), x @ w, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(before)


@needs_kernel
@needs_packing
def test_a_quantized_weight_drops_its_plain_copy_and_counts_as_its_own_bytes():
    pw = lin.prepare(quant_weight(qz.Q4_1, 64, 32, seed=5), pack=True)
    plain = lin.prepare(torch.randn(64, 32), pack=True)
    assert pw.t is None and pw.shape == (64, 32) and pw.step_bytes == 64 * 32 * 5 // 8
    assert plain.quant is None and plain.step_bytes == 64 * 32 * 4


def test_no_compiler_means_the_float32_path(monkeypatch, tmp_path):
    """Without a C compiler the kernel is unavailable, with the reason, and weights stay float32."""
    monkeypatch.setattr(qz._kernel, "lib", None)
    monkeypatch.setattr(qz._kernel, "error", None)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    assert qz.kernel() is None
    assert "no-such-cc" in qz.unavailable_reason()
    if lin.packing_available(torch.device("cpu"), torch.float32):
        w = quant_weight(qz.Q4_1, 64, 32)
        pw = lin.prepare(w, pack=True)
        assert pw.quant is None and pw.t is not None
        x = torch.randn(3, 64)
        assert torch.allclose(lin.linear(x, pw), x @ w, rtol=1e-5, atol=1e-5)
