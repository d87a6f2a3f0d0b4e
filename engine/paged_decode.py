"""Decode attention that reads the paged KV pool in place (CPU, float32, compiled with Numba).

A decode step attends one new query token per sequence to that sequence's whole context. Done
with torch ops, the context must first be gathered from the pool into a padded ``[B, L, ...]``
copy every layer of every step: at batch 64 and contexts of a few hundred tokens that copy moves
several times more bytes than the weights themselves. This kernel instead walks each sequence's
block table and reads keys and values where they lie, once, in parallel over (sequence, KV head)
pairs: no copy, no padding, one call per layer.

The arithmetic is the usual one (scores ``q . k * scale`` in float32, a max-subtracted
softmax, the probability-weighted sum of values), so results agree with
``scaled_dot_product_attention`` up to float rounding; the engine's parity tests check the greedy
tokens against Hugging Face. The kernel is compiled on first use (a few seconds; cached on disk
by Numba where it can write). Only CPU tensors go through it; other devices use the torch path.
"""

from __future__ import annotations

import math
import os
import types

import numpy as np
import torch

try:  # Numba is a declared dependency; without it the engine falls back to the torch path.
    import numba
    from numba import prange
except ImportError:  # pragma: no cover - exercised only where numba is missing
    numba = None

_DISABLED = os.environ.get("PDSERVE_PAGED_DECODE", "1") == "0"


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decode attention for this device/dtype runs in place (else the torch gather path)."""
    return numba is not None and not _DISABLED and device.type == "cpu" and dtype == torch.float32


if numba is not None:

    def _decode_kernel_py(q, k_rows, v_rows, block_tables, ctx_start, ctx_end, block_size, kvh, scale,
                       out):  # pragma: no cover - compiled
        # q, out: [B * H, D]; k_rows/v_rows: the pool as [num_blocks * block_size * KVH, D] (row of
        # slot s, KV head h = s * KVH + h); block_tables: [B, max_blocks]; sequence b attends to
        # its positions ctx_start[b] .. ctx_end[b] - 1. All arrays C-contiguous, so the loops over
        # the head dimension vectorize.
        BH, D = q.shape
        B = block_tables.shape[0]
        group = BH // B // kvh
        H = group * kvh
        for job in prange(B * kvh):
            b = job // kvh
            kh = job - b * kvh
            lo = ctx_start[b]
            n = ctx_end[b] - lo
            q0 = b * H + kh * group
            scores = np.empty((group, n), dtype=np.float32)
            for t in range(n):
                pos = lo + t
                blk = block_tables[b, pos // block_size]
                row = (blk * block_size + pos % block_size) * kvh + kh
                for g in range(group):
                    s = np.float32(0.0)
                    for d in range(D):
                        s += q[q0 + g, d] * k_rows[row, d]
                    scores[g, t] = s * scale
            for g in range(group):
                m = scores[g, 0]
                for t in range(1, n):
                    m = max(m, scores[g, t])
                total = np.float32(0.0)
                for t in range(n):
                    e = np.exp(scores[g, t] - m)
                    scores[g, t] = e
                    total += e
                inv = np.float32(1.0) / total
                for t in range(n):
                    scores[g, t] *= inv
            acc = np.zeros((group, D), dtype=np.float32)
            for t in range(n):
                pos = lo + t
                blk = block_tables[b, pos // block_size]
                row = (blk * block_size + pos % block_size) * kvh + kh
                for g in range(group):
                    p = scores[g, t]
                    for d in range(D):
                        acc[g, d] += p * v_rows[row, d]
            for g in range(group):
                for d in range(D):
                    out[q0 + g, d] = acc[g, d]


    # Two compilations of one body: across threads for real batches, and serial for small ones,
    # where starting the thread team would cost more than the work (single-stream decode).
    # Numba's disk cache keys a function by its name and line, not by the compile flags, so the
    # serial variant is compiled from a renamed copy of the function (else each would load the other).
    _decode_kernel = numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)(_decode_kernel_py)
    _serial_py = types.FunctionType(
        _decode_kernel_py.__code__.replace(co_name="_decode_kernel_serial", co_qualname="_decode_kernel_serial"),
        _decode_kernel_py.__globals__, "_decode_kernel_serial")
    _decode_kernel_serial = numba.njit(fastmath=True, cache=True, nogil=True)(_serial_py)

# Below this many (context tokens x KV heads) in a step, the serial kernel runs.
SERIAL_BELOW = 4096


def set_threads(n: int) -> None:
    """Use ``n`` threads in the kernel (the engine passes torch's thread count)."""
    if numba is not None:
        numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: np.ndarray,
                     ctx_start: np.ndarray, ctx_end: np.ndarray, scale: float | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context.

    ``q`` ``[B, H, D]``; ``k_pool``/``v_pool`` one layer's ``[num_blocks, block_size, KVH, D]``;
    ``block_tables`` int64 ``[B, max_blocks]``; sequence ``b`` attends to its positions
    ``ctx_start[b] .. ctx_end[b] - 1``. Returns ``[B, H, D]``.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    B, H, D = q.shape
    nb, bs, kvh, _ = k_pool.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    kernel = _decode_kernel_serial if int((ctx_end - ctx_start).sum()) * kvh < SERIAL_BELOW else _decode_kernel
    kernel(q.view(B * H, D).numpy(), k_pool.view(nb * bs * kvh, D).numpy(), v_pool.view(nb * bs * kvh, D).numpy(),
           block_tables, ctx_start, ctx_end, bs, kvh, np.float32(scale), out.view(B * H, D).numpy())
    return out
