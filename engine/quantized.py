"""Weights that hold GGUF's quantized values, multiplied in that form when a step has few rows.

The default model is a GGUF file whose projections are ``Q4_1`` (in each group of 32 inputs of an
output, every weight is ``d * q + m`` with ``q`` in 0..15 and ``d``, ``m`` float16) and whose
embedding, which is also its output head, is ``Q8_0`` (``d * q``, ``q`` in -128..127).
``transformers`` dequantizes them to float32 and so do we, but a float32 copy is 4 bytes a weight,
and a decode step of a few dozen rows reads every weight once: it waits on memory, not on
arithmetic (MKL runs it at under half the machine's matrix rate). Kept as ``q``, ``d`` (and ``m``):
0.625 bytes a weight for Q4_1, 1.0625 for Q8_0, the same weights are rebuilt in registers, exactly,
and multiplied there (``csrc/quant_gemm.c``).

Nothing is approximated: ``pack`` recovers ``d``, ``q`` (and ``m``) from the float32 weight and
keeps them only when they give back every weight bit for bit (so only weights that are such
values to begin with qualify; other models keep the float32 path). The kernel rebuilds each
weight with one fused multiply-add, which is exactly that float32 value (``d * q`` is exact), and
sums the products in float32, by groups of 32 and then across groups, as a blocked GEMM does.
The order of the additions differs from MKL's, so results differ from the float32 path by
rounding only (about 1e-6 relative), which the parity tests against ``transformers`` cover.

The kernel needs x86-64 with AVX-512 and a C compiler (``cc``): it is compiled on first use into
the pdserve cache (``$PDSERVE_CACHE``, default ``~/.cache/pdserve``). Without either, or with
``PDSERVE_QUANT_KERNEL=0``, weights stay on the float32 path.
"""

from __future__ import annotations

import ctypes

import torch

from pdserve.engine import native

GROUP = 32  # inputs per (d, m) pair
TILE = 16  # outputs per packed column tile
Q4_1, Q8_0 = 0, 1  # the formats, as the kernel numbers them
MAX_ROWS = 48  # above this many rows the float32 GEMM is as fast or faster (compute, not memory, bound)


def _setup(lib: ctypes.CDLL) -> None:
    lib.quant_supported.restype = ctypes.c_int
    lib.quant_gemm.restype = None
    lib.quant_gemm.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                               ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    if not lib.quant_supported():
        raise RuntimeError("this CPU has no AVX-512")


_kernel = native.Kernel("quant_gemm.c", _setup, "PDSERVE_QUANT_KERNEL", "float32 weights")


def kernel():
    """The loaded kernel library, or ``None`` (the reason is in ``unavailable_reason()``)."""
    return _kernel.get()


def unavailable_reason() -> str | None:
    return _kernel.unavailable_reason()


class QuantWeight:
    """A ``[in, out]`` weight as packed groups of ``fmt`` (see ``csrc/quant_gemm.c`` for the layout)."""

    __slots__ = ("fmt", "packed", "in_features", "out_features")

    def __init__(self, fmt: int, packed: torch.Tensor, in_features: int, out_features: int) -> None:
        self.fmt = fmt
        self.packed = packed
        self.in_features = in_features
        self.out_features = out_features

    @property
    def nbytes(self) -> int:
        return self.packed.numel()


def _f16_step(d: torch.Tensor, step: int) -> torch.Tensor:
    """The float16 value ``step`` units in the last place away from ``d`` (positive, finite)."""
    return (d.view(torch.int16) + step).view(torch.float16)


_CHUNK = 2048  # outputs recovered at a time: bounds the temporaries (an output head has 49,152)


def _recover(w: torch.Tensor, m: torch.Tensor, base: torch.Tensor, lo: int, hi: int):
    """``_recover_chunk`` over chunks of ``_CHUNK`` outputs."""
    ds, qs = [], []
    for at in range(0, w.shape[0], _CHUNK):
        found = _recover_chunk(w[at:at + _CHUNK], m[at:at + _CHUNK], base[at:at + _CHUNK], lo, hi)
        if found is None:
            return None
        ds.append(found[0])
        qs.append(found[1])
    return torch.cat(ds), torch.cat(qs)


