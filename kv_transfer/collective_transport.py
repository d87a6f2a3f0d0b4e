"""KV transport over a torch collective: point-to-point send/recv in a process group per pair.

Backend ``nccl`` when the KV lives on CUDA devices, ``gloo`` when it lives on CPU; the code path
is the same. Control stays on the gRPC stream of the gRPC transport (one stream per request:
headers with layer range, block ids, dtype, shape, checksum, tag; the last frame with token #1;
one acknowledgement), and only tensor bytes go over the process group. So ordering, integrity
checks, deadlines and leases are exactly the gRPC transport's, and the same tests apply.

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

import datetime
import itertools
import logging
import queue
import threading
import uuid

import torch
import torch.distributed as dist

from pdserve.kv_transfer.base import KVReceiver, KVSender, KVSink, Transfer, TransferError, TransferState
from pdserve.kv_transfer.grpc_transport import _END, GrpcKVReceiver, GrpcKVSender, GrpcTransfer, _Lander
from pdserve.kv_transfer.wire import _DTYPES, FrameHeader, checksum

logger = logging.getLogger(__name__)

_TAG_LIMIT = (1 << 31) - 1


def backend_for(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def _new_group(store: dist.Store, prefix: str, rank: int, backend: str, timeout_s: float):
    prefixed = dist.PrefixStore(prefix, store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, 2, timeout)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(prefixed, rank, 2, opts)


class CollectiveKVReceiver(KVReceiver):
    """Decode side: a gRPC control server plus a rendezvous store; pieces arrive by ``recv``."""

    def __init__(self, sink: KVSink, host: str = "127.0.0.1", device: str | torch.device = "cpu",
                 timeout_s: float = 30.0, land_depth: int = _Lander.DEPTH) -> None:
        self.device = torch.device(device)
        self.backend = backend_for(self.device)
        self.timeout_s = timeout_s
        self.land_depth = land_depth
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        self._groups: dict[str, object] = {}
        self._lock = threading.Lock()
        # Receive buffers per control stream (a stream is served by one thread): a ring of
        # ``_Lander.DEPTH + 2`` reused piece after piece, enough for every piece in flight or
        # waiting to land (a fresh buffer per piece would page-fault megabytes in every time).
        self._staging = threading.local()
        self._grpc = GrpcKVReceiver(sink, host=host, fetch=self._fetch, on_join=self._join, timeout_s=timeout_s,
                                    land_depth=land_depth)
        self._host = host

    @property
    def address(self) -> str:
        # control (gRPC) address and rendezvous store address, in one string
        return f"{self._grpc.address}|{self._host}:{self._store.port}"

    def _join(self, h: FrameHeader) -> None:
        group = _new_group(self._store, h.store, 0, self.backend, self.timeout_s)
        with self._lock:
            self._groups[h.group] = group

    def _fetch(self, h: FrameHeader, raw: None):
        """Post the receive of frame ``h`` now; return the function that waits for it and verifies
        it (run by the stream's ``_Lander`` while the next frame's receive is posted)."""
        with self._lock:
            group = self._groups.get(h.group)
        if group is None:
            raise ValueError(f"unknown process group {h.group!r} (the decode actor restarted?)")
        if h.dtype not in _DTYPES:
            raise ValueError(f"frame {h.i} of {h.rid}: unknown dtype {h.dtype!r}")
        dtype = _DTYPES[h.dtype]
        count = 1
        for d in h.shape:
            count *= d
        if count * dtype.itemsize != h.n:
            raise ValueError(f"frame {h.i} of {h.rid}: shape {h.shape} does not match {h.n} bytes")
        if h.i == 0:  # a new stream on this thread: a fresh ring (a failed stream's receives may
            self._staging.ring = [None] * (self.land_depth + 2)  # still land in the old one)
        ring = self._staging.ring
        slot = h.i % len(ring)
        if ring[slot] is None or ring[slot].numel() < h.n:
            ring[slot] = torch.empty(h.n, dtype=torch.uint8, device=self.device)
        buf = ring[slot][:h.n].view(dtype).view(h.shape)
        try:
            work = group.recv([buf], 1, h.tag)
        except RuntimeError as exc:
            raise self._broken(h, exc) from None

        def finish() -> torch.Tensor:
            try:
                work.wait(datetime.timedelta(seconds=self.timeout_s))
            except RuntimeError as exc:
                raise self._broken(h, exc) from None
            got = checksum(buf)
            if got != h.crc:
                raise ValueError(f"frame {h.i} of {h.rid}: checksum mismatch ({got:#x} != {h.crc:#x})")
            return buf

        return finish

    def _broken(self, h: FrameHeader, exc: Exception) -> ValueError:
        with self._lock:
            self._groups.pop(h.group, None)  # broken: the sender builds a new one
        return ValueError(f"frame {h.i} of {h.rid}: receive over {self.backend} failed: {exc}")

    def stop(self) -> None:
        self._grpc.stop()
        with self._lock:
            self._groups.clear()


class _Pair:
    """The prefill side's process group with one decode actor."""

    def __init__(self, name: str, group, backend: str) -> None:
        self.name = name
        self.group = group
        self.backend = backend
        self.tags = itertools.count(1)
        self.lock = threading.Lock()
        self.broken = False

    def next_tag(self) -> int:
        with self.lock:
            return next(self.tags) % _TAG_LIMIT


