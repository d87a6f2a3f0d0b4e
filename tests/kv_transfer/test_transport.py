"""The KV transport contract, checked against every transport.

Each test here takes the ``transport`` fixture and so runs once per entry of ``TRANSPORTS`` in
``conftest.py`` (today ``grpc`` and ``collective``). A new transport joins the suite with ONE line
there::

    "name": TransportSpec("pdserve.kv_transfer.module", make_sender, make_receiver, data_in_frames=...),

where ``make_sender()`` returns its ``KVSender`` and ``make_receiver(sink)`` its ``KVReceiver``
landing in ``sink``. Fault injection (``kv_suite.Faults``) renumbers frame headers as
``wire.FrameHeader.pack`` packs them (missing and reordered frames) and corrupts data after its
checksum was computed (``encode_piece`` wrapped in the transport's module when the bytes travel in
the frames, the header's checksum otherwise).

The contract, in the words of ``kv_transfer.base``: the prefill side opens a ``Transfer`` per
request and sends ``(layers, destination block ids, tensor)`` pieces; ``finish`` returns once the
decode side holds the whole KV, verified, or raises ``TransferError`` saying why. On any failure
the decode side's ``KVSink.fail_kv`` is called (or, when the receiver never learnt which request
it was, the decode worker's lease runs out) and the reserved blocks go back. Nothing waits
forever: every wait in these tests is bounded.
"""

from __future__ import annotations

import time

import pytest
import torch

from kv_suite import (
    RecordingSink,
    bounded,
    is_open,
    is_reserved,
    lease_check,
    pieces_written,
    random_kv,
    wait_all_free,
    wait_for_final,
    wait_until,
)
from pdserve.decode_worker.messages import WorkerRequest
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer.base import TransferError, TransferState

NUM_LAYERS = 4


def push(transfer, dest: list[int], data: torch.Tensor, pieces) -> None:
    """Send ``data`` (all layers, all blocks, in source order) as ``(layers, block slice)`` pieces."""
    for layers, blocks in pieces:
        transfer.send(layers, dest[blocks], data[:, layers.start:layers.stop, blocks].clone())


def whole(num_layers: int = NUM_LAYERS, group: int = 1):
    """Pieces of ``group`` layers x all blocks."""
    return [(range(lo, min(num_layers, lo + group)), slice(None)) for lo in range(0, num_layers, group)]


# ---- a round trip arrives bit-exact --------------------------------------------------------------

PIECE_PLANS = {
    "one piece": [(range(0, 4), slice(None))],
    "layer by layer": whole(group=1),
    "layer ranges x block subsets": [
        (range(0, 1), slice(0, 2)), (range(0, 1), slice(2, 6)),
        (range(1, 3), slice(0, 5)), (range(1, 3), slice(5, 6)),
        (range(3, 4), slice(4, 6)), (range(3, 4), slice(0, 4)),
    ],
    "chunk by chunk (blocks first, then layers)": [
        (range(lo, lo + 1), slice(b, b + 2)) for b in (0, 2, 4) for lo in range(4)
    ],
}


