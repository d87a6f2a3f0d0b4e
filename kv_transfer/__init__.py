"""KV transfer between prefill and decode actors: one interface (``base``), one wire format
(``wire``), and its transports (``grpc_transport``; the torch-collective transport follows)."""

from pdserve.kv_transfer.base import (
    IntegrityError,
    KVReceiver,
    KVSender,
    KVSink,
    Transfer,
    TransferError,
    TransferState,
)

__all__ = ["IntegrityError", "KVReceiver", "KVSender", "KVSink", "Transfer", "TransferError", "TransferState"]
