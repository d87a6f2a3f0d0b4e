"""The paged KV pool: one preallocated tensor pair for all layers, addressed by block id."""

from __future__ import annotations

import torch


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
        """Copy of the KV in ``block_ids`` for ``layers``: ``[2, len(layers), len(block_ids), ...]``."""
        layers = layers if layers is not None else range(self.num_layers)
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.k.device)
        sl = slice(layers.start, layers.stop)
        return torch.stack([self.k[sl].index_select(1, idx), self.v[sl].index_select(1, idx)])

    def import_blocks(self, block_ids: list[int], layers: range | None, data: torch.Tensor) -> None:
        """Write ``data`` (as returned by ``export_blocks``) into ``block_ids`` of ``layers``."""
        layers = layers if layers is not None else range(self.num_layers)
        expected = (2, len(layers), len(block_ids), self.block_size, self.num_kv_heads, self.head_dim)
        if tuple(data.shape) != expected:
            raise ValueError(f"KV data has shape {tuple(data.shape)}, expected {expected}")
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.k.device)
        sl = slice(layers.start, layers.stop)
        data = data.to(device=self.k.device, dtype=self.k.dtype)
        self.k[sl].index_copy_(1, idx, data[0])
        self.v[sl].index_copy_(1, idx, data[1])

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst`` in every layer (copy on write of shared blocks)."""
        for src, dst in pairs:
            self.k[:, dst].copy_(self.k[:, src])
            self.v[:, dst].copy_(self.v[:, src])
