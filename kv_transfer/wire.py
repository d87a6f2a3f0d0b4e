"""The wire format of KV pieces: a msgpack header plus the raw tensor bytes.

Header fields: ``rid`` (request id), ``i`` (frame index), ``layers`` ``[start, stop]``,
``blocks`` (destination block ids), ``dtype``, ``shape``, ``crc`` (checksum of the data: XXH3-64
on CPU, see ``checksum``), ``n`` (data length), ``inline`` (the data follows as the next message
of the stream). With the collective transport the data travels over a process group instead and
the header names the group and the send's tag. The last frame has ``last: true``, no data, the
number of frames sent before it (``frames``) and token #1 (``token``, ``logprob``). The receiver
checks the checksum, the length and the shape of every frame, and that no frame is missing.

Per piece the sender makes ONE copy (the strided layer/block view straight into the ``bytes`` that
go on the wire) and the receiver none before the write into the reserved blocks (the tensor is a
view of the received bytes).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import msgpack
import torch
import xxhash

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    inline: bool = False  # the piece's bytes follow as the stream's next message (gRPC transport)

    def pack(self) -> bytes:
        return msgpack.packb(self.__dict__, use_bin_type=True)

    @staticmethod
    def unpack(raw: bytes) -> "FrameHeader":
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


def checksum_bytes(raw) -> int:
    """Checksum of a bytes-like object: XXH3-64 (about 4x cheaper than CRC32 here, and a stronger
    check of random damage)."""
    return xxhash.xxh3_64_intdigest(raw)


def checksum(t: torch.Tensor) -> int:
    """Checksum of a tensor's bytes: on CPU ``checksum_bytes`` (no copy of a contiguous tensor); on
    CUDA a 64-bit sum of its 32-bit words computed on the device, so verifying never moves the data
    to the host."""
    t = t.detach().contiguous()
    if t.is_cuda:
        words = t.view(torch.int32) if (t.numel() * t.element_size()) % 4 == 0 else t.view(torch.uint8)
        return int(words.sum(dtype=torch.int64).item()) & 0xFFFFFFFFFFFFFFFF
    return checksum_bytes(t.view(torch.uint8).numpy())


def encode_piece(rid: str, i: int, layers: range, blocks: list[int], data: torch.Tensor) -> tuple[FrameHeader, bytes]:
    raw = tensor_to_bytes(data)
    dtype = str(data.dtype).removeprefix("torch.")
    header = FrameHeader(rid, i, (layers.start, layers.stop), list(blocks), dtype, tuple(data.shape),
                         checksum_bytes(raw), len(raw), inline=True)
    return header, raw


def decode_piece(header: FrameHeader, raw: bytes | memoryview) -> torch.Tensor:
    """Verify and rebuild a piece's tensor; raises ``ValueError`` naming what is wrong."""
    if len(raw) != header.n:
        raise ValueError(f"frame {header.i} of {header.rid}: {len(raw)} bytes, header says {header.n}")
    crc = checksum_bytes(raw)
    if crc != header.crc:
        raise ValueError(f"frame {header.i} of {header.rid}: checksum mismatch ({crc:#x} != {header.crc:#x})")
    if header.dtype not in _DTYPES:
        raise ValueError(f"frame {header.i} of {header.rid}: unknown dtype {header.dtype!r}")
    dtype = _DTYPES[header.dtype]
    count = 1
    for s in header.shape:
        count *= s
    if count * torch.finfo(dtype).bits // 8 != header.n:
        raise ValueError(f"frame {header.i} of {header.rid}: shape {header.shape} does not match {header.n} bytes")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffer: we only read it (the sink copies)
        t = torch.frombuffer(raw, dtype=dtype) if header.n else torch.empty(0, dtype=dtype)
    return t.view(header.shape)
