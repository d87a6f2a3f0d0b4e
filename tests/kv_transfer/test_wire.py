"""The gRPC stream's frame format: one message per frame (mark, header length, header, data)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kv_transfer.wire import (
    FrameHeader,
    checksum_bytes,
    contiguous_parts,
    decode_piece,
    encode_piece,
    frame_message,
    split_frame,
    tensor_to_bytes,
)


def kv(dtype: torch.dtype, layers: int = 5, blocks: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randn((2, layers, blocks, 4, 2, 8), generator=g).to(dtype)


VIEWS = {
    "contiguous": lambda t: t,
    "layer range": lambda t: t[:, 1:4],
    "layer and block range": lambda t: t[:, 2:5, 1:4],
    "one layer, one block": lambda t: t[:, 3:4, 5:6],
    "transposed (many runs)": lambda t: t.transpose(4, 5),
}


@pytest.mark.parametrize("view", list(VIEWS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_a_strided_view_travels_in_one_message_bit_exact(view, dtype):
    data = VIEWS[view](kv(dtype))
    parts = contiguous_parts(data)
    assert b"".join(parts) == tensor_to_bytes(data)  # the same bytes, in C order, nothing copied yet
    header, parts = encode_piece("req", 2, range(1, 1 + data.shape[1]), list(range(data.shape[2])), data)
    assert header.crc == checksum_bytes(tensor_to_bytes(data)) and header.n == data.numel() * data.element_size()
    h, raw = split_frame(frame_message(header, parts))
    assert (h.rid, h.i, h.shape, h.dtype) == ("req", 2, tuple(data.shape), str(dtype).removeprefix("torch."))
    got = decode_piece(h, raw)
    assert got.view(torch.uint8).equal(data.contiguous().view(torch.uint8))


def test_a_bare_header_message_has_no_data():
    h, raw = split_frame(FrameHeader("req", 3, last=True, frames=3, token=7).pack())
    assert raw is None and h.last and h.token == 7
    with pytest.raises(ValueError, match="frame 3 of req carries no data"):
        decode_piece(FrameHeader("req", 3, n=8), raw)


def test_damaged_messages_are_refused_with_a_reason():
    data = kv(torch.float32)[:, :1]
    header, parts = encode_piece("req", 0, range(0, 1), list(range(6)), data)
    message = frame_message(header, parts)
    with pytest.raises(ValueError, match="too short"):
        split_frame(message[:3])
    with pytest.raises(ValueError, match="header claims"):
        split_frame(message[:5] + message[5:9])
    h, raw = split_frame(message[:-4])  # data cut short
    with pytest.raises(ValueError, match=r"bytes, header says"):
        decode_piece(h, raw)
    flipped = bytearray(message)
    flipped[-1] ^= 0x01
    h, raw = split_frame(bytes(flipped))
    with pytest.raises(ValueError, match="checksum mismatch"):
        decode_piece(h, raw)


def test_the_grpc_sender_refuses_a_dtype_the_wire_cannot_carry_at_send():
    """Frames are encoded on gRPC's thread later, so ``send`` itself checks what it can: the error
    reaches the caller at once, not as a failed stream."""
    from pdserve.kv_transfer.base import TransferError
    from pdserve.kv_transfer.grpc_transport import GrpcKVSender

    sender = GrpcKVSender(secret=b"s" * 32)
    try:
        t = sender.open("req", "127.0.0.1:9", 1, 1, timeout_s=2)
        with pytest.raises(TransferError, match="dtype torch.int64 cannot be sent"):
            t.send(range(0, 1), [0], torch.zeros((2, 1, 1, 4, 2, 8), dtype=torch.int64))
        t.abort()
    finally:
        sender.close()
