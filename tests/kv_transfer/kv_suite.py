"""Helpers of the transport suite: a recording KV sink over a real ``KVCache``, random KV, bounded
waits, and fault injection into a transport's frames."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

from pdserve.engine.block_allocator import BlockAllocator
from pdserve.engine.kv_cache import KVCache
from pdserve.kv_transfer.auth import KVAuth
from pdserve.kv_transfer.wire import FrameHeader

# The cluster secret both ends of every transport under test hold (``kv_transfer.auth``).
SECRET = bytes.fromhex("5eed" * 16)

# ---- a KV sink over a real KVCache ---------------------------------------------------------------

SHAPE = dict(num_layers=4, block_size=4, num_kv_heads=2, head_dim=8)
SPACER_BLOCKS = 3


@dataclass
class RecordingSink:
    """A ``KVSink`` that lands pieces in a real ``KVCache`` and records what happened.

    Blocks are reserved per request (``reserve``); ``write_kv`` accepts only a request's own
    blocks; ``complete_kv`` checks that every (layer, block) pair arrived; ``fail_kv`` gives the
    blocks back. Transport threads call it, the test thread reads it: ``wait`` polls under a lock.
    """

    num_blocks: int = 64
    dtype: torch.dtype = torch.float32
    num_layers: int = SHAPE["num_layers"]
    block_size: int = SHAPE["block_size"]
    num_kv_heads: int = SHAPE["num_kv_heads"]
    head_dim: int = SHAPE["head_dim"]
    kv: KVCache = field(init=False, repr=False)
    allocator: BlockAllocator = field(init=False, repr=False)
    reserved: dict[str, list[int]] = field(default_factory=dict)
    covered: dict[str, set] = field(default_factory=dict)
    writes: list[tuple[str, range, list[int]]] = field(default_factory=list)
    completed: dict[str, tuple[int, float | None]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.kv = KVCache(self.num_layers, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim,
                          self.dtype)
        self.allocator = BlockAllocator(self.num_blocks)
        self.allocator.allocate(SPACER_BLOCKS)  # so that block ids differ from the sender's

    @property
    def free_blocks(self) -> int:
        with self.lock:
            return self.allocator.num_free

    def reserve(self, request_id: str, num_blocks: int) -> list[int]:
        with self.lock:
            ids = self.allocator.allocate(num_blocks)[::-1]  # not in order: ids are not positions
            self.reserved[request_id] = ids
            self.covered[request_id] = set()
            return ids

    def write_kv(self, request_id: str, layers: range, block_ids: list[int], data: torch.Tensor) -> None:
        with self.lock:
            if request_id not in self.reserved:
                raise KeyError(f"no reservation for {request_id!r}")
            if not set(block_ids) <= set(self.reserved[request_id]):
                raise ValueError(f"blocks {block_ids} are not reserved for {request_id!r}")
            self.kv.import_blocks(block_ids, layers, data)
            self.writes.append((request_id, layers, list(block_ids)))
            self.covered[request_id].update((layer, b) for layer in layers for b in block_ids)

    def complete_kv(self, request_id: str, first_token: int, first_logprob: float | None, transfer_s: float) -> None:
        with self.lock:
            if request_id not in self.reserved:
                raise KeyError(f"no reservation for {request_id!r}")
            want = self.num_layers * len(self.reserved[request_id])
            if len(self.covered[request_id]) != want:
                raise ValueError(f"incomplete KV: {len(self.covered[request_id])} of {want} layer-blocks")
            self.completed[request_id] = (first_token, first_logprob)

    def fail_kv(self, request_id: str, error: str) -> None:
        with self.lock:
            ids = self.reserved.pop(request_id, None)
            if ids is not None:
                self.allocator.free(ids)
            self.failed[request_id] = error

    def blocks_in_use(self, request_id: str) -> bool:
        with self.lock:
            return request_id in self.reserved

    def wait(self, cond: Callable[[], bool], timeout: float = 10.0) -> bool:
        deadline = time.time() + timeout
        while time.time() < deadline:
            with self.lock:
                if cond():
                    return True
            time.sleep(0.01)
        return False


def random_kv(num_layers: int, num_blocks: int, seed: int = 0, dtype=torch.float32, like=None) -> torch.Tensor:
    """``[2, num_layers, num_blocks, block_size, kv_heads, head_dim]`` of random values, in the
    geometry of ``like`` (a sink or a ``KVCache``; default ``SHAPE``)."""
    g = torch.Generator().manual_seed(seed)
    geo = (like.block_size, like.num_kv_heads, like.head_dim) if like is not None else (
        SHAPE["block_size"], SHAPE["num_kv_heads"], SHAPE["head_dim"])
    return torch.randn((2, num_layers, num_blocks, *geo), generator=g).to(dtype)


# ---- bounded waits -------------------------------------------------------------------------------

_pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="bounded")


def bounded(fn: Callable, timeout: float = 15.0):
    """Run ``fn()`` in a helper thread; fail the test (instead of hanging) if it takes longer."""
    fut = _pool.submit(fn)
    try:
        return fut.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        pytest.fail(f"{getattr(fn, '__name__', fn)} did not return within {timeout} s (a hang)")


# ---- fault injection -----------------------------------------------------------------------------


class Faults:
    """Damage a transport's frames on their way out, as a faulty network or peer would.

    Missing and reordered frames are made by renumbering data-frame headers (``FrameHeader.i``,
    the sender's data-frame counter from 0) just before the sender signs them, which every
    transport does through ``auth.KVAuth.sign`` (so the MAC holds: a faulty peer of this cluster,
    not a forger). Corruption flips a byte of a frame's data after its CRC was
    computed, by wrapping ``encode_piece`` in the transport's module, for transports whose data
    travels inside the frames (``data_in_frames``); for the others (the data goes over another
    channel) it flips a bit of the checksum in the header, which the receiver sees the same way:
    data that does not match its checksum.
    """

    def __init__(self, module, data_in_frames: bool, monkeypatch: pytest.MonkeyPatch) -> None:
        self.module = module
        self.data_in_frames = data_in_frames
        self.monkeypatch = monkeypatch

    def _on_pack(self, change: Callable[[FrameHeader], None]) -> None:
        original = KVAuth.sign

        def sign(auth: KVAuth, header: FrameHeader, nonce: bytes) -> None:
            if not header.last and not header.join:
                change(header)  # the header is the sender's, packed right after this
            original(auth, header, nonce)

        self.monkeypatch.setattr(KVAuth, "sign", sign)

    def corrupt(self, frame: int = 0, offset: int = 5) -> None:
        """Frame ``frame`` arrives with data that does not match its CRC."""
        if not self.data_in_frames:
            def flip_crc(h: FrameHeader) -> None:
                if h.i == frame:
                    h.crc ^= 1 << (offset % 32)

            self._on_pack(flip_crc)
            return
        original = self.module.encode_piece

        def encode_piece(*args, **kwargs):
            header, parts = original(*args, **kwargs)
            if header.i == frame:
                b = bytearray(b"".join(parts))
                b[offset] ^= 0xFF
                parts = [bytes(b)]
            return header, parts

        self.monkeypatch.setattr(self.module, "encode_piece", encode_piece)

    def drop(self, frame: int) -> None:
        """Frame ``frame`` never arrives: the receiver sees the frames after it one index early."""

        def change(h: FrameHeader) -> None:
            if h.i >= frame:
                h.i += 1

        self._on_pack(change)

    def swap(self, a: int, b: int) -> None:
        """Frames ``a`` and ``b`` arrive in each other's place (out of order)."""

        def change(h: FrameHeader) -> None:
            if h.i in (a, b):
                h.i = b if h.i == a else a

        self._on_pack(change)


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "the condition") -> None:
    """Poll ``predicate`` until it holds; fail the test after ``timeout`` seconds."""
    deadline = time.time() + timeout
    while not predicate():
        if time.time() >= deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


