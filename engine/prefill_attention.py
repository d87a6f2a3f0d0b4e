"""Causal attention for prefill chunks on CPU (float32), in a compiled kernel (``csrc/prefill_attention.c``).

torch's ``scaled_dot_product_attention`` on CPU runs its flash-attention loop over small matrix
products by the BLAS torch was built with (MKL in the PyPI wheels). Where that BLAS runs well
below the CPU's rate (MKL on AMD processors), attention becomes a large part of a long prompt's
prefill (the figures for the default model are in BENCHMARKS.md). This kernel computes the same
thing (flash-attention style: online softmax over blocks of 16 keys, the scores of 16 query rows
in vector registers, grouped-query heads reading their shared key/value head) with AVX-512
instructions and OpenMP threads.

It takes a chunk's queries ``[Lq, H, D]`` and the keys and values it attends to ``[Lk, KVH, D]``
(``Lk >= Lq``: the chunk's own, after the earlier context of its sequence), causal: query ``i`` sees
keys ``0 .. Lk - Lq + i``. Sliding windows and other masks stay on SDPA, as do other devices and
dtypes, head sizes that are not a multiple of 16 (or above 256), CPUs without AVX-512 and
machines without a C compiler. ``PDSERVE_PREFILL_KERNEL=0`` keeps SDPA everywhere (for
comparison). Results agree with SDPA to float32 rounding (tests/engine/test_prefill_attention.py);
the parity tests check greedy tokens against Hugging Face.
"""

from __future__ import annotations

import ctypes
import math

import torch

from pdserve.engine import native

MAX_HEAD_DIM = 256


def _setup(lib: ctypes.CDLL) -> None:
    lib.attn_supported.restype = ctypes.c_int
    lib.attn_prefill.restype = ctypes.c_int
    lib.attn_prefill.argtypes = [ctypes.c_int] * 5 + [ctypes.c_void_p, ctypes.c_long] * 3 + [
        ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_int]
    if not lib.attn_supported():
        raise RuntimeError("this CPU has no AVX-512")


_kernel = native.Kernel("prefill_attention.c", _setup, "PDSERVE_PREFILL_KERNEL", "SDPA")


def kernel():
    """The loaded kernel, or ``None`` (the reason is in ``unavailable_reason()``)."""
    return _kernel.get()


def unavailable_reason() -> str | None:
    return _kernel.unavailable_reason()


def supports(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether ``causal_attention`` takes these (else the caller uses SDPA)."""
    D = q.shape[-1]
    return (q.device.type == "cpu" and q.dtype == torch.float32 and k.dtype == torch.float32
            and D % 16 == 0 and 0 < D <= MAX_HEAD_DIM and q.shape[-2] % k.shape[-2] == 0
            and kernel() is not None)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``[L, heads, D]`` with heads ``D`` apart and dimensions contiguous (any token stride)."""
    if t.stride(-1) != 1 or t.stride(-2) != t.shape[-1] or t.stride(0) < t.shape[-2] * t.shape[-1]:
        return t.contiguous()
    return t


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """``q`` ``[Lq, H, D]``, ``k``/``v`` ``[Lk, KVH, D]`` with ``Lk >= Lq`` -> ``[Lq, H, D]``: query ``i``
    attends to keys ``0 .. Lk - Lq + i`` (only where ``supports(q, k)``)."""
    Lq, H, D = q.shape
    Lk, KVH, _ = k.shape
    if Lk < Lq:
        raise ValueError(f"{Lq} queries need at least as many keys, got {Lk}")
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    q, k, v = _rows(q), _rows(k), _rows(v)
    out = torch.empty(Lq, H, D, dtype=torch.float32)
    if Lq == 0:
        return out
    rc = (_kernel.lib or kernel()).attn_prefill(
        Lq, Lk, H, KVH, D, q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
        out.data_ptr(), out.stride(0), scale, torch.get_num_threads())
    if rc != 0:
        raise MemoryError(f"prefill attention: no scratch memory for {Lk} keys")
    return out