def _recover_chunk(w: torch.Tensor, m: torch.Tensor, base: torch.Tensor, lo: int, hi: int):
    """Per group of ``w`` (``[out, groups, 32]``): the float16 ``d`` (``base`` or a neighbour: the
    rounding of the quantizer's ``d`` to float16) and the integers ``q`` in ``lo..hi`` with
    ``d * q + m == w`` exactly, or ``None`` if some group has none."""
    zero = base == 0
    d = base.clone()
    ok = torch.zeros(base.shape, dtype=torch.bool)
    q = torch.zeros(w.shape, dtype=torch.int8 if lo < 0 else torch.uint8)
    for step in (0, 1, -1, 2, -2):
        cand = _f16_step(base, step) if step else base
        cand = torch.where(zero, torch.ones_like(cand), cand)  # all weights equal: q = 0
        todo = ~ok & torch.isfinite(cand.float()) & (cand.float() > 0)
        if not todo.any():
            break
        cf = cand.float()[todo].unsqueeze(-1)
        mt = m[todo].unsqueeze(-1)
        qi = torch.round((w[todo] - mt) / cf).clamp_(lo, hi)
        good = ((qi * cf + mt) == w[todo]).all(-1)
        sel = tuple(i[good] for i in todo.nonzero(as_tuple=True))
        d[sel] = cand[sel]
        q[sel] = qi[good].to(q.dtype)
        ok[sel] = True
        if bool(ok.all()):
            break
    if not bool(ok.all()):
        return None
    return torch.where(zero, torch.zeros_like(d), d), q


def pack(w_in_out: torch.Tensor) -> QuantWeight | None:
    """``w`` (float32 ``[in, out]``) as Q4_1 or Q8_0 groups of 32 inputs if its values are exactly
    such groups (float16 ``d >= 0`` and ``m``), else ``None``."""
    K, N = w_in_out.shape
    if w_in_out.dtype != torch.float32 or K % GROUP or N % TILE or w_in_out.device.type != "cpu":
        return None
    w = w_in_out.t().reshape(N, K // GROUP, GROUP)  # [out, group, 32]
    T, G = N // TILE, K // GROUP
    # Q4_1 as llama.cpp quantizes: m is the group's minimum (q = 0), d = (max - min) / 15 (q = 15)
    m = w.amin(-1)
    if torch.equal(m.half().float(), m):
        found = _recover(w, m, ((w.amax(-1) - m) / 15).half(), 0, 15)
        if found is not None:
            d, q = found
            # per tile and group: d[16], m[16], then per input pair (2p, 2p + 1) a byte per output
            # with the even input in the low nibble
            qq = q.view(T, TILE, G, GROUP // 2, 2)
            nib = (qq[..., 0] | (qq[..., 1] << 4)).permute(0, 2, 3, 1).reshape(T, G, 256)
            return QuantWeight(Q4_1, torch.cat([_per_tile(d, T, G), _per_tile(m.half(), T, G), nib], -1).view(-1), K, N)
    # Q8_0: d = max |w| / 127, q = round(w / d)
    found = _recover(w, torch.zeros(w.shape[:2]), (w.abs().amax(-1) / 127).half(), -128, 127)
    if found is not None:
        d, q = found
        qq = q.view(T, TILE, G, GROUP).permute(0, 2, 3, 1).reshape(T, G, GROUP * TILE)
        return QuantWeight(Q8_0, torch.cat([_per_tile(d, T, G), qq.view(torch.uint8)], -1).view(-1), K, N)
    return None


def _per_tile(v: torch.Tensor, T: int, G: int) -> torch.Tensor:
    """float16 ``[out, groups]`` -> ``[tiles, groups, 32 bytes]`` (16 outputs' values a group)."""
    return v.view(T, TILE, G).permute(0, 2, 1).contiguous().view(torch.uint8)


def quant_linear(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """``x @ W`` for ``x`` float32 ``[rows, in]`` on CPU (only where ``kernel()`` is not ``None``)."""
    lib = _kernel.lib or kernel()
    x = x.contiguous()
    rows = x.shape[0]
    y = torch.empty(rows, w.out_features, dtype=torch.float32)
    lib.quant_gemm(w.fmt, x.data_ptr(), rows, w.in_features, w.packed.data_ptr(), w.out_features, y.data_ptr(),
                 torch.get_num_threads())
    return y
