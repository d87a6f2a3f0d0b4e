"""Attention over the paged KV cache for a flat batch of tokens from many sequences.

The batch is laid out decode-first: the first ``num_decode`` tokens are one token each of
``num_decode`` sequences in their decode phase; then come the prefill chunks, one contiguous run
of tokens per sequence. Everything that does not depend on the layer (slot indices, masks) is
built once per step in ``AttentionMetadata.build`` and reused by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pdserve.engine import paged_decode, prefill_attention


@dataclass
class PrefillChunk:
    """One sequence's run of new tokens: ``tokens[start:end]`` of the flat batch."""

    start: int
    end: int
    context_slots: torch.Tensor | None  # all slots 0..pos_end-1 when earlier KV exists, else None
    mask: torch.Tensor | None  # [q, ctx] bool, True where attention is allowed; None: plain causal
    windowed: bool = False  # the mask is also a sliding window (not plain causal)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    num_decode: int
    decode_slots: torch.Tensor | None  # [B, Lmax] context slots of the decode sequences (padded)
    decode_mask: torch.Tensor | None  # [B, 1, 1, Lmax] bool, or None when no padding is needed
    prefills: list[PrefillChunk]
    # In-place decode (CPU float32, see paged_decode): block tables and context ranges instead of
    # decode_slots/decode_mask; the kernel reads the pool where the KV lies.
    decode_block_tables: np.ndarray | None = None  # int64 [B, max_blocks]
    decode_ctx_start: np.ndarray | None = None  # int64 [B]
    decode_ctx_end: np.ndarray | None = None  # int64 [B]
    block_size: int = 0

    @staticmethod
    def build(
        slot_mapping: list[int],
        decode_context_slots: list[list[int]],
        prefill_runs: list[tuple[int, int, int, list[int]]],
        device: torch.device,
        sliding_window: int | None = None,
        decode_block_tables: list[list[int]] | None = None,
        decode_lens: list[int] | None = None,
        block_size: int = 0,
    ) -> "AttentionMetadata":
        """``prefill_runs`` holds ``(start, end, first_position, context_slots)`` per chunk.

        Decode sequences come either as ``decode_context_slots`` (every context slot: the torch
        gather path) or as ``decode_block_tables`` + ``decode_lens`` (the in-place kernel)."""
        long = dict(dtype=torch.long, device=device)
        decode_slots = decode_mask = None
        tables = ctx_start = ctx_end = None
        num_decode = len(decode_context_slots)
        if decode_block_tables:
            num_decode = len(decode_block_tables)
            tables = np.zeros((num_decode, max(len(t) for t in decode_block_tables)), dtype=np.int64)
            for i, t in enumerate(decode_block_tables):
                tables[i, : len(t)] = t
            ctx_end = np.asarray(decode_lens, dtype=np.int64)
            ctx_start = np.zeros_like(ctx_end) if sliding_window is None else np.maximum(ctx_end - sliding_window, 0)
        elif decode_context_slots:
            lens = [len(s) for s in decode_context_slots]
            lmax = max(lens)
            padded = [s + [0] * (lmax - len(s)) for s in decode_context_slots]
            decode_slots = torch.tensor(padded, **long)
            pos = torch.arange(lmax, device=device)
            lens_t = torch.tensor(lens, **long)[:, None]
            valid = pos[None, :] < lens_t
            if sliding_window is not None:
                valid &= pos[None, :] > lens_t - 1 - sliding_window
            if not bool(valid.all()):
                decode_mask = valid[:, None, None, :]
        prefills = []
        for start, end, first_pos, ctx in prefill_runs:
            q = end - start
            if first_pos == 0 and sliding_window is None:
                prefills.append(PrefillChunk(start, end, None, None))
                continue
            qpos = torch.arange(first_pos, first_pos + q, device=device)[:, None]
            kpos = torch.arange(first_pos + q, device=device)[None, :]
            mask = kpos <= qpos
            if sliding_window is not None:
                mask &= kpos > qpos - sliding_window
            slots = torch.tensor(ctx, **long) if first_pos > 0 else None
            prefills.append(PrefillChunk(start, end, slots, mask, sliding_window is not None))
        return AttentionMetadata(torch.tensor(slot_mapping, **long), num_decode, decode_slots, decode_mask, prefills,
                                 tables, ctx_start, ctx_end, block_size)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float | None = None,
) -> torch.Tensor:
    """Write the new ``k``/``v`` into the cache, then attend. Shapes: q ``[T, H, D]``, k/v
    ``[T, KVH, D]``, caches ``[slots, KVH, D]``; returns ``[T, H, D]``."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    parts = []
    nd = meta.num_decode
    if nd and meta.decode_block_tables is not None:
        bs = meta.block_size
        parts.append(paged_decode.decode_attention(
            q[:nd], k_cache.view(-1, bs, *k_cache.shape[1:]), v_cache.view(-1, bs, *v_cache.shape[1:]),
            meta.decode_block_tables, meta.decode_ctx_start, meta.decode_ctx_end, scale))
    elif nd:
        qd = q[:nd].unsqueeze(2)  # [B, H, 1, D]
        kd = k_cache[meta.decode_slots].transpose(1, 2)  # [B, KVH, L, D]
        vd = v_cache[meta.decode_slots].transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True)
        parts.append(od.squeeze(2))
    for chunk in meta.prefills:
        qc = q[chunk.start : chunk.end]  # [q, H, D]
        if chunk.context_slots is None:
            kp = k[chunk.start : chunk.end]
            vp = v[chunk.start : chunk.end]
        else:
            kp = k_cache[chunk.context_slots]
            vp = v_cache[chunk.context_slots]
        if not chunk.windowed and prefill_attention.supports(qc, kp):
            # causal over the chunk's own keys after its sequence's earlier ones: the CPU kernel
            parts.append(prefill_attention.causal_attention(qc, kp, vp, scale))
            continue
        qp = qc.transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        kp = kp.transpose(0, 1).unsqueeze(0)
        vp = vp.transpose(0, 1).unsqueeze(0)
        op = F.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=chunk.mask, is_causal=chunk.mask is None, scale=scale, enable_gqa=True
        )
        parts.append(op.squeeze(0).transpose(0, 1))
    return parts[0] if len(parts) == 1 else torch.cat(parts, 0)
