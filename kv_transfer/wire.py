"""The wire format of KV pieces: a msgpack header plus the raw tensor bytes.

Header fields: ``rid`` (request id), ``i`` (frame index), ``layers`` ``[start, stop]``,
``blocks`` (destination block ids), ``dtype``, ``shape``, ``crc`` (CRC32 of the data), ``n``
(data length). With the collective transport the data travels over a process group instead and
the header names the group and the send's tag. The last frame has ``last: true``, no data, the number of frames sent before it
(``frames``) and token #1 (``token``, ``logprob``). The receiver checks the CRC, the length and the
shape of every frame, and that no frame is missing.
"""

from __future__ import annotations

import warnings
import zlib
from dataclasses import dataclass, field

import msgpack
import torch

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

    def pack(self) -> bytes:
        return msgpack.packb(self.__dict__, use_bin_type=True)

    @staticmethod
    def unpack(raw: bytes) -> "FrameHeader":
        d = msgpack.unpackb(raw, raw=False)
        d["layers"] = tuple(d.get("layers", (0, 0)))
        d["shape"] = tuple(d.get("shape", ()))
        return FrameHeader(**d)


def tensor_to_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def checksum(t: torch.Tensor) -> int:
    """CRC32 of a CPU tensor's bytes (no copy); on CUDA a 64-bit sum of its 32-bit words computed
    on the device, so verifying never moves the data to the host."""
    t = t.detach().contiguous()
    if t.is_cuda:
        words = t.view(torch.int32) if (t.numel() * t.element_size()) % 4 == 0 else t.view(torch.uint8)
        return int(words.sum(dtype=torch.int64).item()) & 0xFFFFFFFFFFFFFFFF
    return zlib.crc32(t.view(torch.uint8).numpy())


def encode_piece(rid: str, i: int, layers: range, blocks: list[int], data: torch.Tensor) -> tuple[FrameHeader, bytes]:
    raw = tensor_to_bytes(data)
    dtype = str(data.dtype).removeprefix("torch.")
    header = FrameHeader(rid, i, (layers.start, layers.stop), list(blocks), dtype, tuple(data.shape),
                         zlib.crc32(raw), len(raw))
    return header, raw


def decode_piece(header: FrameHeader, raw: bytes | memoryview) -> torch.Tensor:
    """Verify and rebuild a piece's tensor; raises ``ValueError`` naming what is wrong."""
    if len(raw) != header.n:
        raise ValueError(f"frame {header.i} of {header.rid}: {len(raw)} bytes, header says {header.n}")
    crc = zlib.crc32(raw)
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
