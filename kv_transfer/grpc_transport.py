"""KV transport over gRPC: one client stream of frames per request.

The decode actor runs a ``GrpcKVReceiver`` (a gRPC server on its own port); prefill actors open a
``Push`` stream to it per request, send frames of about 1-4 MB as layers are computed, and get one
acknowledgement at the end. Message size limits are explicit on both sides (a piece larger than
``MAX_FRAME_BYTES`` is split into several frames along its blocks, then its layers), every stream
has a deadline, and every frame's checksum is checked before its bytes touch the KV cache. Both
ends hold the cluster secret: the stream's opening and every frame carry its MAC (``auth``).

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
from concurrent import futures

import grpc
import torch

from pdserve.internal import kv_transfer_pb2 as pb
from pdserve.kv_transfer.auth import KVAuth
from pdserve.kv_transfer.base import KVReceiver, KVSender, KVSink, Transfer, TransferError, TransferState
from pdserve.kv_transfer.landing import REQUEST_ID_KEY, LandingServicer
from pdserve.kv_transfer.wire import DTYPES, FrameHeader, encode_piece, frame_message

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20
MAX_FRAME_BYTES = 4 << 20  # larger pieces are split: well under the message limit, and streamed
# The sender's socket writes use MSG_ZEROCOPY where the kernel has it: the kernel then pins gRPC's
# own copy of a frame instead of copying it once more (it falls back to a plain send elsewhere).
SENDER_OPTIONS = [("grpc.experimental.tcp_tx_zerocopy_enabled", 1)]
SERVICE = "pdserve.internal.KvTransfer"
PUSH_METHOD = f"/{SERVICE}/Push"  # client stream of raw-bytes messages -> PushAck
CHANNEL_OPTIONS = [  # both ends of every KV channel: the message limit, set explicitly
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
    top of a heap, so each of those buffers page-faulted its pages in again (zeroed by the kernel),
    a visible share of the receiver's CPU in a profile. Above every frame size (at most 4 MiB plus
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


class GrpcKVReceiver(KVReceiver):
    """A gRPC server that lands KV frames into a ``KVSink`` (``landing.LandingServicer``), from
    senders that hold the cluster ``secret`` only.

    ``fetch`` and ``on_join`` are the servicer's: the collective transport serves its control
    stream here, with the bytes coming over a process group."""

    def __init__(self, sink: KVSink, host: str = "127.0.0.1", port: int = 0, max_workers: int = 16,
                 fetch=None, on_join=None, timeout_s: float = 30.0, *, secret: bytes) -> None:
        keep_frame_buffers()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=CHANNEL_OPTIONS)
        servicer = LandingServicer(sink, KVAuth(secret), fetch, on_join, timeout_s)
        handler = grpc.stream_unary_rpc_method_handler(
            servicer.Push, request_deserializer=None, response_serializer=pb.PushAck.SerializeToString)
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Push": handler}),))
        self._port = self._server.add_insecure_port(f"{host}:{port}")
        if self._port == 0:
            raise RuntimeError(f"KV receiver could not bind {host}:{port}")
        self._server.start()
        self._host = host

    @property
    def address(self) -> str:
        return f"{self._host}:{self._port}"

    def stop(self) -> None:
        self._server.stop(grace=1.0)


_END = object()  # queued after the last frame: the stream ends


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
    auth, nonce, *piece = item
    header, parts = encode_piece(*piece)
    auth.sign(header, nonce)  # one HMAC over the header; the data is bound by its checksum there
    return frame_message(header, parts)


class GrpcTransfer(Transfer):
    # Frames encoded ahead of the one gRPC is writing (on the sender's encoder thread).
    LOOKAHEAD = 2

    def __init__(self, push, request_id: str, timeout_s: float, encoder: futures.Executor | None = None, *,
                 auth: KVAuth) -> None:
        self.request_id = request_id
        self._auth = auth
        self._nonce = auth.new_nonce()  # names this stream in every frame's MAC
        self.state = TransferState.OPEN
        self._q: queue.Queue = queue.Queue()
        self._frames = 0
        self._bytes = 0
        self._timeout_s = timeout_s
        self._encoder = encoder
        # gRPC's sending thread only ships the messages that ``send`` queued, encoded ahead. The
        # stream has no deadline of its own: a long prompt's transfer stays open for as long as
        # its prefill takes. It is bounded by progress instead: the receiver's lease is renewed by
        # each piece, and ``finish`` waits at most ``timeout_s`` for the acknowledgement.
        self._future = push.future(self._iter(), metadata=((REQUEST_ID_KEY, request_id),
                                                           *auth.open_metadata(request_id, self._nonce)))

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
        megabytes (frames built all ahead held fresh pages that the main heap gave back and
        page-faulted in again on every push); the message is still in cache when gRPC copies it; and the caller (the prefill worker's engine
        thread, between layers) only queues the piece. ``send``'s contract (the caller does not
        modify the piece) makes holding it until then safe."""
        if str(data.dtype).removeprefix("torch.") not in DTYPES:
            raise TransferError(f"KV of dtype {data.dtype} cannot be sent; use one of {', '.join(DTYPES)}")
        return [(self._auth, self._nonce, self.request_id, i, layers, block_ids, data)]

    def finish(self, first_token: int, first_logprob: float | None = None) -> int:
        last = FrameHeader(self.request_id, self._frames, last=True, frames=self._frames,
                           token=first_token, logprob=first_logprob)
        self._auth.sign(last, self._nonce)
        self._q.put(last.pack())
        self._q.put(_END)
        try:
            ack = self._future.result(timeout=self._timeout_s)
        except (futures.TimeoutError, grpc.FutureTimeoutError):
            self.state = TransferState.FAILED
            self._future.cancel()
            raise TransferError(f"KV transfer of {self.request_id} timed out: no acknowledgement "
                                f"{self._timeout_s} s after its last frame") from None
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
    """Prefill side: one channel per destination, one stream per request, signed with the cluster
    ``secret``."""

    name = "grpc"

    def __init__(self, *, secret: bytes) -> None:
        keep_frame_buffers()
        self.auth = KVAuth(secret)
        self._stubs: dict[str, grpc.StreamUnaryMultiCallable] = {}
        self._channels: list[grpc.Channel] = []
        self._lock = threading.Lock()
        # Encodes frames ahead of gRPC's request threads (``GrpcTransfer._iter``); one thread, as
        # encoding is memory-bound copying and the prefill compute needs the other cores.
        self._encoder = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-encode")

    def stub(self, destination: str) -> grpc.StreamUnaryMultiCallable:
        """The ``Push`` call of ``destination``: raw-bytes requests, a ``PushAck`` back (one
        channel per destination, reused; the collective transport sends its control frames here)."""
        with self._lock:
            if destination not in self._stubs:
                ch = grpc.insecure_channel(destination, options=CHANNEL_OPTIONS + SENDER_OPTIONS)
                self._channels.append(ch)
                self._stubs[destination] = ch.stream_unary(PUSH_METHOD, request_serializer=None,
                                                           response_deserializer=pb.PushAck.FromString)
            return self._stubs[destination]

    def open(self, request_id: str, destination: str, num_layers: int, num_blocks: int, timeout_s: float) -> Transfer:
        return GrpcTransfer(self.stub(destination), request_id, timeout_s, self._encoder, auth=self.auth)

    def close(self) -> None:
        with self._lock:
            for ch in self._channels:
                ch.close()
            self._channels.clear()
            self._stubs.clear()
        self._encoder.shutdown(wait=False, cancel_futures=True)