@pytest.mark.parametrize("plan", list(PIECE_PLANS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_round_trip_of_pieces_is_bit_exact(transport, plan, dtype):
    sink = RecordingSink(dtype=dtype)
    receiver = transport.make_receiver(sink)
    dest = sink.reserve("r", 6)
    data = random_kv(NUM_LAYERS, 6, seed=1, dtype=dtype)
    t = transport.sender.open("r", receiver.address, NUM_LAYERS, 6, timeout_s=10)
    assert t.state is TransferState.OPEN
    push(t, dest, data, PIECE_PLANS[plan])
    nbytes = bounded(lambda: t.finish(17, -0.25))
    assert t.state is TransferState.DONE
    assert nbytes == data.numel() * data.element_size()
    assert sink.completed["r"] == (17, -0.25)
    assert not sink.failed
    assert sink.kv.export_blocks(dest).view(torch.uint8).equal(data.view(torch.uint8))  # bit-exact
    # nothing outside the reserved blocks was touched
    others = [b for b in range(sink.num_blocks) if b not in dest]
    assert not sink.kv.export_blocks(others).any()


def test_concurrent_transfers_to_one_receiver_do_not_mix(transport, sink):
    receiver = transport.make_receiver(sink)
    reqs = {f"r{i}": (sink.reserve(f"r{i}", 3 + i), random_kv(NUM_LAYERS, 3 + i, seed=i)) for i in range(4)}
    transfers = {rid: transport.sender.open(rid, receiver.address, NUM_LAYERS, len(d), timeout_s=10)
                 for rid, (d, _) in reqs.items()}
    for layer in range(NUM_LAYERS):  # interleaved, as a prefill batch pushes them
        for rid, (dest, data) in reqs.items():
            push(transfers[rid], dest, data, [(range(layer, layer + 1), slice(None))])
    for i, (rid, t) in enumerate(transfers.items()):
        bounded(lambda: t.finish(i))
    for i, (rid, (dest, data)) in enumerate(reqs.items()):
        assert sink.completed[rid] == (i, None)
        assert sink.kv.export_blocks(dest).equal(data)


def test_first_token_only_needs_no_data_frames_but_must_cover_the_blocks(transport, sink):
    """A request whose KV did not all arrive is rejected, not started."""
    receiver = transport.make_receiver(sink)
    dest = sink.reserve("half", 4)
    data = random_kv(NUM_LAYERS, 4)
    t = transport.sender.open("half", receiver.address, NUM_LAYERS, 4, timeout_s=10)
    push(t, dest, data, whole()[:2])  # layers 0 and 1 only
    with pytest.raises(TransferError, match="incomplete"):
        bounded(lambda: t.finish(3))
    assert "half" not in sink.completed and "incomplete" in sink.failed["half"]
    assert not sink.blocks_in_use("half")


# ---- frame sizes and message limits --------------------------------------------------------------


def test_frames_of_a_few_megabytes_arrive_intact(transport):
    """A ~3 MB piece (the size the prefill worker groups layers into) crosses as one frame."""
    sink = RecordingSink(num_blocks=1600)
    receiver = transport.make_receiver(sink)
    dest = sink.reserve("big", 1500)
    data = random_kv(NUM_LAYERS, 1500, seed=2)
    assert 2.5e6 < data.numel() * 4 < 4e6
    t = transport.sender.open("big", receiver.address, NUM_LAYERS, 1500, timeout_s=30)
    push(t, dest, data, [(range(0, 4), slice(None))])
    bounded(lambda: t.finish(1), timeout=60)
    assert sink.kv.export_blocks(dest).equal(data)
    limit = getattr(transport.module, "MAX_FRAME_BYTES", None)
    if limit is not None and data.numel() * 4 <= limit:
        assert len(sink.writes) == 1, "a piece below the frame limit is sent as it is"


def test_a_piece_beyond_the_message_limit_is_split_and_arrives_exact(transport):
    """A piece larger than any one message may be (gRPC's 64 MiB here) still arrives: the transport
    splits it into frames under its limit (one layer x many blocks is what a long prompt chunk of
    a large model produces)."""
    sink = RecordingSink(num_blocks=620, num_layers=1, block_size=16, num_kv_heads=8, head_dim=128)
    receiver = transport.make_receiver(sink)
    dest = sink.reserve("huge", 600)
    data = random_kv(1, 600, seed=3, like=sink)
    message_limit = getattr(transport.module, "MAX_MESSAGE_BYTES", 64 << 20)
    assert data.numel() * 4 > message_limit
    t = transport.sender.open("huge", receiver.address, 1, 600, timeout_s=60)
    t.send(range(0, 1), dest, data)
    bounded(lambda: t.finish(1), timeout=120)
    assert sink.kv.export_blocks(dest).equal(data)
    frame_limit = getattr(transport.module, "MAX_FRAME_BYTES", message_limit)
    per_block = data[:, :, :1].numel() * 4
    assert all(len(blocks) * per_block <= frame_limit for _, _, blocks in sink.writes)


# ---- integrity: corrupted, missing and reordered frames ------------------------------------------


def test_a_corrupted_frame_is_detected_and_the_blocks_released(transport, sink, faults):
    faults.corrupt(frame=1)
    receiver = transport.make_receiver(sink)
    dest = sink.reserve("bad", 5)
    free_before = sink.free_blocks + 5
    t = transport.sender.open("bad", receiver.address, NUM_LAYERS, 5, timeout_s=10)
    push(t, dest, random_kv(NUM_LAYERS, 5), whole())
    with pytest.raises(TransferError, match="checksum"):
        bounded(lambda: t.finish(3))
    assert t.state is TransferState.FAILED
    assert "checksum" in sink.failed["bad"]
    assert "bad" not in sink.completed
    assert not sink.blocks_in_use("bad") and sink.free_blocks == free_before
    # the damaged frame never reached the cache: only frame 0 was written
    assert [w[1] for w in sink.writes] == [range(0, 1)]


@pytest.mark.parametrize("fault", ["drop first", "drop middle", "drop last", "swap"])
def test_a_missing_or_reordered_frame_is_detected(transport, sink, faults, fault):
    {"drop first": lambda: faults.drop(0), "drop middle": lambda: faults.drop(2),
     "drop last": lambda: faults.drop(3), "swap": lambda: faults.swap(1, 2)}[fault]()
    receiver = transport.make_receiver(sink)
    dest = sink.reserve("gap", 3)
    t = transport.sender.open("gap", receiver.address, NUM_LAYERS, 3, timeout_s=10)
    push(t, dest, random_kv(NUM_LAYERS, 3), whole())
    with pytest.raises(TransferError, match="frame"):
        bounded(lambda: t.finish(3))
    assert "frame" in sink.failed["gap"]
    assert "gap" not in sink.completed and not sink.blocks_in_use("gap")


def test_a_corrupted_frame_into_the_decode_worker_frees_its_blocks_and_ends_the_request(
        transport, faults, decode_loop):
    faults.corrupt(frame=0)
    loop = decode_loop()
    receiver = transport.make_receiver(loop)
    prompt = list(range(3, 22))  # 19 tokens: 5 blocks of 4
    dest = loop.reserve_kv(WorkerRequest("bad", prompt, SamplingParams(max_tokens=4, ignore_eos=True)))
    st = loop.get_stats()
    assert st.free_blocks == st.total_blocks - 5
    t = transport.sender.open("bad", receiver.address, 2, 5, timeout_s=10)
    push(t, dest, random_kv(2, 5, like=loop.runner.kv), whole(2))
    with pytest.raises(TransferError, match="checksum"):
        bounded(lambda: t.finish(7))
    final = wait_for_final(loop, "bad")
    assert final.finish_reason == "error" and "checksum" in final.error
    assert final.token_ids == []
    wait_all_free(loop)


def test_frames_into_the_decode_worker_arrive_exactly_and_start_decoding(transport, decode_loop):
    loop = decode_loop()
    receiver = transport.make_receiver(loop)
    prompt = list(range(3, 14))  # 11 tokens: 3 blocks
    dest = loop.reserve_kv(WorkerRequest("ok", prompt, SamplingParams(max_tokens=3, ignore_eos=True)))
    data = random_kv(2, 3, seed=5, like=loop.runner.kv)
    t = transport.sender.open("ok", receiver.address, 2, 3, timeout_s=10)
    # before finish: the KV is in the reserved blocks, bit-exact
    push(t, dest, data, whole(2))
    wait_until(lambda: pieces_written(loop, "ok") == 6, what="all 6 layer-blocks written")
    assert loop.runner.kv.export_blocks(dest).equal(data)
    bounded(lambda: t.finish(9))
    final = wait_for_final(loop, "ok")
    assert final.finish_reason == "length" and final.num_output_tokens == 3
    wait_all_free(loop)


def test_a_piece_sent_twice_does_not_make_up_for_a_missing_one(transport, decode_loop):
    """Coverage counts distinct (layer, block) pairs: a duplicate is not a substitute."""
    loop = decode_loop()
    receiver = transport.make_receiver(loop)
    dest = loop.reserve_kv(WorkerRequest("dup", list(range(3, 11)), SamplingParams(max_tokens=2)))  # 2 blocks
    data = random_kv(2, 2, like=loop.runner.kv)
    t = transport.sender.open("dup", receiver.address, 2, 2, timeout_s=10)
    push(t, dest, data, [(range(0, 1), slice(None)), (range(0, 1), slice(None))])  # layer 0 twice, no layer 1
    with pytest.raises(TransferError, match="incomplete"):
        bounded(lambda: t.finish(5))
    final = wait_for_final(loop, "dup")
    assert final.finish_reason == "error" and "incomplete" in final.error
    wait_all_free(loop)


def test_pieces_for_blocks_not_reserved_are_rejected(transport, sink):
    receiver = transport.make_receiver(sink)
    dest = sink.reserve("r", 2)
    t = transport.sender.open("r", receiver.address, NUM_LAYERS, 2, timeout_s=10)
    foreign = [b for b in range(sink.num_blocks) if b not in dest][:2]
    t.send(range(0, 4), foreign, random_kv(NUM_LAYERS, 2))
    with pytest.raises(TransferError, match="not reserved"):
        bounded(lambda: t.finish(1))
    assert not sink.blocks_in_use("r")


def test_a_request_without_reservation_is_rejected(transport, sink):
    receiver = transport.make_receiver(sink)
    t = transport.sender.open("nobody", receiver.address, NUM_LAYERS, 2, timeout_s=10)
    t.send(range(0, 4), [0, 1], random_kv(NUM_LAYERS, 2))
    with pytest.raises(TransferError, match="reservation"):
        bounded(lambda: t.finish(1))


# ---- deadlines and leases ------------------------------------------------------------------------


def test_a_stalled_transfer_is_released_by_the_lease_and_the_sender_times_out(transport, decode_loop):
    """A sender that opens, sends a piece and then neither finishes nor aborts (a hung prefill):
    the lease, which only pieces renew, frees the blocks; the sender's ``finish`` gives up."""
    loop = decode_loop(kv_lease_s=1.0)
    receiver = transport.make_receiver(loop)
    dest = loop.reserve_kv(WorkerRequest("stall", list(range(3, 11)), SamplingParams(max_tokens=2)))
    t = transport.sender.open("stall", receiver.address, 2, 2, timeout_s=1.0)
    push(t, dest, random_kv(2, 2, like=loop.runner.kv), [(range(0, 1), slice(None))])
    final = wait_for_final(loop, "stall", timeout=10)
    assert final.finish_reason == "error" and "lease" in final.error
    wait_all_free(loop)
    with pytest.raises(TransferError, match="timed out|failed|aborted"):
        bounded(lambda: t.finish(1))
    assert t.state is TransferState.FAILED


def test_a_long_transfer_has_no_deadline_of_its_own(transport, decode_loop):
    """A long prompt's prefill keeps its transfer open for longer than ``timeout_s``: as long as
    pieces keep coming, neither side gives up (the sender's timeout bounds only the wait for the
    acknowledgement after the last frame)."""
    loop = decode_loop(kv_lease_s=2.0)
    receiver = transport.make_receiver(loop)
    dest = loop.reserve_kv(WorkerRequest("long", list(range(3, 11)), SamplingParams(max_tokens=2, ignore_eos=True)))
    t = transport.sender.open("long", receiver.address, 2, 2, timeout_s=0.5)
    data = random_kv(2, 2, like=loop.runner.kv)
    for n, (layers, blocks) in enumerate([(range(lo, lo + 1), slice(b, b + 1)) for lo in range(2) for b in range(2)]):
        time.sleep(0.4)  # four pieces: 1.6 s in all, three times the sender's timeout_s
        push(t, dest, data, [(layers, blocks)])
        wait_until(lambda: pieces_written(loop, "long") == n + 1, what=f"piece {n} to land")
    bounded(lambda: t.finish(7))
    assert wait_for_final(loop, "long").finish_reason == "length"
    wait_all_free(loop)


def test_a_transfer_that_never_sends_is_released_by_the_lease(transport, decode_loop):
    """The sender opened the transfer and went silent (stream still open): the lease frees it."""
    loop = decode_loop(kv_lease_s=1.0)
    receiver = transport.make_receiver(loop)
    loop.reserve_kv(WorkerRequest("silent", list(range(3, 13)), SamplingParams(max_tokens=2)))
    t = transport.sender.open("silent", receiver.address, 2, 3, timeout_s=10)  # the lease comes first
    t0 = time.time()
    final = wait_for_final(loop, "silent", timeout=10)
    assert final.finish_reason == "error" and "lease" in final.error
    assert time.time() - t0 < 5
    wait_all_free(loop)
    with pytest.raises(TransferError):
        bounded(lambda: t.finish(1))


def test_the_lease_restarts_when_the_transfer_opens_so_a_queue_wait_does_not_eat_it(transport, decode_loop):
    """Blocks reserved, then the request waits in a prefill queue: until its transfer opens, the
    reservation's own deadline (kv_reserve_timeout_s) bounds it. The stream's opening restarts the
    deadline as a whole lease (kv_lease_s), so the transfer still runs after the reservation's
    deadline has passed and the engine has checked it."""
    loop = decode_loop(kv_reserve_timeout_s=2.0, kv_lease_s=30.0)
    receiver = transport.make_receiver(loop)
    dest = loop.reserve_kv(WorkerRequest("queued", list(range(3, 11)), SamplingParams(max_tokens=2, ignore_eos=True)))
    reservation_deadline = time.time() + 2.0  # no earlier than the decode side's
    time.sleep(0.5)  # in the prefill queue
    t = transport.sender.open("queued", receiver.address, 2, 2, timeout_s=30)
    wait_until(lambda: is_open(loop, "queued"), what="the stream to open on the decode side")
    wait_until(lambda: time.time() > reservation_deadline, timeout=5, what="the reservation's deadline")
    lease_check(loop)
    assert is_reserved(loop, "queued"), "the reservation's deadline released an open transfer"
    push(t, dest, random_kv(2, 2, like=loop.runner.kv), whole(2))
    bounded(lambda: t.finish(7))
    final = wait_for_final(loop, "queued")
    assert final.finish_reason == "length", final.error
    wait_all_free(loop)


def test_a_slow_transfer_that_keeps_making_progress_outlives_the_lease(transport, decode_loop):
    """The lease bounds stalls, not the whole transfer: every piece that lands renews it. Four
    pieces 0.7 s apart with a 2 s lease take longer than a lease after the stream opened, and
    still complete."""
    loop = decode_loop(kv_lease_s=2.0)
    receiver = transport.make_receiver(loop)
    dest = loop.reserve_kv(WorkerRequest("slow", list(range(3, 11)), SamplingParams(max_tokens=2, ignore_eos=True)))
    t = transport.sender.open("slow", receiver.address, 2, 2, timeout_s=30)
    wait_until(lambda: is_open(loop, "slow"), what="the stream to open on the decode side")
    lease_ends = time.time() + 2.0  # no earlier than the lease the opening started
    data = random_kv(2, 2, like=loop.runner.kv)
    for n, (layers, blocks) in enumerate([(range(lo, lo + 1), slice(b, b + 1)) for lo in range(2) for b in range(2)]):
        time.sleep(0.7)  # a slow sender
        push(t, dest, data, [(layers, blocks)])
        wait_until(lambda: pieces_written(loop, "slow") == n + 1, what=f"piece {n} to land")
    assert time.time() > lease_ends
    lease_check(loop)
    assert is_reserved(loop, "slow"), "the lease ran out although pieces kept arriving"
    bounded(lambda: t.finish(7))
    final = wait_for_final(loop, "slow")
    assert final.finish_reason == "length", final.error
    wait_all_free(loop)


def test_a_reservation_whose_transfer_never_opens_is_released_by_its_own_timeout(transport, decode_loop):
    """No prefill ever comes (a router lost in between): kv_reserve_timeout_s frees the blocks and
    the error names that setting."""
    loop = decode_loop(kv_reserve_timeout_s=0.5)
    transport.make_receiver(loop)
    loop.reserve_kv(WorkerRequest("orphan", list(range(3, 11)), SamplingParams(max_tokens=2)))
    final = wait_for_final(loop, "orphan", timeout=10)
    assert final.finish_reason == "error" and "kv_reserve_timeout_s" in final.error
    wait_all_free(loop)


# ---- abort ----------------------------------------------------------------------------------------


def test_abort_mid_transfer_releases_the_blocks_on_both_sides(transport, sink):
    receiver = transport.make_receiver(sink)
    dest = sink.reserve("ab", 4)
    t = transport.sender.open("ab", receiver.address, NUM_LAYERS, 4, timeout_s=10)
    data = random_kv(NUM_LAYERS, 4)
    push(t, dest, data, whole()[:2])
    assert sink.wait(lambda: len(sink.writes) == 2)
    t.abort("client cancelled")
    assert t.state is TransferState.FAILED
    assert sink.wait(lambda: "ab" in sink.failed, timeout=10), "the receiver did not learn of the abort"
    assert not sink.blocks_in_use("ab")
    with pytest.raises(TransferError):
        t.send(range(2, 3), dest, data[:, 2:3].clone())
    with pytest.raises(TransferError, match="abort"):
        bounded(lambda: t.finish(1))
    t.abort()  # idempotent


def test_a_sender_gone_before_its_first_piece_is_released_at_once_not_by_the_lease(transport, decode_loop):
    """The receiver knows the request from the moment the transfer opens: a prefill actor that
    dies (or aborts) before it computed a single block does not hold the blocks for a whole lease."""
    loop = decode_loop(kv_lease_s=60.0)
    receiver = transport.make_receiver(loop)
    loop.reserve_kv(WorkerRequest("early", list(range(3, 9)), SamplingParams(max_tokens=2)))
    t = transport.sender.open("early", receiver.address, 2, 2, timeout_s=30)
    wait_until(lambda: is_open(loop, "early"), what="the stream to open on the decode side")
    t0 = time.time()
    t.abort()
    with pytest.raises(TransferError):
        bounded(lambda: t.finish(1))
    final = wait_for_final(loop, "early", timeout=10)
    assert final.finish_reason == "error"
    wait_all_free(loop)
    assert time.time() - t0 < 5


# ---- the receiver goes away ------------------------------------------------------------------------


def test_a_receiver_that_is_gone_gives_a_clear_error_not_a_hang(transport, sink):
    receiver = transport.make_receiver(sink)
    address = receiver.address
    receiver.stop()
    dest = sink.reserve("orphan", 2)
    t0 = time.time()
    try:
        t = transport.sender.open("orphan", address, NUM_LAYERS, 2, timeout_s=5)
        t.send(range(0, 4), dest, random_kv(NUM_LAYERS, 2))
        with pytest.raises(TransferError) as info:
            bounded(lambda: t.finish(1))
        assert t.state is TransferState.FAILED
    except TransferError as exc:  # a transport may already refuse to open
        info = pytest.ExceptionInfo.from_exc_info((type(exc), exc, exc.__traceback__))
    message = str(info.value)
    assert "orphan" in message or address.split("|")[0] in message, "the error names the request or the peer"
    assert time.time() - t0 < 6


def test_a_receiver_stopping_mid_transfer_fails_it_on_both_sides(transport, sink):
    receiver = transport.make_receiver(sink)
    dest = sink.reserve("cut", 3)
    data = random_kv(NUM_LAYERS, 3)
    t = transport.sender.open("cut", receiver.address, NUM_LAYERS, 3, timeout_s=10)
    push(t, dest, data, whole()[:1])
    assert sink.wait(lambda: len(sink.writes) == 1)
    bounded(receiver.stop)
    assert sink.wait(lambda: "cut" in sink.failed, timeout=10)
    assert not sink.blocks_in_use("cut")
    push(t, dest, data, whole()[1:])
    with pytest.raises(TransferError):
        bounded(lambda: t.finish(1))
