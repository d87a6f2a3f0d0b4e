"""KV transport over gRPC: one client stream of frames per request.

The decode actor runs a ``GrpcKVReceiver`` (a gRPC server on its own port); prefill actors open a
``Push`` stream to it per request, send frames of about 1-4 MB as layers are computed, and get one
acknowledgement at the end. Message size limits are explicit on both sides (a piece larger than
``MAX_FRAME_BYTES`` is split into several frames along its blocks, then its layers), every stream
has a deadline, and every frame's checksum is checked before its bytes touch the KV cache.

The stream's messages are raw bytes, not protobuf: a frame is ONE message, a short prefix, the
msgpack header, then the piece's bytes exactly as they land in the KV cache (``wire.frame_message``).
So the data is copied once on the sender (the contiguous runs of the layer/block view straight into
the message, in ``send``, on the caller's thread, overlapping the previous frame's trip through
gRPC) and not at all on the receiver before the write into the reserved blocks; protobuf would add
a copy on each side to build, serialize and parse a message around megabytes that it does not look
into. One message per frame, not a header message and a data message: grpcio moves one message at
a time per stream, each a hand-off between the caller's thread and gRPC's on both ends, so every
message saved is a round of thread hand-offs saved. Only the acknowledgement is a protobuf message
(``PushAck``).
"""

from __future__ import annotations

import collections
import ctypes
import logging
import queue
import sys
import threading
import time
from concurrent import futures

import grpc
import torch

from pdserve.internal import kv_transfer_pb2 as pb
from pdserve.kv_transfer.base import KVReceiver, KVSender, KVSink, Transfer, TransferError, TransferState
from pdserve.kv_transfer.wire import _DTYPES, FrameHeader, decode_piece, encode_piece, frame_message, split_frame

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20
MAX_FRAME_BYTES = 4 << 20  # larger pieces are split: well under the message limit, and streamed
# The sender's socket writes use MSG_ZEROCOPY where the kernel has it (the kernel then pins gRPC's
# own copy of a frame instead of copying it once more; it falls back to a plain send elsewhere):
# +6-8% for the push, alternated in one pair of actors on the loaded two-core machine.
_SENDER_OPTIONS = [("grpc.experimental.tcp_tx_zerocopy_enabled", 1)]
REQUEST_ID_KEY = "pdserve-request-id"  # call metadata: which request a Push stream carries
SERVICE = "pdserve.internal.KvTransfer"
PUSH_METHOD = f"/{SERVICE}/Push"  # client stream of raw-bytes messages -> PushAck
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


_malloc_tuned = False


def keep_frame_buffers() -> None:
    """Let this process's ``malloc`` reuse the megabyte buffers of frames instead of mapping fresh
    pages for every message (glibc only; once per process, idempotent).

    Every frame makes a few buffers of its size on each end (the message we build, gRPC's copy of
    it; gRPC's reassembly and ``bytes`` of it on the receiver). glibc serves blocks above its mmap
    threshold with a fresh ``mmap`` and returns them with ``munmap``, and trims free memory at the
    top of a heap, so each of those buffers page-faulted its pages in again (zeroed by the kernel):
    a sixth of the receiver's CPU per push in a profile. Above every frame size (at most 4 MiB plus
    a header) the threshold keeps them in the heap, and a larger trim threshold keeps the freed
    pages mapped for the next frame. Allocations above 8 MiB (the KV pool, weights) still get their
    own mappings; a process keeps at most about 32 MiB of free heap per malloc arena."""
    global _malloc_tuned
    if _malloc_tuned or not sys.platform.startswith("linux"):
        return
    _malloc_tuned = True
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
        libc.mallopt(m_mmap_threshold, 2 * MAX_FRAME_BYTES)
        libc.mallopt(m_trim_threshold, 32 << 20)
    except (OSError, AttributeError):  # not glibc (musl, ...): keep its defaults
        logger.debug("mallopt unavailable; frame buffers use the allocator's defaults")


