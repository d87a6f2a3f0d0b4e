"""The wire format of KV pieces: a msgpack header plus the raw tensor bytes.

Header fields: ``rid`` (request id), ``i`` (frame index), ``layers`` ``[start, stop]``,
``blocks`` (destination block ids), ``dtype``, ``shape``, ``crc`` (checksum of the data: XXH3-64
on CPU, see ``checksum``), ``n`` (data length). On the gRPC stream a data frame is ONE message: a marker byte, the header's
length, the header, then the data (``frame_message`` / ``split_frame``). With the collective
transport the data travels over a process group instead, the message is the header alone, and the
header names the group and the send's tag. The last frame has ``last: true``, no data, the
number of frames sent before it (``frames``) and token #1 (``token``, ``logprob``). The receiver
checks the checksum, the length and the shape of every frame, and that no frame is missing. Every
header carries ``mac``, its HMAC under the cluster secret (``auth``), checked before anything else.

Per piece the sender makes ONE copy (the contiguous runs of the layer/block view, straight from the
KV cache into the message's ``bytes``, after the header) and the receiver none before the write
into the reserved blocks (the tensor is a view of the received message).
"""

from __future__ import annotations

import struct
import warnings
from dataclasses import dataclass, field

import msgpack
import torch
import xxhash

# The dtypes a piece may have, by the name a frame header gives them.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class FrameHeader:
    rid: str
    i: int
    layers: tuple[int, int] = (0, 0)
    blocks: list[int] = field(default_factory=list)
    dtype: str = "float32"
    shape: tuple[int, ...] = ()
    crc: int = 0
    n: int = 0
    last: bool = False
    frames: int = 0
    token: int = -1
    logprob: float | None = None
    # Collective transport: the data travels over the pair's process group, not in the frame.
    group: str = ""  # process group of the (prefill, decode) pair
    tag: int = 0  # point-to-point tag of this piece
    join: bool = False  # control frame: the decode side joins process group ``group``
    store: str = ""  # with ``join``: the rendezvous store prefix
    mac: bytes = b""  # HMAC of the other fields under the cluster secret (``auth.KVAuth.sign``)

    def pack(self) -> bytes:
        return msgpack.packb(self.__dict__, use_bin_type=True)

    @staticmethod
    def unpack(raw: bytes | memoryview) -> "FrameHeader":
        d = msgpack.unpackb(raw, raw=False)
        d["layers"] = tuple(d.get("layers", (0, 0)))
        d["shape"] = tuple(d.get("shape", ()))
        return FrameHeader(**d)


# Same-size integer views: numpy has no bfloat16, and an integer view keeps every bit pattern.
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensor_to_bytes(t: torch.Tensor) -> bytes:
    """The tensor's bytes in C order, in ONE copy even from a strided view (numpy's ``tobytes``
    walks the strides itself, so no ``contiguous()`` copy first)."""
    t = t.detach().cpu()
    return t.view(_INT_VIEW[t.element_size()]).numpy().tobytes()


_MAX_PARTS = 4096  # a view in more contiguous runs than this is copied whole first (never seen)


def contiguous_parts(t: torch.Tensor) -> list:
    """The tensor's bytes in C order as a list of contiguous byte buffers, without copying: a
    layer/block view of the KV cache is a few contiguous runs (one per key/value and layer, or
    fewer), so the frame's message is built from them in one copy."""
    t = t.detach().cpu()
    parts: list = []
    todo = [t]
    while todo:
        x = todo.pop()
        if x.is_contiguous() or x.dim() <= 1:
            if x.numel():
                x = x.contiguous().reshape(-1)  # no copy unless a strided 1-D view
                parts.append(memoryview(x.view(_INT_VIEW[x.element_size()]).numpy()).cast("B"))
        else:
            todo.extend(x[j] for j in range(x.shape[0] - 1, -1, -1))
        if len(parts) + len(todo) > _MAX_PARTS:
            return [tensor_to_bytes(t)]
    return parts


def checksum_bytes(raw) -> int:
    """Checksum of a bytes-like object: XXH3-64 (cheaper than CRC32, and a stronger check of
    random damage)."""
    return xxhash.xxh3_64_intdigest(raw)


