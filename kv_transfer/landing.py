"""Landing: the decode side of a control stream, shared by the gRPC and collective receivers.

A ``Push`` stream carries one request's frames in order (``wire``), then the last frame with
token #1. ``LandingServicer.Push`` checks the order and the count of the frames, gets each
piece's verified tensor from a ``fetch`` function, writes it into the reserved blocks through the
``KVSink``, and answers with one ``PushAck``: ``complete_kv`` when everything arrived, ``fail_kv``
(the blocks go back) on any failure. How a piece's bytes arrive is the transport's business:

- gRPC: inside the frame's message (``fetch`` is ``wire.decode_piece``), written on the stream's
  own thread;
- torch collective: over a process group, by a receive posted when the header arrives; ``fetch``
  then returns a function that waits for the receive and verifies it, and a ``Lander`` thread
  writes the pieces in frame order while the stream's thread reads the next header and posts the
  next receive.

Authentication (``auth``) is checked here, so both transports get it: the stream's opening
(call metadata) before the decode worker hears of the request, and every frame's MAC before any
other check of it. A stream that fails the first is refused (``UNAUTHENTICATED`` or
``PERMISSION_DENIED``) and touches nothing: it was never the request's transfer, so its failure
releases no block. A frame that fails the second, in a stream whose opening did authenticate,
fails that transfer like any damaged frame (its blocks go back) and is answered with
``UNAUTHENTICATED``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

import grpc

from pdserve.internal import kv_transfer_pb2 as pb
from pdserve.kv_transfer.auth import KVAuth, KVAuthError
from pdserve.kv_transfer.base import KVSink
from pdserve.kv_transfer.wire import FrameHeader, decode_piece, split_frame

logger = logging.getLogger(__name__)

REQUEST_ID_KEY = "pdserve-request-id"  # call metadata: which request a Push stream carries
LAND_DEPTH = 2  # pieces a ``Lander`` holds whose receive is still in flight


class Lander:
    """Lands pieces whose receive is still in flight, in frame order, on a thread of its own, so
    that the stream's thread meanwhile reads the next header and posts the next receive. At most
    ``depth`` pieces wait here; every wait is bounded by ``timeout_s``.

    ``put(header, finish)`` queues a piece: ``finish()`` waits for its bytes, verifies them and
    returns the tensor, which is then written through ``sink.write_kv``. ``close`` lands what is
    queued and raises the first failure; ``abandon`` drops the rest."""

    def __init__(self, sink: KVSink, rid: str, timeout_s: float, depth: int = LAND_DEPTH) -> None:
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

    def put(self, h: FrameHeader, finish: Callable) -> None:
        """Queue the piece of frame ``h``; raises ``ValueError`` if landing already failed or
        the queue stayed full for ``timeout_s``."""
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
        """The stream failed: drop the pieces still queued."""
        self.error = self.error or "the stream failed"
        self._closed = True


class LandingServicer:
    """The ``Push`` method of the KV-transfer service: lands one stream's frames into a sink, from
    senders that hold the cluster secret (``auth``) only.

    ``fetch(header, data)`` returns a piece's verified tensor (by default ``wire.decode_piece`` of
    the data that the frame's message carries), or a function that waits for it and verifies it
    (then a ``Lander`` writes it). ``on_join(header)`` answers control frames that set up a
    process group (the collective transport).

    With the default ``fetch`` each piece is verified and written on the stream's thread: a landing
    thread as well only competes for the GIL and the CPU with gRPC's own threads."""

    def __init__(self, sink: KVSink, auth: KVAuth, fetch=None, on_join=None, timeout_s: float = 30.0) -> None:
        self.sink = sink
        self.auth = auth
        self.fetch = fetch or decode_piece
        self.on_join = on_join
        self.timeout_s = timeout_s

    def Push(self, request_iterator, context):
        # The request id travels in the call's metadata too, so that a stream cancelled before its
        # first frame (a prefill actor that died early) still releases the request's blocks at once.
        metadata = dict(context.invocation_metadata())
        rid = metadata.get(REQUEST_ID_KEY)
        try:  # before anything else: a stream that does not authenticate touches nothing
            nonce = self.auth.check_open(rid, metadata)
        except KVAuthError as exc:
            logger.warning("%s (from %s)", exc, context.peer())
            context.abort(exc.code, str(exc))
        frames = 0
        nbytes = 0
        start = time.time()
        lander: Lander | None = None
        try:
            if rid is not None and hasattr(self.sink, "open_kv"):
                self.sink.open_kv(rid)  # the lease covers the transfer, not the prefill queue before it
            for message in request_iterator:
                h, raw = split_frame(message)
                self.auth.check(h, nonce)  # one HMAC over the header; the data is bound by its checksum
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
                        lander = Lander(self.sink, rid, self.timeout_s)
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
            if isinstance(exc, KVAuthError):
                context.abort(exc.code, error)
            return pb.PushAck(ok=False, error=error, bytes_received=nbytes)