class _Lander:
    """Lands pieces whose receive is still in flight, in frame order, on a thread of its own, so
    that the stream's thread meanwhile reads the next header and posts the next receive (the
    collective transport). At most ``depth`` pieces wait here; every wait is bounded."""

    DEPTH = 2

    def __init__(self, sink: KVSink, rid: str, timeout_s: float, depth: int = DEPTH) -> None:
        self.depth = depth
        self.sink = sink
        self.rid = rid
        self.timeout_s = timeout_s
        self.error: str | None = None
        self.nbytes = 0
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"kv-land-{rid}", daemon=True)
        self._thread.start()

    def put(self, h: FrameHeader, finish) -> None:
        if self.error is not None:
            raise ValueError(self.error)
        try:
            self._q.put((h, finish), timeout=self.timeout_s)
        except queue.Full:
            raise ValueError(f"frame {h.i} of {self.rid}: landing the pieces before it timed out") from None

    def _run(self) -> None:
        while not (self._closed and self._q.empty()):
            try:
                item = self._q.get(timeout=0.2)
            except queue.Empty:
                continue
            if item is None:  # close(): wakes an idle thread at once
                continue
            h, finish = item
            if self.error is not None:
                continue  # failed: drop the rest
            try:
                data = finish()  # waits for the receive and verifies it
                self.sink.write_kv(self.rid, range(*h.layers), list(h.blocks), data)
                self.nbytes += h.n
            except Exception as exc:
                self.error = str(exc)

    def close(self) -> None:
        """Land every queued piece; raise the first failure."""
        self._closed = True
        try:  # an idle thread would otherwise notice only at its next poll (up to 0.2 s later)
            self._q.put(None, timeout=self.timeout_s)
        except queue.Full:
            pass
        self._thread.join(self.timeout_s * (self.depth + 1))
        if self._thread.is_alive():
            self.error = self.error or "landing the last pieces timed out"
        if self.error is not None:
            raise ValueError(self.error)

    def abandon(self) -> None:
        self.error = self.error or "the stream failed"
        self._closed = True


class _Servicer:
    """Lands frames into a sink. ``fetch(header, data)`` returns a piece's verified tensor (from the
    data that the frame's message carries, by default), or a function that waits for it and verifies it
    (the collective transport: its headers have no data message, the bytes come from a process
    group, and a ``_Lander`` writes them while the next receive is already posted).
    ``on_join(header)`` answers control frames that set up a process group.

    The gRPC transport verifies and writes each piece on the stream's thread: handing that to a
    ``_Lander`` thread as well measured slower here (0.24 against 0.30 of raw TCP, alternated in
    one process on the loaded two-core machine), the extra thread competing for the GIL and the
    CPU with gRPC's own threads."""

    def __init__(self, sink: KVSink, fetch=None, on_join=None, timeout_s: float = 30.0,
                 land_depth: int = _Lander.DEPTH) -> None:
        self.land_depth = land_depth
        self.sink = sink
        self.fetch = fetch or decode_piece
        self.on_join = on_join
        self.timeout_s = timeout_s

    def Push(self, request_iterator, context):
        # The request id travels in the call's metadata too, so that a stream cancelled before its
        # first frame (a prefill actor that died early) still releases the request's blocks at once.
        rid = dict(context.invocation_metadata()).get(REQUEST_ID_KEY)
        frames = 0
        nbytes = 0
        start = time.time()
        lander: _Lander | None = None
        try:
            if rid is not None and hasattr(self.sink, "open_kv"):
                self.sink.open_kv(rid)  # the lease covers the transfer, not the prefill queue before it
            for message in request_iterator:
                h, raw = split_frame(message)
                if h.join:
                    if self.on_join is None:
                        raise ValueError("this receiver does not take process-group frames")
                    self.on_join(h)
                    return pb.PushAck(ok=True)
                if rid is None:
                    rid = h.rid
                elif h.rid != rid:
                    raise ValueError(f"frame for {h.rid!r} in the stream of {rid!r}")
                if lander is not None and lander.error is not None:
                    raise ValueError(lander.error)
                if h.last:
                    if h.frames != frames:
                        raise ValueError(f"{h.frames} frames sent, {frames} received")
                    if lander is not None:
                        lander.close()
                        nbytes += lander.nbytes
                        lander = None
                    self.sink.complete_kv(rid, h.token, h.logprob, time.time() - start)
                    return pb.PushAck(ok=True, bytes_received=nbytes)
                if h.i != frames:
                    raise ValueError(f"frame {h.i} arrived where frame {frames} was expected")
                data = self.fetch(h, raw)
                if callable(data):  # a receive in flight: landed in order while the next is posted
                    if lander is None:
                        lander = _Lander(self.sink, rid, self.timeout_s, self.land_depth)
                    lander.put(h, data)
                else:
                    self.sink.write_kv(rid, range(*h.layers), list(h.blocks), data)
                    nbytes += h.n
                frames += 1
            raise ValueError("the stream ended before its last frame (sender gone or cancelled)")
        except Exception as exc:  # any failure releases the blocks and is reported, never raised
            if lander is not None:
                lander.abandon()
                nbytes += lander.nbytes
            if isinstance(exc, grpc.RpcError) and not str(exc):
                exc = "the sender cancelled the stream or went away"
            error = f"KV transfer failed: {exc}"
            if rid is not None:
                try:
                    self.sink.fail_kv(rid, error)
                except Exception:
                    logger.exception("releasing %s after a failed transfer", rid)
            logger.warning("%s (request %s)", error, rid)
            return pb.PushAck(ok=False, error=error, bytes_received=nbytes)


