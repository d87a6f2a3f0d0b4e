"""KV transfer: moves a request's KV cache from a prefill actor into a decode actor's reserved blocks.

Modules:
- ``base``: the interface every transport implements (``KVSender``, ``Transfer``, ``KVReceiver``)
  and what the decode side offers it (``KVSink``).
- ``factory``: builds a transport's ends by name (``make_sender``, ``start_receiver``).
- ``wire``: the frame format (msgpack header + raw tensor bytes) and its checksums.
- ``auth``: the cluster secret on the KV plane: the MAC on every stream and frame.
- ``landing``: the decode side of a control stream, shared by every receiver: checks frame order
  and integrity and writes each piece into the reserved blocks.
- ``grpc_transport``: KV over a gRPC client stream, the data inside the frames.
- ``collective_transport``: control over that gRPC stream, data over a torch process group
  (NCCL on CUDA, gloo on CPU).
"""

from pdserve.kv_transfer.auth import new_cluster_secret
from pdserve.kv_transfer.base import (
    KVReceiver,
    KVSender,
    KVSink,
    Transfer,
    TransferError,
    TransferState,
)
from pdserve.kv_transfer.factory import TRANSPORTS, make_sender, start_receiver

__all__ = ["KVReceiver", "KVSender", "KVSink", "TRANSPORTS", "Transfer", "TransferError", "TransferState",
           "make_sender", "new_cluster_secret", "start_receiver"]