def lease_check(loop) -> None:
    """Return once the decode ``EngineLoop`` has checked its leases after this call began: the
    engine thread checks them after every batch of calls it runs, and the second call here runs
    in a later batch than the first."""
    loop.call(lambda: None)
    loop.call(lambda: None)


def is_open(loop, request_id: str) -> bool:
    """The decode side knows that a transfer stream for ``request_id`` opened."""
    return loop.call(lambda: request_id in loop.reserved and loop.reserved[request_id].opened)


def is_reserved(loop, request_id: str) -> bool:
    return loop.call(lambda: request_id in loop.reserved)


def pieces_written(loop, request_id: str) -> int:
    """Distinct (layer, block) pairs of ``request_id`` written so far; fails the test if its
    reservation was released meanwhile."""
    n = loop.call(lambda: loop.reserved[request_id].pieces if request_id in loop.reserved else None)
    assert n is not None, f"the reservation of {request_id} was released"
    return n


def wait_for_final(loop, request_id: str, timeout: float = 15.0):
    """The final ``RequestDelta`` of ``request_id`` from ``loop`` (fails the test after ``timeout``)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for d in loop.take_outputs(0.1):
            if d.request_id == request_id and d.finish_reason is not None:
                return d
    pytest.fail(f"no final delta for {request_id} within {timeout} s")


def wait_all_free(loop, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = loop.get_stats()
        if st.free_blocks == st.total_blocks:
            return
        time.sleep(0.05)
    st = loop.get_stats()
    pytest.fail(f"{st.total_blocks - st.free_blocks} blocks still in use after {timeout} s")