def checksum_parts(parts) -> int:
    """``checksum_bytes`` of the concatenation of ``parts``, without concatenating them."""
    if len(parts) == 1:
        return checksum_bytes(parts[0])
    h = xxhash.xxh3_64()
    for p in parts:
        h.update(p)
    return h.intdigest()


def checksum(t: torch.Tensor) -> int:
    """Checksum of a tensor's bytes: on CPU ``checksum_bytes`` (no copy of a contiguous tensor); on
    CUDA a 64-bit sum of its 32-bit words computed on the device, so verifying never moves the data
    to the host."""
    t = t.detach().contiguous()
    if t.is_cuda:
        words = t.view(torch.int32) if (t.numel() * t.element_size()) % 4 == 0 else t.view(torch.uint8)
        return int(words.sum(dtype=torch.int64).item()) & 0xFFFFFFFFFFFFFFFF
    return checksum_bytes(t.view(torch.uint8).numpy())


def encode_piece(rid: str, i: int, layers: range, blocks: list[int], data: torch.Tensor) -> tuple[FrameHeader, list]:
    """The header of a piece and its bytes as contiguous buffers (views: nothing copied yet)."""
    parts = contiguous_parts(data)
    dtype = str(data.dtype).removeprefix("torch.")
    header = FrameHeader(rid, i, (layers.start, layers.stop), list(blocks), dtype, tuple(data.shape),
                         checksum_parts(parts), sum(len(p) for p in parts))
    return header, parts


# A data frame's message starts with this byte: 0xc1 is never the first byte of a msgpack object,
# so a message that is a bare msgpack header (the collective transport's frames) is told apart.
FRAME_MARK = 0xC1
_PREFIX = struct.Struct("<BI")  # the mark, the header's length


def frame_message(header: FrameHeader, parts) -> bytes:
    """One stream message holding a frame: mark, header length, header, then the data, built in
    one copy of ``parts`` (``bytes.join`` reads the buffers in place)."""
    packed = header.pack()
    return b"".join([_PREFIX.pack(FRAME_MARK, len(packed)), packed, *parts])


def split_frame(message: bytes) -> tuple[FrameHeader, memoryview | None]:
    """The header of a stream message and a view of its data (``None`` for a bare header)."""
    if not message or message[0] != FRAME_MARK:
        return FrameHeader.unpack(message), None
    if len(message) < _PREFIX.size:
        raise ValueError(f"a {len(message)}-byte message is too short to hold a frame")
    _, hlen = _PREFIX.unpack_from(message)
    view = memoryview(message)
    end = _PREFIX.size + hlen
    if end > len(message):
        raise ValueError(f"a frame's header claims {hlen} bytes; the message holds {len(message) - _PREFIX.size}")
    return FrameHeader.unpack(view[_PREFIX.size:end]), view[end:]


def decode_piece(header: FrameHeader, raw: bytes | memoryview | None) -> torch.Tensor:
    """Verify and rebuild a piece's tensor; raises ``ValueError`` naming what is wrong."""
    if raw is None:
        raise ValueError(f"frame {header.i} of {header.rid} carries no data")
    if len(raw) != header.n:
        raise ValueError(f"frame {header.i} of {header.rid}: {len(raw)} bytes, header says {header.n}")
    crc = checksum_bytes(raw)
    if crc != header.crc:
        raise ValueError(f"frame {header.i} of {header.rid}: checksum mismatch ({crc:#x} != {header.crc:#x})")
    if header.dtype not in DTYPES:
        raise ValueError(f"frame {header.i} of {header.rid}: unknown dtype {header.dtype!r}")
    dtype = DTYPES[header.dtype]
    count = 1
    for s in header.shape:
        count *= s
    if count * torch.finfo(dtype).bits // 8 != header.n:
        raise ValueError(f"frame {header.i} of {header.rid}: shape {header.shape} does not match {header.n} bytes")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffer: we only read it (the sink copies)
        t = torch.frombuffer(raw, dtype=dtype) if header.n else torch.empty(0, dtype=dtype)
    return t.view(header.shape)
