"""The transport interface: what every KV transport (gRPC, torch collective) implements.

Plan and move are split, as in vLLM's KV connector: the router plans (which decode actor, which
reserved blocks); a transport only moves bytes. On the prefill side a ``KVSender`` opens one
``Transfer`` per request and sends ``(layer range, destination block ids, tensor)`` pieces as the
layers are computed; ``finish`` sends token #1 and waits until the decode side holds the whole KV,
verified. On the decode side a receiver hands every verified piece to a ``KVSink`` (the decode
worker), which writes it into the reserved blocks and starts the request on completion.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import Protocol

import torch

# Pieces of about this size (whole layers of a chunk's blocks grouped up to it, at least one layer)
# are what the prefill worker hands a transport (``PrefillConfig.frame_bytes``). Fewer, larger
# pieces cost less per byte; smaller ones overlap the transfer with the prefill more finely. 4 MiB
# pieces pushed a prompt faster than 2 MiB ones over both gRPC and gloo (BENCHMARKS.md).
DEFAULT_FRAME_BYTES = 4 << 20


class TransferState(enum.Enum):
    OPEN = "open"  # created, nothing sent yet
    SENDING = "sending"  # pieces in flight
    DONE = "done"  # decode side acknowledged the whole KV
    FAILED = "failed"  # integrity error, timeout, peer gone, or aborted


class TransferError(RuntimeError):
    """A transfer failed; the message says why (the decode side has released the blocks)."""


class KVSink(Protocol):
    """The decode side's landing area, keyed by request id."""

    def open_kv(self, request_id: str) -> None:
        """(Optional: receivers call it when the sink has it.) A transfer stream for the request
        opened; the decode worker restarts the reservation's lease here. Raises ``KeyError`` for
        an unknown request."""

    def write_kv(self, request_id: str, layers: range, block_ids: list[int], data: torch.Tensor) -> None:
        """Write ``data`` ``[2, len(layers), len(block_ids), block_size, kv_heads, head_dim]`` into the
        reserved ``block_ids`` of ``layers``. Raises ``KeyError`` for an unknown request and
        ``ValueError`` for blocks that are not the request's. ``data`` is valid during the call
        only (a transport may reuse its buffer for the next piece): copy, never keep it."""

    def complete_kv(self, request_id: str, first_token: int, first_logprob: float | None, transfer_s: float) -> None:
        """All pieces arrived: check coverage and start decoding from ``first_token``."""

    def fail_kv(self, request_id: str, error: str) -> None:
        """Give the request's blocks back and end it with ``error``."""


class Transfer(ABC):
    """One request's KV on its way from a prefill actor to a decode actor."""

    state: TransferState

    @abstractmethod
    def send(self, layers: range, block_ids: list[int], data: torch.Tensor) -> None:
        """Queue one piece (a copy the caller will not modify); returns without waiting."""

    @abstractmethod
    def finish(self, first_token: int, first_logprob: float | None = None) -> int:
        """Send the last frame and wait for the decode side's verdict; return bytes moved.
        Raises ``TransferError`` on failure."""

    @abstractmethod
    def abort(self, reason: str = "aborted") -> None:
        """Stop sending; the decode side releases the blocks."""


class KVSender(ABC):
    """Prefill side of a transport."""

    name: str

    @abstractmethod
    def open(self, request_id: str, destination: str, num_layers: int, num_blocks: int, timeout_s: float) -> Transfer:
        """Start a transfer to ``destination`` (the receiver's address) with a deadline."""

    def close(self) -> None:
        """Release connections."""


class KVReceiver(ABC):
    """Decode side of a transport: accepts pieces and hands them to a ``KVSink``."""

    @property
    @abstractmethod
    def address(self) -> str:
        """Where senders reach this receiver."""

    @abstractmethod
    def stop(self) -> None:
        """Stop accepting; in-flight transfers fail."""
