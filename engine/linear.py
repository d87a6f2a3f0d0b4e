"""Projection weights, and the one function that multiplies activations by them.

On CPU in float32, a weight is packed once at load time into a GEMM library's own layout and
multiplied from there (the ops ``torch.compile``'s CPU backend uses for packed linears). A plain
``x @ w`` makes MKL re-pack the weight on every call: with few rows (a decode step of a handful of
sequences) that re-packing reads and writes every weight once more, and it costs more than the
multiplication itself. Packing once removes that cost from every step (by how much, per row
count: ``pdserve bench engine`` and BENCHMARKS.md).

The packed layout does not depend on the number of rows (it is packed for one row count and
passed the actual one at each call). With one row ``x @ w`` takes MKL's matrix-vector path, which
is faster than the packed kernel, so single-row products keep the plain weight: a packed weight
holds both, about twice the weight memory (``PDSERVE_PACKED_WEIGHTS=0`` turns packing off).

Weights whose values are GGUF's quantized groups (the default model's projections are ``Q4_1``,
its output head ``Q8_0``) keep that form instead of the plain copy (``engine/quantized.py``), and
products of up to ``quantized.MAX_ROWS`` rows (decode steps, single rows included) use it: they
read 0.625 (Q4_1) or 1.06 (Q8_0) bytes a weight instead of 4. Larger products (prefill) use the
packed copy.

Two GEMM libraries can hold the packed copy; ``PDSERVE_GEMM`` picks one (default ``onednn``):

- ``onednn``: oneDNN's float32 inner product (``torch.ops.mkldnn._reorder_linear_weight`` and
  ``_linear_pointwise``).
  oneDNN compiles its kernels for the instruction set it finds at run time, whoever made the CPU.
  On AMD processors it multiplies the default model's shapes much faster than MKL, which takes a
  slower path on non-Intel CPUs (figures in BENCHMARKS.md).
  Its sums are float32 in another order than MKL's: results agree with ``x @ w`` to rounding
  (tests check the error against a float64 product is within twice MKL's).
- ``mkl``: MKL's packed GEMM, bit-identical to ``x @ w`` for two rows and more (tested).

Elsewhere (CUDA, bfloat16, torch builds with neither library) weights stay plain tensors and
``linear`` is ``x @ w``.
"""

from __future__ import annotations

import os

import torch

from pdserve.engine import quantized

_DISABLED = os.environ.get("PDSERVE_PACKED_WEIGHTS", "1") == "0"
_PACK_ROWS_HINT = 64  # the row count the weight is packed for; the layout serves any
BACKENDS = ("onednn", "mkl")


def _onednn_ok() -> bool:
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise")
            and hasattr(ops, "_reorder_linear_weight"))


def _mkl_ok() -> bool:
    ops = torch.ops.mkl
    return (torch.backends.mkl.is_available() and hasattr(ops, "_mkl_linear")
            and hasattr(ops, "_mkl_reorder_linear_weight"))


def gemm_backend() -> str | None:
    """The library that packed float32 CPU weights use: ``PDSERVE_GEMM`` (``onednn``, the default,
    or ``mkl``) when this torch build has it, else the other one, else ``None`` (no packing)."""
    want = os.environ.get("PDSERVE_GEMM", "onednn").strip().lower() or "onednn"
    if want not in BACKENDS:
        raise ValueError(f"PDSERVE_GEMM must be one of {', '.join(BACKENDS)}; got {want!r}")
    ok = {"onednn": _onednn_ok, "mkl": _mkl_ok}
    for name in (want, *(b for b in BACKENDS if b != want)):
        if ok[name]():
            return name
    return None


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights for this device/dtype are packed (CPU float32 with oneDNN or MKL in torch)."""
    return (not _DISABLED and torch.device(device).type == "cpu" and dtype == torch.float32
            and gemm_backend() is not None)


class PackedWeight:
    """A ``[in, out]`` weight packed for a GEMM library (``backend``: ``onednn`` or ``mkl``), and
    also kept either as quantized groups (``quant``, when its values are such groups and the kernel
    runs here) or plain (``t``): single-row products, and with ``quant`` every product of up to
    ``quantized.MAX_ROWS`` rows, use that second copy."""

    __slots__ = ("t", "packed", "_out_in", "quant", "backend")

    def __init__(self, w_in_out: torch.Tensor, backend: str | None = None) -> None:
        self.backend = backend or gemm_backend()
        if self.backend not in BACKENDS:
            raise ValueError(f"no GEMM library to pack for (backend {self.backend!r})")
        self.quant = quantized.pack(w_in_out) if quantized.kernel() is not None else None
        self.t = w_in_out if self.quant is None else None  # with it, single rows go there: no float32 copy
        out_in = w_in_out.t().contiguous()
        if self.backend == "onednn":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(out_in, _PACK_ROWS_HINT)
        else:
            self.packed = torch.ops.mkl._mkl_reorder_linear_weight(out_in, _PACK_ROWS_HINT)
        # ``_mkl_linear`` reads only the shape and dtype of the unpacked ``[out, in]`` weight when
        # the packed one is used: a zero-stride view of one element carries them without memory.
        self._out_in = w_in_out.new_empty(1).expand(w_in_out.shape[1], w_in_out.shape[0])

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self._out_in.shape[1], self._out_in.shape[0]))

    @property
    def step_bytes(self) -> int:
        """Bytes a single-row product reads: the quantized or the plain copy."""
        return self.quant.nbytes if self.quant is not None else self.t.numel() * self.t.element_size()


def prepare(w_in_out: torch.Tensor, pack: bool) -> torch.Tensor | PackedWeight:
    """The weight as ``linear`` takes it: packed when ``pack`` (see ``packing_available``)."""
    return PackedWeight(w_in_out.contiguous()) if pack else w_in_out


def linear(x: torch.Tensor, w: torch.Tensor | PackedWeight, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w + b`` for ``x`` ``[rows, in]`` and ``w`` ``[in, out]`` (plain or packed)."""
    if isinstance(w, PackedWeight):
        rows = x.shape[0]
        if w.quant is not None and 0 < rows <= quantized.MAX_ROWS:
            y = quantized.quant_linear(x, w.quant)
            return y.add_(b) if b is not None else y
        if rows > 1 or w.t is None:
            if w.backend == "onednn":
                return torch.ops.mkldnn._linear_pointwise(x, w.packed, b, "none", [], "")
            return torch.ops.mkl._mkl_linear(x, w.packed, w._out_in, b, rows)
        w = w.t
    return torch.addmm(b, x, w) if b is not None else x @ w
