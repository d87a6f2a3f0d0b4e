"""KVCache: the preallocated paged pool; export/import of blocks is how KV moves between actors."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.kv_cache import KVCache

LAYERS, BLOCKS, BS, KVH, D = 4, 10, 3, 2, 5


def filled_cache(seed: int = 0) -> KVCache:
    kv = KVCache(LAYERS, BLOCKS, BS, KVH, D)
    g = torch.Generator().manual_seed(seed)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g))
    return kv


def test_shapes_and_layer_slot_views():
    kv = KVCache(LAYERS, BLOCKS, BS, KVH, D)
    assert kv.k.shape == kv.v.shape == (LAYERS, BLOCKS, BS, KVH, D)
    k1, v1 = kv.layer_slots(1)
    assert k1.shape == (BLOCKS * BS, KVH, D)
    k1[2 * BS + 1] = 7.0  # slot = block * block_size + offset, and the view writes through
    assert torch.all(kv.k[1, 2, 1] == 7.0) and kv.k[0].abs().sum() == 0 and kv.k[2].abs().sum() == 0
    v1[0] = 1.0
    assert torch.all(kv.v[1, 0, 0] == 1.0)


def test_bytes_per_block():
    assert KVCache.bytes_per_block(LAYERS, BS, KVH, D, torch.float32) == 2 * LAYERS * BS * KVH * D * 4
    assert KVCache.bytes_per_block(LAYERS, BS, KVH, D, torch.bfloat16) == 2 * LAYERS * BS * KVH * D * 2


@pytest.mark.parametrize("layers", [None, range(0, 4), range(0, 2), range(2, 4), range(1, 2)])
def test_export_import_round_trips_per_layer_range(layers):
    src = filled_cache(0)
    dst = filled_cache(1)
    dst_before_k, dst_before_v = dst.k.clone(), dst.v.clone()
    src_ids, dst_ids = [7, 2, 4], [0, 9, 5]
    data = src.export_blocks(src_ids, layers)
    lr = layers if layers is not None else range(LAYERS)
    assert data.shape == (2, len(lr), len(src_ids), BS, KVH, D)
    dst.import_blocks(dst_ids, layers, data)
    for li in range(LAYERS):
        for s, d in zip(src_ids, dst_ids):
            if li in lr:
                assert torch.equal(dst.k[li, d], src.k[li, s]) and torch.equal(dst.v[li, d], src.v[li, s])
            else:  # layers outside the range are untouched
                assert torch.equal(dst.k[li, d], dst_before_k[li, d])
                assert torch.equal(dst.v[li, d], dst_before_v[li, d])
    untouched = [b for b in range(BLOCKS) if b not in dst_ids]
    assert torch.equal(dst.k[:, untouched], dst_before_k[:, untouched])
    assert torch.equal(dst.v[:, untouched], dst_before_v[:, untouched])


@pytest.mark.parametrize("ids", [[3, 4, 5, 6], [0, 1, 8, 9, 4], [9, 8, 7], list(range(BLOCKS)), []],
                         ids=["one run", "three runs", "descending", "whole pool", "none"])
def test_export_and_import_by_runs_of_consecutive_blocks_match_indexed_copies(ids, monkeypatch):
    """Runs of consecutive block ids are copied as slices; the result is the indexed copy's."""
    import pdserve.engine.kv_cache as kc

    src, layers = filled_cache(2), range(1, 3)
    idx = torch.tensor(ids, dtype=torch.long)
    want = torch.stack([src.k[1:3].index_select(1, idx), src.v[1:3].index_select(1, idx)])
    for max_runs in (kc._MAX_RUNS, 0):  # slices, then the indexed fallback for fragmented ids
        monkeypatch.setattr(kc, "_MAX_RUNS", max_runs)
        got = src.export_blocks(ids, layers)
        assert got.is_contiguous() and torch.equal(got, want)
        dst = KVCache(LAYERS, BLOCKS, BS, KVH, D)
        dst.import_blocks(ids, layers, want)
        assert torch.equal(dst.export_blocks(ids, layers), want)
        rest = [b for b in range(BLOCKS) if b not in ids]
        assert not dst.k[:, rest].any() and not dst.v[:, rest].any() and not dst.k[[0, 3]].any()


def test_export_is_a_copy():
    kv = filled_cache()
    data = kv.export_blocks([1, 3])
    before = data.clone()
    kv.k.zero_()
    kv.v.zero_()
    assert torch.equal(data, before)


def test_layer_by_layer_transfer_equals_whole_transfer():
    src = filled_cache(0)
    a, b = KVCache(LAYERS, BLOCKS, BS, KVH, D), KVCache(LAYERS, BLOCKS, BS, KVH, D)
    ids = [3, 8]
    a.import_blocks(ids, None, src.export_blocks(ids))
    for li in range(LAYERS):
        r = range(li, li + 1)
        b.import_blocks(ids, r, src.export_blocks(ids, r))
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


@pytest.mark.parametrize("shape_change", [
    (0, 1),  # not a k/v pair
    (1, 3),  # wrong number of layers for the range
    (2, 1),  # wrong number of blocks
    (3, BS + 1),  # wrong block size
    (4, KVH + 1),  # wrong head count
    (5, D - 1),  # wrong head dim
])
def test_import_reports_shape_errors(shape_change):
    kv = filled_cache()
    before = kv.k.clone()
    good = list(kv.export_blocks([0, 1], range(0, 2)).shape)
    dim, size = shape_change
    bad = list(good)
    bad[dim] = size
    with pytest.raises(ValueError) as e:
        kv.import_blocks([0, 1], range(0, 2), torch.zeros(bad))
    assert str(tuple(bad)) in str(e.value) and str(tuple(good)) in str(e.value)
    assert torch.equal(kv.k, before)


def test_import_converts_dtype():
    kv = filled_cache()
    data = kv.export_blocks([2]).to(torch.bfloat16)
    kv.import_blocks([5], None, data)
    assert kv.k.dtype == torch.float32
    assert torch.equal(kv.k[:, 5], data[0, :, 0].float())


def test_copy_blocks_copies_every_layer():
    kv = filled_cache()
    before_k, before_v = kv.k.clone(), kv.v.clone()
    kv.copy_blocks([(1, 6), (2, 7)])
    for src, dst in [(1, 6), (2, 7)]:
        assert torch.equal(kv.k[:, dst], before_k[:, src]) and torch.equal(kv.v[:, dst], before_v[:, src])
    others = [b for b in range(BLOCKS) if b not in (6, 7)]
    assert torch.equal(kv.k[:, others], before_k[:, others])
    assert torch.equal(kv.v[:, others], before_v[:, others])
    kv.k[:, 6] += 1  # a copy, not a view
    assert torch.equal(kv.k[:, 1], before_k[:, 1])
    kv.copy_blocks([])