class GrpcKVReceiver(KVReceiver):
    """A gRPC server that lands KV frames into a ``KVSink``."""

    def __init__(self, sink: KVSink, host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
                 max_workers: int = 16, fetch=None, on_join=None, timeout_s: float = 30.0,
                 land_depth: int = _Lander.DEPTH) -> None:
        keep_frame_buffers()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=_CHANNEL_OPTIONS)
        servicer = _Servicer(sink, fetch, on_join, timeout_s, land_depth)
        handler = grpc.stream_unary_rpc_method_handler(
            servicer.Push, request_deserializer=None, response_serializer=pb.PushAck.SerializeToString)
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Push": handler}),))
        self._port = self._server.add_insecure_port(f"{host}:{port}")
        if self._port == 0:
            raise RuntimeError(f"KV receiver could not bind {host}:{port}")
        self._server.start()
        self._host = advertise_host or host

    @property
    def address(self) -> str:
        return f"{self._host}:{self._port}"

    def stop(self) -> None:
        self._server.stop(grace=1.0)


_END = object()


def split_piece(layers: range, block_ids: list[int], data: torch.Tensor, limit: int):
    """Yield ``(layers, block_ids, data)`` sub-pieces of at most ``limit`` bytes where possible (one
    block of one layer is the smallest): whole layers grouped first, then blocks within a layer."""
    nbytes = data.numel() * data.element_size()
    num_layers, num_blocks = len(layers), len(block_ids)
    if nbytes <= limit or num_layers == 0 or num_blocks == 0:
        yield layers, block_ids, data
        return
    per_layer = nbytes // num_layers
    layer_step = max(1, limit // per_layer)
    block_step = num_blocks if layer_step > 1 else max(1, limit // (per_layer // num_blocks))
    for lo in range(0, num_layers, layer_step):
        hi = min(num_layers, lo + layer_step)
        for b in range(0, num_blocks, block_step):
            yield (range(layers.start + lo, layers.start + hi), block_ids[b:b + block_step],
                   data[:, lo:hi, b:b + block_step])


def _encode(item: tuple) -> bytes:
    return frame_message(*encode_piece(*item))


class GrpcTransfer(Transfer):
    # Frames encoded ahead of the one gRPC is writing (on the sender's encoder thread).
    LOOKAHEAD = 2

    def __init__(self, push, request_id: str, timeout_s: float, encoder: futures.Executor | None = None) -> None:
        self.request_id = request_id
        self.state = TransferState.OPEN
        self._q: queue.Queue = queue.Queue()
        self._frames = 0
        self._bytes = 0
        self._timeout_s = timeout_s
        self._encoder = encoder
        # gRPC's sending thread only ships the messages that ``send`` queued, encoded ahead.
        self._future = push.future(self._iter(), timeout=timeout_s, metadata=((REQUEST_ID_KEY, request_id),))

    def _iter(self):
        """The stream's messages, on gRPC's request thread. gRPC asks for the next message only
        once it has written the previous one, so a frame encoded here (a checksum and a copy of
        megabytes) left the socket idle meanwhile: the next ``LOOKAHEAD`` pieces are encoded on
        the encoder thread while this one is written (both release the GIL). At most that many
        encoded messages wait at a time (each is megabytes; see ``_messages``)."""
        ahead: collections.deque = collections.deque()
        while True:
            if not ahead:
                ahead.append(self._start(self._q.get()))
            while len(ahead) <= self.LOOKAHEAD:
                try:
                    ahead.append(self._start(self._q.get_nowait()))
                except queue.Empty:
                    break
            item = ahead.popleft()
            if isinstance(item, futures.Future):
                item = item.result(timeout=self._timeout_s)
            if item is _END:
                return
            yield item

    def _start(self, item):
        """A queued item as it will go out: a piece's frame is encoded (on the encoder thread when
        there is one, a ``Future``; else here); headers and ``_END`` pass as they are."""
        if not isinstance(item, tuple):
            return item
        if self._encoder is None:
            return _encode(item)
        return self._encoder.submit(_encode, item)

    def send(self, layers: range, block_ids: list[int], data: torch.Tensor) -> None:
        if self.state in (TransferState.DONE, TransferState.FAILED):
            raise TransferError(f"transfer of {self.request_id} is {self.state.value}")
        self.state = TransferState.SENDING
        self._bytes += data.numel() * data.element_size()
        for sub_layers, sub_blocks, sub_data in split_piece(layers, list(block_ids), data, MAX_FRAME_BYTES):
            i = self._frames
            self._frames += 1
            for message in self._messages(i, sub_layers, sub_blocks, sub_data):
                self._q.put(message)

    def _messages(self, i: int, layers: range, block_ids: list[int], data: torch.Tensor) -> list:
        """Frame ``i``, to be encoded (header, checksum and message: one copy of the piece) just
        before gRPC takes it, a frame or two ahead (``_iter``), not on the caller's thread.

        So only the few frames in flight have a message buffer, and malloc reuses the same few
        megabytes (a push of 30 frames built ahead held 94 MB of fresh pages, which the main heap
        gave back and page-faulted in again on every push: a tenth of the sender's CPU); the
        message is still in cache when gRPC copies it; and the caller (the prefill worker's engine
        thread, between layers) only queues the piece. ``send``'s contract (the caller does not
        modify the piece) makes holding it until then safe."""
        if str(data.dtype).removeprefix("torch.") not in _DTYPES:
            raise TransferError(f"KV of dtype {data.dtype} cannot be sent; use one of {', '.join(_DTYPES)}")
        return [(self.request_id, i, layers, block_ids, data)]

    def finish(self, first_token: int, first_logprob: float | None = None) -> int:
        last = FrameHeader(self.request_id, self._frames, last=True, frames=self._frames,
                           token=first_token, logprob=first_logprob)
        self._q.put(last.pack())
        self._q.put(_END)
        try:
            ack = self._future.result()
        except grpc.RpcError as exc:
            self.state = TransferState.FAILED
            code = exc.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TransferError(f"KV transfer of {self.request_id} timed out") from None
            raise TransferError(f"KV transfer of {self.request_id} failed: {code.name}: {exc.details()}") from None
        except (futures.CancelledError, grpc.FutureCancelledError):  # abort() cancelled the stream
            self.state = TransferState.FAILED
            raise TransferError(f"KV transfer of {self.request_id} was aborted") from None
        if not ack.ok:
            self.state = TransferState.FAILED
            raise TransferError(ack.error)
        self.state = TransferState.DONE
        return self._bytes

    def abort(self, reason: str = "aborted") -> None:
        if self.state is TransferState.DONE:
            return
        self.state = TransferState.FAILED
        self._future.cancel()
        self._q.put(_END)


class GrpcKVSender(KVSender):
    """Prefill side: one channel per destination, one stream per request."""

    name = "grpc"

    def __init__(self) -> None:
        keep_frame_buffers()
        self._stubs: dict[str, grpc.StreamUnaryMultiCallable] = {}
        self._channels: list[grpc.Channel] = []
        self._lock = threading.Lock()
        # Encodes frames ahead of gRPC's request threads (``GrpcTransfer._iter``); one thread, as
        # encoding is memory-bound copying and the prefill compute needs the other cores.
        self._encoder = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-encode")

    def _stub(self, destination: str) -> grpc.StreamUnaryMultiCallable:
        """The ``Push`` call of ``destination``: raw-bytes requests, a ``PushAck`` back."""
        with self._lock:
            if destination not in self._stubs:
                ch = grpc.insecure_channel(destination, options=_CHANNEL_OPTIONS + _SENDER_OPTIONS)
                self._channels.append(ch)
                self._stubs[destination] = ch.stream_unary(PUSH_METHOD, request_serializer=None,
                                                           response_deserializer=pb.PushAck.FromString)
            return self._stubs[destination]

    def open(self, request_id: str, destination: str, num_layers: int, num_blocks: int, timeout_s: float) -> Transfer:
        return GrpcTransfer(self._stub(destination), request_id, timeout_s, self._encoder)

    def close(self) -> None:
        with self._lock:
            for ch in self._channels:
                ch.close()
            self._channels.clear()
            self._stubs.clear()
        self._encoder.shutdown(wait=False, cancel_futures=True)
