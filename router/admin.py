"""The ``pdserve.v1.Admin`` gRPC service: operating a running server (``pdserve scale``).

It is served on the router's port next to ``Generation``. ``Scale`` hands the request to a
``Scaler`` (``router/scaling.py``) and maps what goes wrong to a gRPC status with a message a
person can act on.
"""

from __future__ import annotations

import logging
import os

import grpc

from pdserve.router.scaling import DEFAULT_DRAIN_TIMEOUT_S, ScaleError, Scaler
from pdserve.v1 import admin_pb2 as pb
from pdserve.v1 import admin_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Admin"].full_name  # "pdserve.v1.Admin"


class AdminService(pb_grpc.AdminServicer):
    """``Scale``; a server started without a ``Scaler`` answers UNIMPLEMENTED."""

    def __init__(self, scaler: Scaler | None):
        self.scaler = scaler

    async def Scale(self, request: pb.ScaleRequest, context) -> pb.ScaleResponse:
        if self.scaler is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                "this server cannot start workers (it was not started by `pdserve serve`)")
        prefill = request.prefill if request.HasField("prefill") else None
        decode = request.decode if request.HasField("decode") else None
        if prefill is None and decode is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "say how many workers: set prefill and/or decode")
        drain = request.drain_timeout_s if request.HasField("drain_timeout_s") else DEFAULT_DRAIN_TIMEOUT_S
        try:
            result = await self.scaler.scale(prefill, decode, drain)
        except ScaleError as exc:
            await context.abort(getattr(grpc.StatusCode, exc.code), exc.message)
        return pb.ScaleResponse(num_prefill_workers=result.num_prefill, num_decode_workers=result.num_decode,
                                added=result.added, removed=result.removed, num_requests_cut=result.num_cut)


def scale(target: str, prefill: int | None = None, decode: int | None = None,
          drain_timeout_s: float | None = None, timeout: float | None = None,
          api_key: str | None = None, tls_ca: str | bytes | None = None) -> pb.ScaleResponse:
    """Call ``Admin.Scale`` on the server at ``target`` (``host:port``); raises ``grpc.RpcError``.
    ``api_key`` (default ``$PDSERVE_API_KEY``) and ``tls_ca`` as for ``pdserve.client.Client``."""
    from pdserve.client import API_KEY_ENV, call_metadata, open_channel

    request = pb.ScaleRequest()
    if prefill is not None:
        request.prefill = prefill
    if decode is not None:
        request.decode = decode
    if drain_timeout_s is not None:
        request.drain_timeout_s = drain_timeout_s
    with open_channel(target, tls_ca, options=[]) as channel:
        return pb_grpc.AdminStub(channel).Scale(request, timeout=timeout,
                                                metadata=call_metadata(api_key or os.environ.get(API_KEY_ENV)))
