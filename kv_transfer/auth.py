"""The cluster secret on the KV plane: who may push KV into a decode actor's reserved blocks.

Every pdserve cluster has one secret (``pdserve serve`` generates it, or the operator gives it),
handed to every prefill and decode actor in its config. A decode actor's KV receiver accepts a
stream only from someone who holds it:

- **The stream's opening** (call metadata, before any frame) carries a fresh nonce and
  ``HMAC(secret, ("open", request id, nonce))``. The nonce is the sender's clock (nanoseconds)
  and 16 random bytes; the receiver refuses a nonce it has already seen, or one further than
  ``REPLAY_WINDOW_S`` from its own clock, so a captured stream cannot be played again. Only after
  this check does the decode actor hear of the request (the lease restarts, and a stream that then
  fails releases the request's blocks): an unauthenticated stream frees nothing.
- **Every frame header** (data frames, the last frame with token #1, the collective ``join``)
  carries ``HMAC(secret, (nonce, every other header field))``: request id, frame index, layer
  range, block ids, dtype, shape, length, checksum, token, group and tag. A frame replayed under
  another request, other blocks, another index or into another stream fails it. The piece's bytes
  are bound through the checksum in the header (one HMAC over a short header per frame, never
  over megabytes of KV; see docs/kv_transfer.md for what this does and does not cover).

A missing or wrong MAC is refused with ``UNAUTHENTICATED``; a valid but replayed or stale stream
opening with ``PERMISSION_DENIED``. Neither message contains the secret.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct
import threading
import time
from pathlib import Path

import grpc
import msgpack

SECRET_ENV = "PDSERVE_CLUSTER_SECRET"  # hex, read by ``pdserve serve`` when no file is given
MIN_SECRET_BYTES = 16
NONCE_KEY = "pdserve-kv-nonce"  # call metadata: the stream's nonce (hex)
MAC_KEY = "pdserve-kv-mac"  # call metadata: the stream opening's MAC (hex)
# A stream opening is accepted within this many seconds of the sender's clock, and its nonce is
# remembered twice as long: together they refuse every replay, if the nodes' clocks agree within it.
REPLAY_WINDOW_S = 300.0
_NONCE = struct.Struct(">Q16s")  # sender's time.time_ns(), 16 random bytes


def new_cluster_secret() -> bytes:
    """A fresh 32-byte cluster secret."""
    return secrets.token_bytes(32)


def parse_secret(text: str | bytes, source: str) -> bytes:
    """A secret from an environment variable or a file: hex (64 hex digits for 32 bytes; a file may
    end with a newline) or, for a file that is not hex, its raw bytes. ``source`` names where it
    came from in the error (never the value)."""
    raw = text.encode() if isinstance(text, str) else bytes(text)
    stripped = raw.strip()
    try:
        secret = bytes.fromhex(stripped.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        secret = raw
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the cluster secret from {source} is {len(secret)} bytes; it must be at least "
                         f"{MIN_SECRET_BYTES} (make one with: python -c 'import secrets; print(secrets.token_hex(32))')")
    return secret


def load_cluster_secret(path: str | None = None, environ=os.environ) -> tuple[bytes, str]:
    """The operator's secret (``--cluster-secret-file PATH``, else ``$PDSERVE_CLUSTER_SECRET``), else a
    fresh one. Returns ``(secret, where it came from)``; the latter is for the log, not the value."""
    if path:
        return parse_secret(Path(path).read_bytes(), f"--cluster-secret-file {path}"), f"file {path}"
    if environ.get(SECRET_ENV):
        return parse_secret(environ[SECRET_ENV], f"${SECRET_ENV}"), f"${SECRET_ENV}"
    return new_cluster_secret(), "generated"


class KVAuthError(Exception):
    """A stream or frame the KV receiver refuses: ``code`` is the gRPC status it answers with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


# The header fields a frame's MAC covers, in this order, after the stream's nonce (every field of
# ``wire.FrameHeader`` but the MAC itself).
_FIELDS = ("rid", "i", "layers", "blocks", "dtype", "shape", "crc", "n", "last", "frames", "token", "logprob",
           "group", "tag", "join", "store")