class CollectiveTransfer(GrpcTransfer):
    """A gRPC control stream whose frames carry headers only; the data goes by ``send``.

    The caller's thread packs each piece into its staging buffer and checksums it; a thread of the
    transfer's own (the poster) then posts the piece's ``send`` and, right after it, queues its
    header, in frame order. gloo writes a piece into the socket inside ``send`` itself when the
    receiver's ``recv`` is already posted (milliseconds per piece), so on the caller's thread those
    writes would stall the prefill compute and the packing of the next piece; on the poster they
    overlap both. (On CUDA the checksum reads the packed buffer back to the host, so the buffer is
    complete before the poster sees it.)"""

    post_on_thread = True  # False: post on the caller's thread (for A/B measurements only)

    def __init__(self, stub, request_id: str, timeout_s: float, pair: _Pair) -> None:
        self.pair = pair
        self._works: list = []
        self._send_error: str | None = None  # a send that failed (peer gone): ``finish`` reports it
        self._timeout_s = timeout_s
        self._posts: queue.Queue = queue.Queue()
        self._poster: threading.Thread | None = None
        super().__init__(stub, request_id, timeout_s)

    def _messages(self, i: int, layers: range, block_ids: list[int], data: torch.Tensor) -> list[bytes]:
        if self._send_error is not None:
            return []  # the transfer already failed: nothing more leaves
        data = data.contiguous()  # the one packed staging buffer of this piece (a copy of a strided view)
        tag = self.pair.next_tag()
        header = FrameHeader(self.request_id, i, (layers.start, layers.stop), list(block_ids),
                             str(data.dtype).removeprefix("torch."), tuple(data.shape), checksum(data),
                             data.numel() * data.element_size(), group=self.pair.name, tag=tag)
        if not self.post_on_thread:
            self._post(header.pack(), data, tag)
            return []
        if self._poster is None:
            self._poster = threading.Thread(target=self._post_loop, name=f"kv-post-{self.request_id}", daemon=True)
            self._poster.start()
        self._posts.put((header.pack(), data, tag))
        return []  # the poster queues the header once the send is posted

    def _post_loop(self) -> None:
        while True:
            item = self._posts.get()
            if item is _END:
                return
            self._post(*item)

    def _post(self, header: bytes, data: torch.Tensor, tag: int) -> None:
        """Post the piece's ``send``, then queue its header: the receiver posts the matching
        ``recv`` when it reads the header."""
        if self._send_error is not None or self.state is TransferState.FAILED:
            return  # failed or aborted: nothing more leaves
        try:
            self._works.append((self.pair.group.send([data], 0, tag), data))
        except Exception as exc:  # the peer is gone: ``send`` never raises, ``finish`` does
            self.pair.broken = True
            self._send_error = f"send over {self.pair.backend} failed: {exc}"
            return
        self._q.put(header)

    def _drain_posts(self) -> None:
        """Wait (bounded by the transfer's timeout) until every piece handed over is posted."""
        if self._poster is None:
            return
        self._posts.put(_END)
        self._poster.join(self._timeout_s)
        if self._poster.is_alive() and self._send_error is None:
            self._send_error = f"posting the sends over {self.pair.backend} timed out"

    def finish(self, first_token: int, first_logprob: float | None = None) -> int:
        self._drain_posts()
        if self._send_error is not None:
            super().abort(self._send_error)
            self.pair.broken = True
            self._works.clear()
            raise TransferError(f"KV transfer of {self.request_id} failed: {self._send_error}")
        try:
            return super().finish(first_token, first_logprob)
        except TransferError:
            self.pair.broken = True  # unmatched sends may linger in this group: never reuse it
            raise
        finally:
            self._works.clear()

    def abort(self, reason: str = "aborted") -> None:
        self.pair.broken = True
        super().abort(reason)
        self._posts.put(_END)  # the poster drops what is left and ends


class CollectiveKVSender(KVSender):
    """Prefill side: one process group per decode actor, built on first use, rebuilt after failure."""

    name = "collective"

    def __init__(self, device: str | torch.device = "cpu", timeout_s: float = 30.0) -> None:
        self.device = torch.device(device)
        self.backend = backend_for(self.device)
        self.timeout_s = timeout_s
        self._grpc = GrpcKVSender()
        self._pairs: dict[str, _Pair] = {}
        self._lock = threading.Lock()
        self._id = uuid.uuid4().hex[:12]
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
            ack = self._grpc._stub(control)(
                iter([FrameHeader("", 0, join=True, group=name, store=name).pack()]), timeout=self.timeout_s)
            t.join(self.timeout_s)
            if not ack.ok or "group" not in result:
                raise TransferError(f"could not set up a {self.backend} group with {control}: "
                                    f"{ack.error or result.get('error', 'timed out')}")
            pair = _Pair(name, result["group"], self.backend)
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
        return CollectiveTransfer(self._grpc._stub(control), request_id, timeout_s, pair)

    def close(self) -> None:
        self._grpc.close()
        with self._lock:
            self._pairs.clear()
