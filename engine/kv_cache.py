"""The paged KV pool: one preallocated tensor pair for all layers, addressed by block id."""

from __future__ import annotations

import torch


_MAX_RUNS = 16  # more runs of consecutive block ids than this: one indexed copy instead of slices


def block_runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """``(position, first block id, length)`` of each run of consecutive ids in ``block_ids``."""
    runs: list[tuple[int, int, int]] = []
    for at, b in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == b:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((at, b, 1))
    return runs


class KVCache:
    """Keys and values of every layer, in fixed-size blocks.

    ``k`` and ``v`` have shape ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``.
    A token's KV lives at flat slot ``block_id * block_size + offset`` of its layer.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8

    def layer_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat ``[num_blocks * block_size, num_kv_heads, head_dim]`` views of one layer."""
        k = self.k[layer].view(-1, self.num_kv_heads, self.head_dim)
        v = self.v[layer].view(-1, self.num_kv_heads, self.head_dim)
        return k, v

    def export_blocks(self, block_ids: list[int], layers: range | None = None) -> torch.Tensor:
        """Copy of the KV in ``block_ids`` for ``layers``: ``[2, len(layers), len(block_ids), ...]``,
        contiguous, in one copy (runs of consecutive block ids are sliced, not gathered)."""
        layers = layers if layers is not None else range(self.num_layers)
        sl = slice(layers.start, layers.stop)
        out = torch.empty((2, len(layers), len(block_ids)) + tuple(self.k.shape[2:]), dtype=self.k.dtype,
                          device=self.k.device)
        runs = block_runs(block_ids)
        if len(runs) > _MAX_RUNS:
            idx = torch.tensor(block_ids, dtype=torch.long, device=self.k.device)
            torch.index_select(self.k[sl], 1, idx, out=out[0])
            torch.index_select(self.v[sl], 1, idx, out=out[1])
            return out
        for at, first, n in runs:
            out[0, :, at:at + n].copy_(self.k[sl, first:first + n])
            out[1, :, at:at + n].copy_(self.v[sl, first:first + n])
        return out

    def import_blocks(self, block_ids: list[int], layers: range | None, data: torch.Tensor) -> None:
        """Write ``data`` (as returned by ``export_blocks``) into ``block_ids`` of ``layers``. Runs of
        consecutive block ids are written as slices: a plain memory copy, several times cheaper than
        an indexed copy (the common case: a request's reserved blocks are mostly consecutive)."""
        layers = layers if layers is not None else range(self.num_layers)
        expected = (2, len(layers), len(block_ids), self.block_size, self.num_kv_heads, self.head_dim)
        if tuple(data.shape) != expected:
            raise ValueError(f"KV data has shape {tuple(data.shape)}, expected {expected}")
        sl = slice(layers.start, layers.stop)
        data = data.to(device=self.k.device, dtype=self.k.dtype)
        runs = block_runs(block_ids)
        if len(runs) > _MAX_RUNS:
            idx = torch.tensor(block_ids, dtype=torch.long, device=self.k.device)
            self.k[sl].index_copy_(1, idx, data[0])
            self.v[sl].index_copy_(1, idx, data[1])
            return
        for at, first, n in runs:
            self.k[sl, first:first + n].copy_(data[0, :, at:at + n])
            self.v[sl, first:first + n].copy_(data[1, :, at:at + n])

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst`` in every layer (copy on write of shared blocks)."""
        for src, dst in pairs:
            self.k[:, dst].copy_(self.k[:, src])
            self.v[:, dst].copy_(self.v[:, src])
