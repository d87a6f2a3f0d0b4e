"""The gRPC sender encodes frames a few ahead of the one gRPC is writing, on its encoder thread,
and never more: gRPC itself is replaced here by a slow consumer of the request iterator, so the
test sees exactly what the iterator hands out and when each frame was encoded."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import pytest
import torch

import pdserve.kv_transfer.grpc_transport as gt
from kv_suite import SECRET
from pdserve.kv_transfer.auth import KVAuth
from pdserve.kv_transfer.wire import FrameHeader, decode_piece, split_frame


class SlowConsumer:
    """Stands in for the ``Push`` stub: ``future(iterator)`` takes the messages one by one on a
    thread of its own, pausing after each, as gRPC does while it writes a frame."""

    def __init__(self, pause_s: float) -> None:
        self.pause_s = pause_s
        self.messages: list[bytes] = []
        self.taken_at: list[int] = []  # frames encoded so far, each time a message is taken

    def future(self, iterator, timeout=None, metadata=None):
        f: futures.Future = futures.Future()

        def run():
            for m in iterator:
                self.taken_at.append(ENCODED[0])
                self.messages.append(m)
                time.sleep(self.pause_s)
            f.set_result(None)

        threading.Thread(target=run, daemon=True).start()
        return f


ENCODED = [0]


@pytest.fixture
def counted_encode(monkeypatch):
    ENCODED[0] = 0
    real = gt._encode

    def encode(item):
        out = real(item)
        ENCODED[0] += 1
        return out

    monkeypatch.setattr(gt, "_encode", encode)


@pytest.mark.parametrize("threaded", [True, False], ids=["encoder thread", "no encoder"])
def test_frames_are_encoded_a_bounded_few_ahead_and_go_out_in_order(counted_encode, threaded):
    consumer = SlowConsumer(pause_s=0.02)
    encoder = futures.ThreadPoolExecutor(1) if threaded else None
    t = gt.GrpcTransfer(consumer, "req", timeout_s=10, encoder=encoder, auth=KVAuth(SECRET))
    data = torch.randn(2, 12, 3, 4, 2, 8)
    for lo in range(12):  # 12 one-layer pieces, all queued at once
        t.send(range(lo, lo + 1), [0, 1, 2], data[:, lo:lo + 1])
    last = FrameHeader("req", 12, last=True, frames=12, token=7)
    t._q.put(last.pack())
    t._q.put(gt._END)
    t._future.result(timeout=10)

    assert len(consumer.messages) == 13
    for i, m in enumerate(consumer.messages[:12]):  # in order, each intact
        h, raw = split_frame(m)
        assert (h.i, h.layers) == (i, (i, i + 1))
        assert torch.equal(decode_piece(h, raw), data[:, i:i + 1])
    assert split_frame(consumer.messages[12])[0] == FrameHeader.unpack(last.pack())
    # When gRPC takes frame k, at most LOOKAHEAD frames after it have been encoded (memory stays
    # bounded however many pieces are queued); with an encoder thread they were encoded ahead.
    for k, encoded in enumerate(consumer.taken_at[:12]):
        assert encoded <= k + 1 + gt.GrpcTransfer.LOOKAHEAD
    if threaded:
        assert any(encoded > k + 1 for k, encoded in enumerate(consumer.taken_at[:11]))
        encoder.shutdown()
