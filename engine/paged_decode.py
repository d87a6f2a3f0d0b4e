"""Decode attention that reads the paged KV pool in place (CPU, float32, compiled with Numba).

A decode step attends one new query token per sequence to that sequence's whole context. Done
with torch ops, the context must first be gathered from the pool into a padded ``[B, L, ...]``
copy every layer of every step: at batch 64 and contexts of a few hundred tokens that copy moves
several times more bytes than the weights themselves. This kernel instead walks each sequence's
block table and reads keys and values where they lie, once, in parallel over sequences (each
thread takes every n-th sequence, all its heads): no copy, no padding, one call per layer.

The arithmetic is the usual one (scores ``q . k * scale`` in float32, a max-subtracted
softmax with a vectorized ``exp`` good to a few ulp, the probability-weighted sum of values), so
results agree with ``scaled_dot_product_attention`` up to float rounding; the engine's parity
tests check the greedy tokens against Hugging Face. The kernel is compiled on first use (a few
seconds; cached on disk by Numba where it can write). Only CPU tensors go through it; other
devices use the torch path.
"""

from __future__ import annotations

import math
import os

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

    from llvmlite import ir as _ir
    from numba.core import cgutils as _cgutils
    from numba.extending import intrinsic as _intrinsic

    @_intrinsic
    def _prefetch_elem(typingctx, arr, row, col):
        """Ask the CPU to start loading the cache line of ``arr[row, col]`` (LLVM's prefetch: a hint,
        read access, keep in all cache levels; it never faults and never changes a result)."""
        sig = numba.types.void(arr, row, col)

        def codegen(context, builder, signature, args):  # pragma: no cover - compiled
            aryty = signature.args[0]
            ary = context.make_array(aryty)(context, builder, args[0])
            ptr = _cgutils.get_item_pointer(context, builder, aryty, ary, [args[1], args[2]])
            fnty = _ir.FunctionType(_ir.VoidType(), [ptr.type, _ir.IntType(32), _ir.IntType(32), _ir.IntType(32)])
            fn = _cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
            i32 = _ir.IntType(32)
            builder.call(fn, [ptr, i32(0), i32(3), i32(1)])
            return context.get_dummy_value()
        return sig, codegen


    @numba.njit(fastmath=True, inline="always")
    def _dot(a, b):  # pragma: no cover - compiled
        s = np.float32(0.0)
        for d in range(a.shape[0]):
            s += a[d] * b[d]
        return s

    @numba.njit(fastmath=True, inline="always")
    def _axpy(p, x, acc):  # pragma: no cover - compiled
        for d in range(x.shape[0]):
            acc[d] += p * x[d]

    @numba.njit(fastmath=True, inline="always")
    def _row_and_prefetch(rows, table, pos, block_size, kvh, last_blk):  # pragma: no cover - compiled
        # The first of position ``pos``'s KV rows; and, since blocks lie anywhere in the pool so the
        # hardware prefetcher cannot follow a sequence from block to block, a hint to load the same
        # token of the next block ahead (one per 64-byte line, 16 float32), so that the next block's
        # rows are on their way while this one is summed (its effect on a decode step: BENCHMARKS.md).
        j = pos // block_size
        if j < last_blk:
            nrow = (table[j + 1] * block_size + pos % block_size) * kvh
            for r in range(kvh):
                for c in range(0, rows.shape[1], 16):
                    _prefetch_elem(rows, nrow + r, c)
        return (table[j] * block_size + pos % block_size) * kvh

    @numba.njit(fastmath=True, inline="always")
    def _exp_shifted(row, n, m, bits):  # pragma: no cover - compiled
        # row[t] = exp(row[t] - m) for t < n, where m >= every row[t]. Numba without Intel's SVML
        # calls libm's scalar expf once per element; this form vectorizes (AVX-512: 16 lanes):
        # x = k ln2 + r with k integer (ln2 split in two constants, Cody and Waite), exp(r) by a
        # degree-7 polynomial (Cephes' expf coefficients), and 2**k built from its exponent bits
        # in ``bits`` (int32 scratch). Relative error at most 3e-7 (a few ulp) on [-87, 0],
        # measured against float64 (tests); below -87 the result is exp(-87), under 2e-38.
        # Every score of every step goes through here, so a scalar call per element shows in the
        # whole kernel's time (before and after: BENCHMARKS.md).
        for t in range(n):
            x = max(row[t] - m, np.float32(-87.0))
            k = np.floor(x * np.float32(1.44269504088896341) + np.float32(0.5))
            r = x - k * np.float32(0.693359375)
            r = r - k * np.float32(-2.12194440e-4)
            y = np.float32(1.9875691500e-4)
            y = y * r + np.float32(1.3981999507e-3)
            y = y * r + np.float32(8.3334519073e-3)
            y = y * r + np.float32(4.1665795894e-2)
            y = y * r + np.float32(1.6666665459e-1)
            y = y * r + np.float32(5.0000001201e-1)
            row[t] = y * r * r + r + np.float32(1.0)
            bits[t] = (np.int32(k) + np.int32(127)) << 23
        two_k = bits[:n].view(np.float32)
        for t in range(n):
            row[t] *= two_k[t]

    @numba.njit(fastmath=True, cache=True, nogil=True)
    def _attend_one(q, k_rows, v_rows, table, lo, hi, block_size, kvh, scale, out, scores,
                    acc, bits):  # pragma: no cover - compiled
        # One sequence, all its heads: q, out [H, D]; k_rows/v_rows: the pool as
        # [num_blocks * block_size * KVH, D] (row of slot s, KV head h = s * KVH + h); the sequence
        # attends to positions lo .. hi - 1 of its block table. scores [H, >= hi - lo], acc [H, D]
        # and bits [>= hi - lo] (int32) are the caller's scratch. A token's KV heads are adjacent
        # rows, so one sequence reads its keys (then its values) block by block, front to back;
        # every row operation is a contiguous loop over the head dimension, which vectorizes.
        H = q.shape[0]
        group = H // kvh
        n = hi - lo
        last_blk = (hi - 1) // block_size
        for t in range(n):
            row0 = _row_and_prefetch(k_rows, table, lo + t, block_size, kvh, last_blk)
            for kh in range(kvh):
                k = k_rows[row0 + kh]
                for g in range(group):
                    h = kh * group + g
                    scores[h, t] = _dot(q[h], k) * scale
        for h in range(H):
            m = scores[h, 0]
            for t in range(1, n):
                m = max(m, scores[h, t])
            _exp_shifted(scores[h], n, m, bits)
            total = np.float32(0.0)
            for t in range(n):
                total += scores[h, t]
            inv = np.float32(1.0) / total
            for t in range(n):
                scores[h, t] *= inv
        acc[:, :] = 0.0
        for t in range(n):
            row0 = _row_and_prefetch(v_rows, table, lo + t, block_size, kvh, last_blk)
            for kh in range(kvh):
                v = v_rows[row0 + kh]
                for g in range(group):
                    h = kh * group + g
                    _axpy(scores[h, t], v, acc[h])
        out[:, :] = acc

    @numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
    def _decode_parallel(q, k_rows, v_rows, block_tables, ctx_start, ctx_end, block_size, kvh, scale, out,
                         workers):  # pragma: no cover - compiled
        # q, out: [B, H, D]. Worker w takes sequences w, w + workers, ...: with contexts of mixed
        # lengths in arrival order, striding balances the threads better than contiguous halves.
        B, H, D = q.shape
        for w in prange(workers):
            longest = 1
            for b in range(w, B, workers):
                longest = max(longest, ctx_end[b] - ctx_start[b])
            scores = np.empty((H, longest), dtype=np.float32)
            acc = np.empty((H, D), dtype=np.float32)
            bits = np.empty(longest, dtype=np.int32)
            for b in range(w, B, workers):
                _attend_one(q[b], k_rows, v_rows, block_tables[b], ctx_start[b], ctx_end[b], block_size, kvh,
                            scale, out[b], scores, acc, bits)

    @numba.njit(fastmath=True, cache=True, nogil=True)
    def _decode_serial(q, k_rows, v_rows, block_tables, ctx_start, ctx_end, block_size, kvh, scale, out,
                       workers):  # pragma: no cover - compiled
        # The same on the calling thread, for small steps where waking the thread team costs more
        # than the work (single-stream decode).
        B, H, D = q.shape
        longest = 1
        for b in range(B):
            longest = max(longest, ctx_end[b] - ctx_start[b])
        scores = np.empty((H, longest), dtype=np.float32)
        acc = np.empty((H, D), dtype=np.float32)
        bits = np.empty(longest, dtype=np.int32)
        for b in range(B):
            _attend_one(q[b], k_rows, v_rows, block_tables[b], ctx_start[b], ctx_end[b], block_size, kvh, scale,
                        out[b], scores, acc, bits)

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
    serial = int((ctx_end - ctx_start).sum()) * kvh < SERIAL_BELOW
    kernel = _decode_serial if serial else _decode_parallel
    kernel(q.numpy(), k_pool.view(nb * bs * kvh, D).numpy(), v_pool.view(nb * bs * kvh, D).numpy(),
           block_tables, ctx_start, ctx_end, bs, kvh, np.float32(scale), out.numpy(), numba.get_num_threads())
    return out
