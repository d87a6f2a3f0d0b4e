"""Building a transport's two ends by name: ``make_sender`` for a prefill actor, ``start_receiver``
for a decode actor. The workers name a transport in their config and never import its module."""

from __future__ import annotations

import torch

from pdserve.kv_transfer.base import KVReceiver, KVSender, KVSink

TRANSPORTS = ("grpc", "collective")  # the names ``make_sender`` and ``start_receiver`` take


def _unknown(name: str) -> ValueError:
    return ValueError(f"unknown KV transport {name!r}; choose {' or '.join(TRANSPORTS)}")


def make_sender(name: str, device: str = "cpu", timeout_s: float = 30.0, *, secret: bytes) -> KVSender:
    """The prefill side of transport ``name``. ``device`` is where the KV cache lives (the
    collective transport picks NCCL for CUDA, gloo for CPU); ``timeout_s`` bounds setting up a
    process group with a decode actor. ``secret`` is the cluster secret: it signs every stream and
    frame (``auth``), and a receiver refuses those of any other secret."""
    if name == "grpc":
        from pdserve.kv_transfer.grpc_transport import GrpcKVSender

        return GrpcKVSender(secret=secret)
    if name == "collective":
        from pdserve.kv_transfer.collective_transport import CollectiveKVSender

        return CollectiveKVSender(device, timeout_s, secret=secret)
    raise _unknown(name)


def start_receiver(sink: KVSink, transport: str, device: str | torch.device = "cpu", timeout_s: float = 30.0,
                   host: str | None = None, *, secret: bytes) -> KVReceiver:
    """The decode side of ``transport``, started, landing pieces in ``sink`` (the decode worker's
    ``EngineLoop``). ``device`` is where the sink's KV cache lives and ``timeout_s`` bounds every
    wait of the collective transport (the decode worker passes its ``kv_lease_s``). ``host`` is
    the address it listens on and advertises; by default this node's IP when Ray runs here (so
    prefill actors on other nodes reach it), else 127.0.0.1. ``secret`` is the cluster secret: only
    senders that hold it get a piece written (``auth``)."""
    if host is None:
        host = _node_ip()
    if transport == "grpc":
        from pdserve.kv_transfer.grpc_transport import GrpcKVReceiver

        return GrpcKVReceiver(sink, host=host, secret=secret)
    if transport == "collective":
        from pdserve.kv_transfer.collective_transport import CollectiveKVReceiver

        return CollectiveKVReceiver(sink, host=host, device=device, timeout_s=timeout_s, secret=secret)
    raise _unknown(transport)


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"
