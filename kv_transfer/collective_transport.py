"""KV transport over a torch collective: point-to-point send/recv in a process group per pair.

Backend ``nccl`` when the KV lives on CUDA devices, ``gloo`` when it lives on CPU; the code path
is the same. Control stays on the gRPC stream of the gRPC transport (one stream per request:
headers with layer range, block ids, dtype, shape, checksum, tag; the last frame with token #1;
one acknowledgement), and only tensor bytes go over the process group. So ordering, integrity
checks, deadlines and leases are exactly the gRPC transport's, and the same tests apply; so is
the cluster secret's MAC on every header, the ``join`` included (``auth``).

A piece (``[2, layers, blocks, ...]``) goes by two sends, its keys and its values, each straight
from the caller's tensor when it is contiguous (a layer range of a ``[2, layers, ...]`` tensor is:
no copy at all), else from one packed copy in a reused staging buffer. The checksum is the one of
the whole piece, streamed over the two halves.

Receives posted ahead (gloo): the data of a piece must never wait for its header. Each transfer
owns a range of tags (frame ``i``'s keys and values go with tags ``base + 2i`` and ``base + 2i + 1``),
so once the first header names the range, the decode side keeps ``RECV_AHEAD`` frames' receives
posted for the frames to come, into reused slots of ``SLOT_BYTES`` (keys in the first half,
values in the second; no frame is larger, and gloo lands a smaller send in a larger receive). A
piece then streams over the group as soon as the sender posts it, while its header is still on the
control stream; the header only has to arrive before the verified piece is written. At ``finish``
the sender matches the receives posted beyond the last frame with empty sends, so no receive is
left dangling. NCCL needs the exact size of every receive, so on NCCL the receives of a piece are
posted when its header arrives (``post_ahead=False``, which tests also run over gloo).

Groups: each decode actor hosts a ``TCPStore`` for rendezvous. A prefill actor that first sends
to a decode actor creates a two-rank group with it (prefill rank 1, decode rank 0) under a fresh
store prefix, by sending a ``join`` control frame while it joins itself; both sides block until
the group is up (bounded by a timeout). A group that saw a failure (a timeout, a dead peer) is
dropped and the next transfer builds a new one under a new prefix, so a restarted or replaced
actor never reuses a broken group. Every wait is bounded.

Why not Ray's own tensor transports: Ray's collective utilities and its direct-tensor transport
move whole objects between actor method calls; here the decode side must land each piece in
blocks it reserved, in the order the control stream names, while the prefill side is still
computing later layers, so a plain two-rank torch process group with tags fits with less
machinery, and it is the same NCCL/gloo code vLLM-style connectors use.
"""

from __future__ import annotations

import collections
import datetime
import itertools
import logging
import queue
import threading
import uuid

import grpc
import torch
import torch.distributed as dist
import xxhash

from pdserve.kv_transfer.auth import KVAuth
from pdserve.kv_transfer.base import KVReceiver, KVSender, KVSink, Transfer, TransferError, TransferState
from pdserve.kv_transfer.grpc_transport import MAX_FRAME_BYTES, GrpcKVReceiver, GrpcKVSender, GrpcTransfer
from pdserve.kv_transfer.landing import LAND_DEPTH
from pdserve.kv_transfer.wire import DTYPES, FrameHeader, checksum

logger = logging.getLogger(__name__)

RECV_AHEAD = 4  # receives a decode-side stream keeps posted ahead of its headers (gloo)
SLOT_BYTES = MAX_FRAME_BYTES  # the size of each of them: no frame is larger
HALF_BYTES = SLOT_BYTES // 2  # a slot's keys land in its first half, its values in the second
TAGS_PER_TRANSFER = 1 << 16  # a transfer's tag range: frame i's keys and values go with tags base + 2i, +1
_TRANSFER_RANGES = 1 << 15  # tag ranges of a group before they wrap (2**31 tags in all)
_EMPTY = torch.empty(0, dtype=torch.uint8)  # what the sends that match spare receives carry
_STOP = object()  # ends a transfer's poster thread


