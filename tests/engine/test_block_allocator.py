"""BlockAllocator and BlockTable: the bookkeeping of the paged KV pool.

A seeded random walk of thousands of operations checks the invariants after every step; the
edge cases (exhaustion, double free, copy on write) have their own tests.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pdserve.engine.block_allocator import BlockAllocator, BlockTable, OutOfBlocks, slot_ids

BLOCK_SIZE = 4


def check_invariants(alloc: BlockAllocator, tables: list[BlockTable]) -> None:
    held = Counter(b for t in tables for b in t.blocks)
    free = list(alloc._free)
    assert len(free) == len(set(free)), "a block is on the free list twice"
    assert alloc.num_blocks - alloc.num_free == len(held), "used blocks != blocks some table holds"
    for b in range(alloc.num_blocks):
        assert alloc.ref_count(b) == held[b], f"block {b}: refcount {alloc.ref_count(b)}, held by {held[b]}"
        assert (b in held) != (b in free), f"block {b} is both free and held, or neither"
    for t in tables:
        assert len(t.blocks) >= -(-t.num_tokens // t.block_size), "a table holds fewer blocks than tokens need"


def test_random_operations_keep_invariants():
    rng = random.Random(1234)
    alloc = BlockAllocator(64)
    tables: list[BlockTable] = []
    counts = Counter()
    for _ in range(5000):
        op = rng.choice(["new", "append", "append", "append", "fork", "free"])
        if op == "new":
            n = rng.randint(0, 40)
            t = BlockTable(BLOCK_SIZE)
            free_before = alloc.num_free
            try:
                assert t.reserve(alloc, n) == []  # nothing shared yet, nothing to copy
            except OutOfBlocks:
                assert alloc.num_free == free_before and t.blocks == []
                counts["oob"] += 1
            else:
                t.num_tokens = n
                tables.append(t)
        elif op == "append" and tables:
            t = rng.choice(tables)
            n = t.num_tokens + rng.randint(1, 9)
            blocks_before, free_before = list(t.blocks), alloc.num_free
            refs_before = [alloc.ref_count(b) for b in range(alloc.num_blocks)]
            shared_partial = (t.num_tokens % BLOCK_SIZE != 0
                              and alloc.ref_count(t.blocks[-1]) > 1)
            try:
                copies = t.reserve(alloc, n)
            except OutOfBlocks:
                assert t.blocks == blocks_before and alloc.num_free == free_before
                assert [alloc.ref_count(b) for b in range(alloc.num_blocks)] == refs_before
                counts["oob"] += 1
            else:
                if shared_partial:
                    assert copies == [(blocks_before[-1], t.blocks[len(blocks_before) - 1])]
                    assert t.blocks[len(blocks_before) - 1] != blocks_before[-1]
                    counts["cow"] += 1
                else:
                    assert copies == []
                    assert t.blocks[: len(blocks_before)] == blocks_before
                assert writable(alloc, t, t.num_tokens, n), "a block about to be written is shared"
                t.num_tokens = n
        elif op == "fork" and tables:
            free_before = alloc.num_free
            tables.append(rng.choice(tables).fork(alloc))
            assert alloc.num_free == free_before  # sharing allocates nothing
            counts["fork"] += 1
        elif op == "free" and tables:
            tables.pop(rng.randrange(len(tables))).release(alloc)
            counts["free"] += 1
        check_invariants(alloc, tables)
    # the walk reached every interesting branch
    assert counts["oob"] > 10 and counts["cow"] > 10 and counts["fork"] > 100 and counts["free"] > 100
    for t in tables:
        t.release(alloc)
    check_invariants(alloc, [])
    assert alloc.num_free == alloc.num_blocks == 64


def test_exhaustion_raises_and_allocates_nothing():
    alloc = BlockAllocator(4)
    held = alloc.allocate(3)
    with pytest.raises(OutOfBlocks, match="asked for 2 KV blocks, 1 of 4 free"):
        alloc.allocate(2)
    assert alloc.num_free == 1 and sorted(b for b in range(4) if alloc.ref_count(b)) == sorted(held)
    table = BlockTable(BLOCK_SIZE)
    with pytest.raises(OutOfBlocks):
        table.reserve(alloc, 2 * BLOCK_SIZE)
    assert table.blocks == [] and alloc.num_free == 1
    assert alloc.allocate(1) and alloc.num_free == 0
    with pytest.raises(OutOfBlocks):
        alloc.allocate(1)


def test_reserve_counts_the_copy_on_write_block():
    """Appending to a shared partial block needs one block for the copy, plus the new ones."""
    alloc = BlockAllocator(3)
    a = BlockTable(BLOCK_SIZE)
    a.reserve(alloc, 5)  # 2 blocks, the second partial
    a.num_tokens = 5
    b = a.fork(alloc)
    # 1 free block: enough for a new block, not for the copy AND a new block
    with pytest.raises(OutOfBlocks):
        b.reserve(alloc, 9)
    assert alloc.num_free == 1 and b.blocks == a.blocks
    assert [alloc.ref_count(x) for x in a.blocks] == [2, 2]


def test_double_free_raises_and_changes_nothing():
    alloc = BlockAllocator(4)
    ids = alloc.allocate(2)
    alloc.free(ids)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(ids)
    assert alloc.num_free == 4
    x = alloc.allocate(1)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(x + [y for y in range(4) if y not in x][:1])  # one held, one free
    assert alloc.ref_count(x[0]) == 1  # the valid half was not freed either


def test_fork_of_unallocated_block_raises():
    alloc = BlockAllocator(2)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.fork([0])


def test_shared_blocks_return_only_when_the_last_holder_frees():
    alloc = BlockAllocator(4)
    a = BlockTable(BLOCK_SIZE)
    a.reserve(alloc, 8)
    a.num_tokens = 8
    b = a.fork(alloc)
    assert b.blocks == a.blocks and all(alloc.ref_count(x) == 2 for x in a.blocks)
    a.release(alloc)
    assert a.blocks == [] and alloc.num_free == alloc.num_blocks - 2
    b.release(alloc)
    assert alloc.num_free == alloc.num_blocks


def test_copy_on_write_of_a_shared_partial_last_block():
    alloc = BlockAllocator(8)
    a = BlockTable(BLOCK_SIZE)
    a.reserve(alloc, 6)
    a.num_tokens = 6
    b = a.fork(alloc)
    shared_last = a.blocks[-1]
    copies = b.reserve(alloc, 7)
    assert len(copies) == 1
    src, dst = copies[0]
    assert src == shared_last and dst == b.blocks[-1] and dst != shared_last
    assert b.blocks[0] == a.blocks[0]  # the full block stays shared
    assert alloc.ref_count(a.blocks[0]) == 2
    assert alloc.ref_count(shared_last) == 1 and alloc.ref_count(dst) == 1
    # a now holds its partial block alone: appending writes in place, no copy
    assert a.reserve(alloc, 7) == []


def test_no_copy_when_the_shared_last_block_is_full():
    alloc = BlockAllocator(8)
    a = BlockTable(BLOCK_SIZE)
    a.reserve(alloc, 8)
    a.num_tokens = 8
    b = a.fork(alloc)
    assert b.reserve(alloc, 9) == []
    assert b.blocks[:2] == a.blocks and len(b.blocks) == 3


def writable(alloc: BlockAllocator, table: BlockTable, start: int, end: int) -> bool:
    """Whether the blocks that positions ``start..end-1`` land in are held by this table alone."""
    bs = table.block_size
    return all(alloc.ref_count(table.blocks[p // bs]) == 1 for p in range(start, end))


def test_copy_on_write_when_blocks_were_reserved_ahead():
    alloc = BlockAllocator(8)
    a = BlockTable(BLOCK_SIZE)
    a.reserve(alloc, 12)  # room for 12 tokens reserved ahead (3 blocks)...
    a.num_tokens = 6  # ...but only 6 written: block 1 is partial, block 2 empty
    b = a.fork(alloc)
    for t in (b, a):
        t.reserve(alloc, 12)
        assert writable(alloc, t, 6, 12), f"blocks {t.blocks} refcounts {[alloc.ref_count(x) for x in t.blocks]}"


def test_slots_map_positions_through_the_table():
    blocks = [5, 2, 7]
    assert slot_ids(blocks, BLOCK_SIZE, 0, 3) == [20, 21, 22]
    assert slot_ids(blocks, BLOCK_SIZE, 3, 9) == [23, 8, 9, 10, 11, 28]


def test_blocks_needed():
    t = BlockTable(BLOCK_SIZE)
    assert [t.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    t.blocks = [0, 1]
    assert [t.blocks_needed(n) for n in (0, 8, 9)] == [0, 0, 1]


def test_allocator_rejects_bad_sizes():
    with pytest.raises(ValueError):
        BlockAllocator(0)
    with pytest.raises(ValueError):
        BlockAllocator(2).allocate(-1)
