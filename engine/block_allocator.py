"""The paged-KV block allocator and the per-sequence block table.

Blocks are fixed-size pages of the KV pool (``KVCache``). The allocator hands out block ids from
a free list and counts references, so that several sequences can share blocks (forks, prefixes).
A ``BlockTable`` maps one sequence's token positions onto its blocks; appending tokens only
allocates new blocks, it never copies the sequence's cache (except one partially filled block that
is shared, which is copied on write).
"""

from __future__ import annotations

from collections import deque


class OutOfBlocks(RuntimeError):
    """Raised when an allocation asks for more blocks than are free. Nothing was allocated."""


class BlockAllocator:
    """Free list + reference counts over ``num_blocks`` block ids."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (reference count 1 each), or raise ``OutOfBlocks``."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} KV blocks, {len(self._free)} of {self.num_blocks} free")
        ids = [self._free.popleft() for _ in range(n)]
        for b in ids:
            self._refs[b] = 1
        return ids

    def fork(self, ids: list[int]) -> list[int]:
        """Share ``ids`` with one more owner (reference count + 1 each)."""
        for b in ids:
            if self._refs[b] <= 0:
                raise ValueError(f"cannot share block {b}: it is not allocated")
        for b in ids:
            self._refs[b] += 1
        return list(ids)

    def free(self, ids: list[int]) -> None:
        """Drop one reference to each block; blocks nobody holds go back to the free list."""
        for b in ids:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} freed but not allocated (double free)")
        for b in ids:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def ref_count(self, block_id: int) -> int:
        return self._refs[block_id]


def slot_ids(blocks: list[int], block_size: int, start: int, end: int) -> list[int]:
    """Flat slot ids (block_id * block_size + offset) of positions ``start..end-1`` of a sequence
    whose block table is ``blocks``: where the KV cache keeps those positions' keys and values."""
    return [blocks[p // block_size] * block_size + p % block_size for p in range(start, end)]


class BlockTable:
    """The blocks of one sequence, in position order, and how many token slots are in use."""

    def __init__(self, block_size: int, blocks: list[int] | None = None, num_tokens: int = 0) -> None:
        self.block_size = block_size
        self.blocks: list[int] = list(blocks or [])
        self.num_tokens = num_tokens

    def blocks_needed(self, num_tokens: int) -> int:
        """How many more blocks holding ``num_tokens`` tokens in total would take."""
        need = -(-num_tokens // self.block_size)
        return max(0, need - len(self.blocks))

    def reserve(self, allocator: BlockAllocator, num_tokens: int) -> list[tuple[int, int]]:
        """Make room for ``num_tokens`` tokens in total; return copy-on-write ``(src, dst)`` pairs.

        The caller must copy each ``src`` block to ``dst`` in the KV cache before writing. Raises
        ``OutOfBlocks`` (having allocated nothing) when the blocks are not there.
        """
        copies: list[tuple[int, int]] = []
        idx, partial = divmod(self.num_tokens, self.block_size)  # the block the next token goes to
        cow = num_tokens > self.num_tokens and partial and allocator.ref_count(self.blocks[idx]) > 1
        extra = self.blocks_needed(num_tokens)
        if not allocator.can_allocate(extra + (1 if cow else 0)):
            raise OutOfBlocks(
                f"need {extra + (1 if cow else 0)} KV blocks, {allocator.num_free} free"
            )
        if cow:
            (new,) = allocator.allocate(1)
            copies.append((self.blocks[idx], new))
            allocator.free([self.blocks[idx]])
            self.blocks[idx] = new
        self.blocks.extend(allocator.allocate(extra))
        return copies

    def fork(self, allocator: BlockAllocator) -> "BlockTable":
        """A new table sharing the blocks that hold this one's tokens (prefix sharing); blocks
        reserved ahead of the tokens stay private to this table."""
        used = -(-self.num_tokens // self.block_size)
        return BlockTable(self.block_size, allocator.fork(self.blocks[:used]), self.num_tokens)

    def release(self, allocator: BlockAllocator) -> None:
        """Give every block back; the table is empty afterwards."""
        allocator.free(self.blocks)
        self.blocks = []
        self.num_tokens = 0
