"""The collective transport's own mechanics, over gloo: receives posted ahead of the headers, the
spare receives matched at the end, keys and values sent without a copy, reused receive and staging
buffers, a fresh group after a failure, and the receive-on-header path that NCCL uses (run here
over gloo).

The transport contract itself (integrity, stalls, aborts, vanished peers) is ``test_transport.py``,
which runs against this transport too.
"""

from __future__ import annotations

import pytest
import torch

from kv_suite import SECRET, Faults, RecordingSink, bounded, random_kv
from pdserve.kv_transfer import collective_transport as ct
from pdserve.kv_transfer.base import TransferError

NUM_LAYERS = 4


@pytest.fixture
def ends():
    """Factory: ``ends(sink)`` -> (sender, receiver) over gloo, closed after the test."""
    made = []

    def make(sink):
        receiver = ct.CollectiveKVReceiver(sink, timeout_s=10.0, secret=SECRET)
        sender = ct.CollectiveKVSender(timeout_s=10.0, secret=SECRET)
        made.append((sender, receiver))
        return sender, receiver

    yield make
    for sender, receiver in made:
        sender.close()
        receiver.stop()


def push_views(sender, receiver, sink, rid: str, num_blocks: int, seed: int, group: int = 1,
               blocks: slice = slice(None)) -> torch.Tensor:
    """One transfer of VIEWS of a ``[2, layers, blocks, ...]`` tensor (strided, as the benchmark
    sends them): ``group`` layers per piece, the ``blocks`` of each; returns the data sent."""
    dest = sink.reserve(rid, num_blocks)
    data = random_kv(NUM_LAYERS, num_blocks, seed=seed)
    t = sender.open(rid, receiver.address, NUM_LAYERS, num_blocks, timeout_s=10)
    ids = list(range(num_blocks))[blocks]
    for lo in range(0, NUM_LAYERS, group):
        piece = data[:, lo:lo + group, blocks]
        assert not piece.is_contiguous()
        t.send(range(lo, lo + group), [dest[b] for b in ids], piece)
    if ids != list(range(num_blocks)):  # the other blocks, as one contiguous piece
        rest = [b for b in range(num_blocks) if b not in ids]
        t.send(range(0, NUM_LAYERS), [dest[b] for b in rest], data[:, :, rest])
    bounded(lambda: t.finish(7))
    assert sink.completed[rid] == (7, None)
    assert sink.kv.export_blocks(dest).equal(data)
    return data


def test_layer_range_views_go_without_a_copy_and_receive_buffers_are_reused(ends):
    """The keys and the values of a layer range of a ``[2, layers, ...]`` tensor are contiguous
    each: they are sent as they are (nothing packed), and the decode side reuses its buffers."""
    sink = RecordingSink(num_blocks=64)
    sender, receiver = ends(sink)
    push_views(sender, receiver, sink, "r0", 5, seed=0)
    assert not sender._staging._free, "nothing was packed"
    receiving = [[b.data_ptr() for b in bufs] for bufs in receiver._free]
    assert len(receiving) == 1, "the stream's receive buffers went back once its spare receives completed"
    for n in range(1, 4):
        push_views(sender, receiver, sink, f"r{n}", 5, seed=n)
    assert [[b.data_ptr() for b in bufs] for bufs in receiver._free] == receiving
    assert not any(g.parked for g in receiver._groups.values())


def test_pieces_with_strided_halves_are_packed_into_reused_staging_buffers(ends):
    sink = RecordingSink(num_blocks=64)
    sender, receiver = ends(sink)
    push_views(sender, receiver, sink, "p0", 6, seed=0, group=2, blocks=slice(1, 4))
    staging = {b.data_ptr() for b in sender._staging._free}
    assert staging, "the packed pieces' staging buffers went back to the pool"
    for n in range(1, 3):
        push_views(sender, receiver, sink, f"p{n}", 6, seed=n, group=2, blocks=slice(1, 4))
    assert {b.data_ptr() for b in sender._staging._free} == staging


def test_more_frames_than_receives_posted_ahead_and_pieces_of_every_size(ends):
    """Twelve frames (three times the receives posted ahead), of unequal sizes, arrive in order;
    then a transfer of a single frame on the same group."""
    sink = RecordingSink(num_blocks=64, num_layers=12)
    sender, receiver = ends(sink)
    dest = sink.reserve("long", 9)
    data = random_kv(12, 9, seed=4)
    t = sender.open("long", receiver.address, 12, 9, timeout_s=10)
    for layer in range(12):
        cut = 1 + layer % 8  # blocks 0..cut-1, then the rest: frames of different sizes
        t.send(range(layer, layer + 1), dest[:cut], data[:, layer:layer + 1, :cut])
        t.send(range(layer, layer + 1), dest[cut:], data[:, layer:layer + 1, cut:])
    bounded(lambda: t.finish(1))
    assert sink.kv.export_blocks(dest).equal(data)
    dest = sink.reserve("short", 2)
    one = random_kv(12, 2, seed=5)
    t = sender.open("short", receiver.address, 12, 2, timeout_s=10)
    t.send(range(0, 12), dest, one)
    bounded(lambda: t.finish(2))
    assert sink.kv.export_blocks(dest).equal(one)
    assert len(receiver._free) == 1