class KVAuth:
    """Signs and checks the KV plane's messages with the cluster secret (one per sender or receiver,
    shared by its threads). ``repr`` never shows the secret."""

    def __init__(self, secret: bytes) -> None:
        if not isinstance(secret, (bytes, bytearray)) or len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"a KV transport needs the cluster secret: bytes, at least {MIN_SECRET_BYTES} of them. "
                             f"pdserve serve hands its own to every actor; from Python set cluster_secret in "
                             f"WorkerConfig (decode role) and PrefillConfig to one value, e.g. "
                             f"pdserve.kv_transfer.new_cluster_secret()")
        self._key = bytes(secret)
        self._seen: dict[bytes, float] = {}  # nonce -> when it was accepted (receiver side)
        self._seen_lock = threading.Lock()
        self._next_prune = 0.0

    def __repr__(self) -> str:
        return "KVAuth(<cluster secret>)"

    def _mac(self, message: bytes) -> bytes:
        return hmac.digest(self._key, message, hashlib.sha256)

    # ---- the stream's opening ------------------------------------------------------------------

    @staticmethod
    def new_nonce() -> bytes:
        return _NONCE.pack(time.time_ns(), secrets.token_bytes(16))

    def open_metadata(self, request_id: str, nonce: bytes) -> tuple[tuple[str, str], ...]:
        """The call metadata that opens a stream for ``request_id`` ("" for a ``join``)."""
        mac = self._mac(msgpack.packb(["open", request_id, nonce], use_bin_type=True))
        return (NONCE_KEY, nonce.hex()), (MAC_KEY, mac.hex())

    def check_open(self, request_id: str | None, metadata: dict) -> bytes:
        """The nonce of a stream whose metadata authenticates it for ``request_id`` (None: a stream
        that names no request, a ``join``); raises ``KVAuthError`` otherwise. Records the nonce, so
        the same opening is refused the next time."""
        what = f"KV stream for request {request_id!r}" if request_id else "KV control stream"
        try:
            nonce = bytes.fromhex(metadata[NONCE_KEY])
            mac = bytes.fromhex(metadata[MAC_KEY])
        except (KeyError, ValueError):
            raise KVAuthError(grpc.StatusCode.UNAUTHENTICATED,
                              f"{what} refused: it carries no cluster MAC ({NONCE_KEY}, {MAC_KEY} metadata); "
                              f"only actors of this pdserve cluster, holding its secret, may push KV") from None
        want = self._mac(msgpack.packb(["open", request_id or "", nonce], use_bin_type=True))
        if len(nonce) != _NONCE.size or not hmac.compare_digest(mac, want):
            raise KVAuthError(grpc.StatusCode.UNAUTHENTICATED,
                              f"{what} refused: its MAC does not verify (not signed with this cluster's "
                              f"secret, or signed for another request)")
        sent_ns, _ = _NONCE.unpack(nonce)
        now = time.time()
        skew = now - sent_ns / 1e9
        if abs(skew) > REPLAY_WINDOW_S:
            raise KVAuthError(grpc.StatusCode.PERMISSION_DENIED,
                              f"{what} refused: opened {skew:+.0f} s from this node's clock, outside the "
                              f"{REPLAY_WINDOW_S:.0f} s replay window (a replayed stream, or clocks out of sync)")
        with self._seen_lock:
            if nonce in self._seen:
                raise KVAuthError(grpc.StatusCode.PERMISSION_DENIED,
                                  f"{what} refused: its nonce was used before (a replayed stream)")
            self._seen[nonce] = now
            if now >= self._next_prune:  # forget nonces that the window refuses anyway
                cutoff = now - 2 * REPLAY_WINDOW_S
                self._seen = {k: t for k, t in self._seen.items() if t >= cutoff}
                self._next_prune = now + REPLAY_WINDOW_S / 10
        return nonce

    # ---- frames --------------------------------------------------------------------------------

    def _frame_mac(self, header, nonce: bytes) -> bytes:
        d = header.__dict__
        return self._mac(msgpack.packb([nonce, *(d[f] for f in _FIELDS)], use_bin_type=True))

    def sign(self, header, nonce: bytes) -> None:
        """Set ``header.mac`` (a ``wire.FrameHeader`` of the stream opened with ``nonce``)."""
        header.mac = self._frame_mac(header, nonce)

    def check(self, header, nonce: bytes) -> None:
        """Raise ``KVAuthError`` (UNAUTHENTICATED) unless ``header`` was signed for this stream."""
        if not header.mac or not hmac.compare_digest(header.mac, self._frame_mac(header, nonce)):
            what = "join frame" if header.join else f"frame {header.i} of {header.rid!r}"
            raise KVAuthError(grpc.StatusCode.UNAUTHENTICATED,
                              f"{what} refused: its MAC does not verify (forged, or replayed from another "
                              f"request, other blocks or another stream)")