def backend_for(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def _halves_checksum(k: torch.Tensor, v: torch.Tensor) -> int:
    """``wire.checksum`` of a piece from its two contiguous halves (keys, values), without joining
    them: XXH3-64 streamed over both on CPU; on CUDA the word sums add up."""
    if k.is_cuda:
        if (k.numel() * k.element_size()) % 4 == 0:
            return (checksum(k) + checksum(v)) & 0xFFFFFFFFFFFFFFFF
        return checksum(torch.cat([k.reshape(-1), v.reshape(-1)]))
    h = xxhash.xxh3_64()
    for half in (k, v):
        h.update(half.reshape(-1).view(torch.uint8).numpy())
    return h.intdigest()


def _new_group(store: dist.Store, prefix: str, rank: int, backend: str, timeout_s: float):
    prefixed = dist.PrefixStore(prefix, store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, 2, timeout)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(prefixed, rank, 2, opts)


class _Group:
    """A process group the decode side joined, with the posted receives of its failed streams.
    Those stay alive as long as the group object does (streams still running on it hold it): gloo
    may still land data in them, and data arriving for a receive that was dropped derails the
    pair for every later receive."""

    def __init__(self, name: str, pg) -> None:
        self.name = name
        self.pg = pg
        # (receives, buffers) of failed streams: no reference back here, so that a group is freed
        # when its last user lets go, never later by the garbage collector (a gloo group freed at
        # a random moment, say inside a fork, may hang joining its threads).
        self.parked: list[tuple] = []


class _StreamState:
    """What the collective receiver keeps for the control stream a thread serves."""

    __slots__ = ("group", "inbox", "ring")

    def __init__(self) -> None:
        self.group: _Group | None = None
        self.inbox: _Inbox | None = None
        self.ring: list | None = None


class _Inbox:
    """One control stream's receives posted ahead of its headers: frame ``i`` lands in
    ``bufs[i % RECV_AHEAD]``, keys in its first half (tag ``base + 2i``), values in its second
    (tag ``base + 2i + 1``). Frames ``0 .. RECV_AHEAD-1`` are posted when the
    first header names ``base``; each later one when the frame ``RECV_AHEAD`` before it (same buffer)
    is written, that is when the stream takes the next frame. So after ``F`` frames
    the receives of frames ``F .. F+RECV_AHEAD-2`` are spare: the sender matches them with empty
    sends at ``finish``, and ``drain`` waits for those before the buffers serve another stream."""

    def __init__(self, rid: str, group: _Group, base: int, bufs: list[torch.Tensor]) -> None:
        self.rid = rid
        self.group = group
        self.base = base
        self.bufs = bufs
        self.works: list = [None] * RECV_AHEAD
        self.posted = 0  # frames 0 .. posted-1 have a receive posted
        self.landed = 0  # frames 0 .. landed-1 were received and verified
        self.settled = False  # every receive it posted has completed: the buffers are free
        for _ in range(RECV_AHEAD):
            self.post_next()

    def post_next(self) -> None:
        j = self.posted % RECV_AHEAD
        buf, tag = self.bufs[j], self.base + 2 * self.posted
        pg = self.group.pg
        self.works[j] = (pg.recv([buf[:HALF_BYTES]], 1, tag), pg.recv([buf[HALF_BYTES:]], 1, tag + 1))
        self.posted += 1

    def view(self, i: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """Frame ``i`` as a ``[2, ...]`` tensor over its slot: keys at 0, values at ``HALF_BYTES``."""
        typed = self.bufs[i % RECV_AHEAD].view(dtype)
        inner = [1] * (len(shape) - 1)
        for d in range(len(shape) - 2, 0, -1):
            inner[d - 1] = inner[d] * shape[d + 1]
        return typed.as_strided(shape, (HALF_BYTES // dtype.itemsize, *inner))

    def drain(self, timeout: datetime.timedelta) -> None:
        """Wait for the spare receives (matched by the sender's empty sends)."""
        for f in range(self.landed, self.posted):
            for work in self.works[f % RECV_AHEAD]:
                work.wait(timeout)
        self.settled = True


class _SinkHooks:
    """The sink as the control stream sees it, so that the collective receiver learns when a stream
    ends (on the stream's own thread): ``complete_kv`` first waits for the stream's spare receives,
    ``fail_kv`` sets its buffers aside. Everything else is the sink's own (``open_kv`` only if it
    has one)."""

    def __init__(self, sink: KVSink, receiver: "CollectiveKVReceiver") -> None:
        self._sink = sink
        self._receiver = receiver

    def __getattr__(self, name: str):
        return getattr(self._sink, name)

    def write_kv(self, request_id: str, layers: range, block_ids: list[int], data: torch.Tensor) -> None:
        self._sink.write_kv(request_id, layers, block_ids, data)

    def complete_kv(self, request_id: str, first_token: int, first_logprob: float | None, transfer_s: float) -> None:
        self._receiver._stream_done(request_id)
        self._sink.complete_kv(request_id, first_token, first_logprob, transfer_s)

    def fail_kv(self, request_id: str, error: str) -> None:
        self._receiver._stream_failed(request_id)
        self._sink.fail_kv(request_id, error)


class CollectiveKVReceiver(KVReceiver):
    """Decode side: a gRPC control server plus a rendezvous store; pieces arrive by ``recv``.

    ``post_ahead`` (default: on gloo) keeps ``RECV_AHEAD`` receives posted ahead of the headers;
    otherwise (NCCL) each receive is posted, at its exact size, when its header arrives."""

    post_ahead: bool | None = None  # None: gloo posts ahead, NCCL does not (a test forces it)

    def __init__(self, sink: KVSink, host: str = "127.0.0.1", device: str | torch.device = "cpu",
                 timeout_s: float = 30.0, *, secret: bytes) -> None:
        self.device = torch.device(device)
        self.backend = backend_for(self.device)
        if self.post_ahead is None:
            self.post_ahead = self.backend == "gloo"
        self.timeout_s = timeout_s
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        self._groups: dict[str, _Group] = {}
        self._free: list[list[torch.Tensor]] = []  # receive buffers that ended streams gave back
        self._lock = threading.Lock()
        # Per control-stream thread (a stream is served by one thread at a time): the stream's
        # ``_Inbox`` (post_ahead), or a ring of ``LAND_DEPTH + 2`` receive buffers (NCCL). Buffers
        # are reused stream after stream (fresh ones would page-fault megabytes in every time).
        self._streams: dict[int, _StreamState] = {}  # by thread id; cleared by ``stop``
        self._grpc = GrpcKVReceiver(_SinkHooks(sink, self), host=host, fetch=self._fetch, on_join=self._join,
                                    timeout_s=timeout_s, secret=secret)
        self._host = host

    @property
    def address(self) -> str:
        # control (gRPC) address and rendezvous store address, in one string
        return f"{self._grpc.address}|{self._host}:{self._store.port}"

    def _join(self, h: FrameHeader) -> None:
        group = _Group(h.group, _new_group(self._store, h.store, 0, self.backend, self.timeout_s))
        sender = h.group.rsplit("-", 1)[0]
        with self._lock:
            # The sender builds a new group only after its previous one with us failed: drop those
            # (streams still running on one keep it alive until they end).
            for name in [n for n in self._groups if n.rsplit("-", 1)[0] == sender]:
                self._drop(name)
            self._groups[h.group] = group

    def _stream(self) -> _StreamState:
        with self._lock:
            return self._streams.setdefault(threading.get_ident(), _StreamState())

    def _drop(self, name: str) -> None:
        self._groups.pop(name, None)  # streams still running on it keep it (and its parked receives)

    def _check(self, h: FrameHeader) -> tuple[_Group, torch.dtype]:
        """The stream's group and the frame's dtype, after checking its shape and size. The group
        is looked up at the stream's first frame and kept: if it is dropped meanwhile (its sender
        rebuilt it after another stream failed), the streams that run on it still finish."""
        st = self._stream()
        if h.i == 0:
            with self._lock:
                st.group = self._groups.get(h.group)
            if st.group is None:
                raise ValueError(f"unknown process group {h.group!r} (the decode actor restarted?)")
        group = st.group
        if group is None or group.name != h.group:
            raise ValueError(f"frame {h.i} of {h.rid}: process group {h.group!r} is not its stream's")
        if h.dtype not in DTYPES:
            raise ValueError(f"frame {h.i} of {h.rid}: unknown dtype {h.dtype!r}")
        dtype = DTYPES[h.dtype]
        count = 1
        for d in h.shape:
            count *= d
        if count * dtype.itemsize != h.n:
            raise ValueError(f"frame {h.i} of {h.rid}: shape {h.shape} does not match {h.n} bytes")
        if not h.shape or h.shape[0] != 2:
            raise ValueError(f"frame {h.i} of {h.rid}: shape {h.shape} is not [2 (keys, values), ...]")
        return group, dtype

    def _fetch(self, h: FrameHeader, raw: None):
        """Take frame ``h``: with receives posted ahead, its verified data (the stream's thread
        writes it); on the receive-on-header path, the function that waits for it and verifies it
        (run by the stream's ``landing.Lander``, in frame order, while the stream's thread reads the next
        header and posts the next receives)."""
        group, dtype = self._check(h)
        if self.post_ahead:
            return self._fetch_posted(h, group, dtype)
        return self._fetch_on_header(h, group, dtype)

    def _fetch_posted(self, h: FrameHeader, group: _Group, dtype: torch.dtype):
        if h.n > SLOT_BYTES:
            raise ValueError(f"frame {h.i} of {h.rid}: {h.n} bytes, more than a receive slot ({SLOT_BYTES})")
        if h.i == 0:  # a new stream on this thread: post its receives ahead
            try:
                self._stream().inbox = _Inbox(h.rid, group, h.tag, self._buffers())
            except RuntimeError as exc:
                raise self._broken(h, exc) from None
        inbox = self._stream().inbox
        if inbox is None or inbox.rid != h.rid or inbox.group is not group:
            raise ValueError(f"frame {h.i} of {h.rid}: no receives posted for this stream")
        if h.tag != inbox.base + 2 * h.i:
            raise ValueError(f"frame {h.i} of {h.rid}: tag {h.tag}, expected {inbox.base + 2 * h.i}")
        # Landed here, on the stream's thread, in frame order: the data of the next frames keeps
        # arriving meanwhile into the receives posted ahead (gloo's own thread reads the socket),
        # so a landing thread of its own would only add a thread start and a hand-off per piece.
        if h.i > 0:  # frame i-1 is written: its buffer takes the receives of frame i-1+RECV_AHEAD
            try:
                inbox.post_next()
            except RuntimeError as exc:
                raise self._broken(h, exc) from None
        for work in inbox.works[h.i % RECV_AHEAD]:
            self._wait(h, work)
        inbox.landed = h.i + 1
        data = inbox.view(h.i, dtype, h.shape)
        self._verify(h, data[0], data[1])
        return data

    def _buffers(self) -> list[torch.Tensor]:
        """Receive buffers for a new stream: a set that an ended stream gave back, else fresh ones."""
        st = self._stream()
        prev, st.inbox = st.inbox, None
        if prev is not None:  # (a stream ends through ``_stream_done``/``_stream_failed``: not seen)
            self._park(prev)
        with self._lock:
            if self._free:
                return self._free.pop()
        return [torch.empty(SLOT_BYTES, dtype=torch.uint8, device=self.device) for _ in range(RECV_AHEAD)]

    PARKED_LIMIT = 4  # failed streams' receive buffers (16 MiB each) kept before groups are let go

    def _park(self, inbox: _Inbox) -> None:
        """Keep a failed stream's posted receives (and buffers) alive as long as their group. Its
        sender never sends over that group again (a failure makes it build a new one), so past
        ``PARKED_LIMIT`` the oldest such groups are let go (a sender that died never joins
        again to replace them)."""
        with self._lock:
            inbox.group.parked.append((inbox.works, inbox.bufs))
            failed = [g for g in self._groups.values() if g.parked]
            while sum(len(g.parked) for g in failed) > self.PARKED_LIMIT and failed:
                self._drop(failed.pop(0).name)

    def _stream_done(self, rid: str) -> None:
        """The stream's last frame arrived, every piece landed: wait for its spare receives."""
        st = self._stream()
        inbox = st.inbox
        if inbox is None or inbox.rid != rid or inbox.settled:
            return
        st.inbox = None
        try:
            inbox.drain(datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            with self._lock:
                self._drop(inbox.group.name)
            raise ValueError(f"{rid}: the receives after the last frame did not complete: {exc}") from None
        with self._lock:
            self._free.append(inbox.bufs)

    def _stream_failed(self, rid: str) -> None:
        st = self._stream()
        inbox = st.inbox
        if inbox is not None and inbox.rid == rid and not inbox.settled:
            st.inbox = None
            self._park(inbox)

    def _fetch_on_header(self, h: FrameHeader, group: _Group, dtype: torch.dtype):
        if h.i == 0:  # a new stream on this thread: a fresh ring (a failed stream's receives may
            self._stream().ring = [None] * (LAND_DEPTH + 2)  # still land in the old one)
        ring = self._stream().ring
        slot = h.i % len(ring)
        if ring[slot] is None or ring[slot].numel() < h.n:
            ring[slot] = torch.empty(h.n, dtype=torch.uint8, device=self.device)
        buf = ring[slot][:h.n].view(dtype).view(h.shape)
        try:
            works = [group.pg.recv([buf[0]], 1, h.tag), group.pg.recv([buf[1]], 1, h.tag + 1)]
        except RuntimeError as exc:
            raise self._broken(h, exc) from None

        def finish() -> torch.Tensor:
            for work in works:
                self._wait(h, work)
            self._verify(h, buf[0], buf[1])
            return buf

        return finish

    def _wait(self, h: FrameHeader, work) -> None:
        try:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            raise self._broken(h, exc) from None

    @staticmethod
    def _verify(h: FrameHeader, keys: torch.Tensor, values: torch.Tensor) -> None:
        got = _halves_checksum(keys, values)
        if got != h.crc:
            raise ValueError(f"frame {h.i} of {h.rid}: checksum mismatch ({got:#x} != {h.crc:#x})")

    def _broken(self, h: FrameHeader, exc: Exception) -> ValueError:
        with self._lock:
            self._drop(h.group)  # broken: the sender builds a new one
        return ValueError(f"frame {h.i} of {h.rid}: receive over {self.backend} failed: {exc}")

    def stop(self) -> None:
        self._grpc.stop()
        with self._lock:
            self._groups.clear()
            self._free.clear()
            self._streams.clear()


class _Pair:
    """The prefill side's process group with one decode actor."""

    def __init__(self, name: str, group, backend: str, post_ahead: bool) -> None:
        self.name = name
        self.group = group
        self.backend = backend
        self.post_ahead = post_ahead  # the decode side posts receives ahead: match its spare ones
        self.ranges = itertools.count()
        self.lock = threading.Lock()
        self.broken = False

    def next_base(self) -> int:
        """The first tag of a new transfer's range (ranges never overlap while in use: a group
        wraps only after 32,768 transfers, and one that saw a failure is not reused)."""
        with self.lock:
            return (next(self.ranges) % _TRANSFER_RANGES) * TAGS_PER_TRANSFER


class _StagingPool:
    """Packed staging buffers of ``SLOT_BYTES``, reused piece after piece and transfer after
    transfer: packing a strided piece into a fresh tensor page-faults its megabytes in every time,
    a copy into a buffer already in memory does not."""

    KEEP = 2 * RECV_AHEAD  # free buffers kept (more go back to the allocator)

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        if nbytes <= SLOT_BYTES:
            with self._lock:
                if self._free:
                    return self._free.pop()
        return torch.empty(max(nbytes, SLOT_BYTES), dtype=torch.uint8, device=self.device)

    def give(self, bufs: list[torch.Tensor]) -> None:
        with self._lock:
            for b in bufs:
                if b.numel() == SLOT_BYTES and len(self._free) < self.KEEP:
                    self._free.append(b)


class _Staged:
    """A packed piece on its way: its staging buffer, and its sends once the poster posted them."""

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.works: list = []
        self.posted = threading.Event()  # set when posted, or skipped (the transfer failed)


class CollectiveTransfer(GrpcTransfer):
    """A gRPC control stream whose frames carry headers only; the data goes by ``send``.

    The caller's thread checksums each piece (packing it first only when its keys or values are not
    contiguous); a thread of the transfer's own (the poster) then posts the piece's two sends and,
    right after them, queues its header, in frame order. gloo writes a piece into the socket inside
    ``send`` itself when the receiver's ``recv`` is already posted, so on
    the caller's thread those writes would stall the prefill compute and the next piece; on the
    poster they overlap both. (On CUDA the checksum reads back to the host, so a packed buffer is
    complete before the poster sees it.)"""

    STAGED = 2 * RECV_AHEAD  # packed pieces in flight; packing one more waits for the oldest's send

    def __init__(self, stub, request_id: str, timeout_s: float, pair: _Pair, staging: _StagingPool, *,
                 auth: KVAuth) -> None:
        self.pair = pair
        self._base = pair.next_base()  # frame i goes with tag base + i
        self._pool = staging
        self._staged: collections.deque[_Staged] = collections.deque()
        self._works: list = []
        self._send_error: str | None = None  # a send that failed (peer gone): ``finish`` reports it
        self._timeout_s = timeout_s
        self._posts: queue.Queue = queue.Queue()
        self._poster: threading.Thread | None = None
        super().__init__(stub, request_id, timeout_s, auth=auth)

    def _messages(self, i: int, layers: range, block_ids: list[int], data: torch.Tensor) -> list[bytes]:
        if self._send_error is not None:
            return []  # the transfer already failed: nothing more leaves
        nbytes = data.numel() * data.element_size()
        if self.pair.post_ahead and nbytes > SLOT_BYTES:  # one block of one layer above 4 MiB
            raise TransferError(f"frame {i} of {self.request_id}: {nbytes} bytes, more than the collective "
                                f"transport's receive slots ({SLOT_BYTES} bytes)")
        if 2 * (i + RECV_AHEAD) > TAGS_PER_TRANSFER:
            raise TransferError(f"{self.request_id}: more than {TAGS_PER_TRANSFER // 2 - RECV_AHEAD} frames in one transfer")
        if data.dim() == 0 or data.shape[0] != 2:
            raise TransferError(f"{self.request_id}: a piece is [2 (keys, values), layers, blocks, ...], not {tuple(data.shape)}")
        # The keys and the values go by one send each, straight from the caller's tensor when each
        # half is contiguous (a layer range of a [2, layers, ...] tensor, or a packed piece);
        # otherwise the piece is packed first, in one copy into a reused staging buffer.
        halves, staged = (data[0], data[1]), None
        if not (halves[0].is_contiguous() and halves[1].is_contiguous()):
            buf = self._staging_buffer(nbytes)
            if buf is None:
                return []  # a send before it failed: ``finish`` reports it
            staged = _Staged(buf)
            packed = buf[:nbytes].view(data.dtype).view(data.shape)
            packed.copy_(data)
            halves = (packed[0], packed[1])
            self._staged.append(staged)
        tag = self._base + 2 * i
        header = FrameHeader(self.request_id, i, (layers.start, layers.stop), list(block_ids),
                             str(data.dtype).removeprefix("torch."), tuple(data.shape), _halves_checksum(*halves),
                             nbytes, group=self.pair.name, tag=tag)
        self._auth.sign(header, self._nonce)
        if self._poster is None:
            self._poster = threading.Thread(target=self._post_loop, name=f"kv-post-{self.request_id}", daemon=True)
            self._poster.start()
        self._posts.put((header.pack(), halves, tag, staged))
        return []  # the poster queues the header once the sends are posted

    def _staging_buffer(self, nbytes: int) -> torch.Tensor | None:
        """A staging buffer for the next packed piece: from the pool while fewer than ``STAGED``
        are in flight, else the oldest one's, once its ``send`` completed (bounded by the
        transfer's timeout; ``None`` if it failed)."""
        if len(self._staged) < self.STAGED or nbytes > SLOT_BYTES:
            return self._pool.take(nbytes)
        oldest = self._staged.popleft()
        timeout = self._timeout_s
        if not oldest.posted.wait(timeout):
            self._send_error = self._send_error or f"posting the sends over {self.pair.backend} timed out"
        else:
            try:
                for work in oldest.works:
                    work.wait(datetime.timedelta(seconds=timeout))
            except Exception as exc:
                self._send_error = self._send_error or f"send over {self.pair.backend} failed: {exc}"
        if self._send_error is not None:
            self.pair.broken = True
            return None
        return oldest.buf

    def _post_loop(self) -> None:
        while True:
            item = self._posts.get()
            if item is _STOP:
                return
            self._post(*item)

    def _post(self, header: bytes, halves: tuple[torch.Tensor, torch.Tensor], tag: int,
              staged: _Staged | None = None) -> None:
        """Post the piece's two sends (keys, values), then queue its header (gloo: the decode side
        has its receives posted already, or posts them when the first header names the transfer's
        tags; NCCL: it posts them when it reads the header)."""
        try:
            if self._send_error is not None or self.state is TransferState.FAILED:
                return  # failed or aborted: nothing more leaves
            try:
                works = [self.pair.group.send([half], 0, tag + k) for k, half in enumerate(halves)]
            except Exception as exc:  # the peer is gone: ``send`` never raises, ``finish`` does
                self.pair.broken = True
                self._send_error = f"send over {self.pair.backend} failed: {exc}"
                return
            self._works.append((works, halves))
            if staged is not None:
                staged.works = works
            self._q.put(header)
        finally:
            if staged is not None:
                staged.posted.set()

    def _drain_posts(self) -> None:
        """Wait (bounded by the transfer's timeout) until every piece handed over is posted."""
        if self._poster is None:
            return
        self._posts.put(_STOP)
        self._poster.join(self._timeout_s)
        if self._poster.is_alive() and self._send_error is None:
            self._send_error = f"posting the sends over {self.pair.backend} timed out"

    def _match_spare_receives(self) -> None:
        """The decode side keeps receives posted beyond the last frame: match them with empty sends
        (before the last header goes, so they have completed when the decode side looks)."""
        if not self.pair.post_ahead or self._frames == 0 or self._send_error is not None:
            return
        try:
            first = self._base + 2 * self._frames
            for tag in range(first, first + 2 * (RECV_AHEAD - 1)):
                self._works.append((self.pair.group.send([_EMPTY], 0, tag), _EMPTY))
        except Exception as exc:
            self._send_error = f"send over {self.pair.backend} failed: {exc}"

    def finish(self, first_token: int, first_logprob: float | None = None) -> int:
        self._drain_posts()
        self._match_spare_receives()
        if self._send_error is not None:
            super().abort(self._send_error)
            self.pair.broken = True
            self._works.clear()
            raise TransferError(f"KV transfer of {self.request_id} failed: {self._send_error}")
        try:
            nbytes = super().finish(first_token, first_logprob)
        except TransferError:
            self.pair.broken = True  # unmatched sends may linger in this group: never reuse it
            raise
        finally:
            self._works.clear()
        # The decode side verified every piece: every send is complete, the buffers are free.
        self._pool.give([s.buf for s in self._staged])
        self._staged.clear()
        return nbytes

    def abort(self, reason: str = "aborted") -> None:
        self.pair.broken = True
        super().abort(reason)
        self._posts.put(_STOP)  # the poster drops what is left and ends


class CollectiveKVSender(KVSender):
    """Prefill side: one process group per decode actor, built on first use, rebuilt after failure."""

    name = "collective"
    post_ahead: bool | None = None  # as ``CollectiveKVReceiver.post_ahead``: both ends must agree

    def __init__(self, device: str | torch.device = "cpu", timeout_s: float = 30.0, *, secret: bytes) -> None:
        self.device = torch.device(device)
        self.backend = backend_for(self.device)
        self.timeout_s = timeout_s
        self._grpc = GrpcKVSender(secret=secret)
        self._pairs: dict[str, _Pair] = {}
        self._lock = threading.Lock()
        self._id = uuid.uuid4().hex[:12]
        self._staging = _StagingPool(self.device)
        self._epochs = itertools.count()

    def _pair(self, destination: str) -> _Pair:
        with self._lock:
            pair = self._pairs.get(destination)
            if pair is not None and not pair.broken:
                return pair
            control, store_addr = destination.split("|")
            host, port = store_addr.rsplit(":", 1)
            name = f"{self._id}-{next(self._epochs)}"
            store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=self.timeout_s))
            result: dict = {}

            def join_self() -> None:
                try:
                    result["group"] = _new_group(store, name, 1, self.backend, self.timeout_s)
                except Exception as exc:
                    result["error"] = exc

            t = threading.Thread(target=join_self, daemon=True)
            t.start()
            auth, nonce = self._grpc.auth, self._grpc.auth.new_nonce()
            join = FrameHeader("", 0, join=True, group=name, store=name)
            auth.sign(join, nonce)
            try:
                ack = self._grpc.stub(control)(iter([join.pack()]), timeout=self.timeout_s,
                                               metadata=auth.open_metadata("", nonce))
            except grpc.RpcError as exc:  # refused (another cluster's secret?) or unreachable
                raise TransferError(f"could not set up a {self.backend} group with {control}: "
                                    f"{exc.code().name}: {exc.details()}") from None
            t.join(self.timeout_s)
            if not ack.ok or "group" not in result:
                raise TransferError(f"could not set up a {self.backend} group with {control}: "
                                    f"{ack.error or result.get('error', 'timed out')}")
            post_ahead = self.post_ahead if self.post_ahead is not None else self.backend == "gloo"
            pair = _Pair(name, result["group"], self.backend, post_ahead)
            self._pairs[destination] = pair
            return pair

    def open(self, request_id: str, destination: str, num_layers: int, num_blocks: int, timeout_s: float) -> Transfer:
        if "|" not in destination:
            raise TransferError(f"{destination!r} is not a collective-transport address (gRPC|store)")
        try:
            pair = self._pair(destination)
        except TransferError:
            raise
        except Exception as exc:
            raise TransferError(f"could not reach {destination}: {exc}") from None
        control = destination.split("|")[0]
        return CollectiveTransfer(self._grpc.stub(control), request_id, timeout_s, pair, self._staging,
                                  auth=self._grpc.auth)

    def close(self) -> None:
        self._grpc.close()
        with self._lock:
            self._pairs.clear()