def test_after_a_failed_transfer_a_new_group_carries_the_next_one(ends, monkeypatch):
    sink = RecordingSink(num_blocks=64)
    sender, receiver = ends(sink)
    push_views(sender, receiver, sink, "before", 3, seed=1)
    first_group = next(iter(sender._pairs.values())).name
    Faults(ct, False, monkeypatch).corrupt(frame=1)
    dest = sink.reserve("bad", 3)
    data = random_kv(NUM_LAYERS, 3, seed=2)
    t = sender.open("bad", receiver.address, NUM_LAYERS, 3, timeout_s=10)
    for lo in range(NUM_LAYERS):
        t.send(range(lo, lo + 1), dest, data[:, lo:lo + 1])
    with pytest.raises(TransferError, match="checksum mismatch"):
        bounded(lambda: t.finish(1))
    assert "bad" in sink.failed and not sink.blocks_in_use("bad")
    monkeypatch.undo()
    push_views(sender, receiver, sink, "after", 3, seed=3)
    assert next(iter(sender._pairs.values())).name != first_group
    assert list(receiver._groups) == [next(iter(sender._pairs.values())).name], "the failed group was dropped"
    assert not any(g.parked for g in receiver._groups.values())


def test_the_receive_on_header_path_that_nccl_uses(ends, monkeypatch):
    """NCCL needs the exact size of every receive, so there the receive is posted when the header
    arrives: the same path, run over gloo."""
    monkeypatch.setattr(ct.CollectiveKVReceiver, "post_ahead", False)
    monkeypatch.setattr(ct.CollectiveKVSender, "post_ahead", False)
    sink = RecordingSink(num_blocks=64)
    sender, receiver = ends(sink)
    assert receiver.post_ahead is False
    for n in range(3):
        push_views(sender, receiver, sink, f"h{n}", 4, seed=n, group=2)
    assert not receiver._free, "no receives posted ahead on this path"


def test_a_frame_larger_than_a_receive_slot_is_refused_clearly(ends):
    """One block of one layer above the 4 MiB receive slot (a block of 1024 tokens x 8 KV heads x
    128, float32) cannot be split further: ``send`` says so instead of overflowing a receive."""
    sink = RecordingSink(num_blocks=4, num_layers=1, block_size=1024, num_kv_heads=8, head_dim=128)
    sender, receiver = ends(sink)
    dest = sink.reserve("wide", 1)
    data = random_kv(1, 1, seed=0, like=sink)
    assert data.numel() * 4 > ct.SLOT_BYTES
    t = sender.open("wide", receiver.address, 1, 1, timeout_s=10)
    with pytest.raises(TransferError, match="receive slots"):
        t.send(range(0, 1), dest, data)
    t.abort("refused")
    assert sink.wait(lambda: "wide" in sink.failed)
    assert not sink.blocks_in_use("wide")


def test_a_transfer_running_on_a_group_that_is_replaced_still_finishes(ends, monkeypatch):
    """Transfer B runs on the pair's group; another transfer on it fails, so the sender builds a new
    group for the next one (and the decode side drops the old one): B still finishes on the old."""
    sink = RecordingSink(num_blocks=64)
    sender, receiver = ends(sink)
    data_b = random_kv(NUM_LAYERS, 3, seed=1)
    dest_b = sink.reserve("B", 3)
    b = sender.open("B", receiver.address, NUM_LAYERS, 3, timeout_s=10)
    b.send(range(0, 1), dest_b, data_b[:, 0:1])
    assert sink.wait(lambda: len(sink.writes) == 1)
    faults = Faults(ct, False, monkeypatch)
    faults.corrupt(frame=0)
    dest_a = sink.reserve("A", 2)
    a = sender.open("A", receiver.address, NUM_LAYERS, 2, timeout_s=10)
    a.send(range(0, NUM_LAYERS), dest_a, random_kv(NUM_LAYERS, 2, seed=2))
    with pytest.raises(TransferError, match="checksum mismatch"):
        bounded(lambda: a.finish(1))
    monkeypatch.undo()
    push_views(sender, receiver, sink, "C", 2, seed=3)  # on a new group
    assert len(receiver._groups) == 1
    for lo in range(1, NUM_LAYERS):
        b.send(range(lo, lo + 1), dest_b, data_b[:, lo:lo + 1])
    bounded(lambda: b.finish(4))
    assert sink.kv.export_blocks(dest_b).equal(data_b)


def test_failed_streams_of_senders_that_never_return_do_not_pile_up(ends, monkeypatch):
    sink = RecordingSink(num_blocks=64)
    _, receiver = ends(sink)
    Faults(ct, False, monkeypatch).corrupt(frame=0)
    senders = [ct.CollectiveKVSender(timeout_s=10.0, secret=SECRET) for _ in range(receiver.PARKED_LIMIT + 2)]
    try:
        for n, sender in enumerate(senders):
            dest = sink.reserve(f"x{n}", 2)
            t = sender.open(f"x{n}", receiver.address, NUM_LAYERS, 2, timeout_s=10)
            t.send(range(0, NUM_LAYERS), dest, random_kv(NUM_LAYERS, 2, seed=n))
            with pytest.raises(TransferError):
                bounded(lambda: t.finish(1))
        assert sum(len(g.parked) for g in receiver._groups.values()) <= receiver.PARKED_LIMIT
        assert len(receiver._groups) < len(senders)
    finally:
        for sender in senders:
            sender.close()
