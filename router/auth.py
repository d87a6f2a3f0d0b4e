"""The client API key and TLS, for both front ends (gRPC and HTTP).

With an API key set (``pdserve serve --api-key`` or ``PDSERVE_API_KEY``), every call must carry
``Authorization: Bearer <key>``: an HTTP header, or the ``authorization`` metadata of a gRPC call.
Health checks stay open (``/health``, ``grpc.health.v1.Health``), so load balancers and
``pdserve generate --wait`` need no key; everything else, the Admin service included, needs it.
"""

from __future__ import annotations

import hmac
from pathlib import Path

import grpc

from pdserve.client import API_KEY_ENV  # noqa: F401  (the server reads the same variable)
OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/",)


def bearer_key_matches(header: str | None, api_key: str) -> bool:
    """Whether an ``Authorization`` value is ``Bearer <api_key>``, compared in constant time."""
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer "):].strip().encode(), api_key.encode())


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses gRPC calls without the API key with UNAUTHENTICATED (health checks excepted)."""

    def __init__(self, api_key: str):
        self.api_key = api_key

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_GRPC_PREFIXES):
            return handler
        metadata = dict(details.invocation_metadata or ())
        if bearer_key_matches(metadata.get("authorization"), self.api_key):
            return handler

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or wrong API key: send the metadata 'authorization: Bearer <key>' "
                                "(pdserve generate/scale --api-key, or PDSERVE_API_KEY)")

        kind = ("unary_unary" if handler.unary_unary else "unary_stream" if handler.unary_stream
                else "stream_unary" if handler.stream_unary else "stream_stream")
        make = getattr(grpc, f"{kind}_rpc_method_handler")
        return make(deny, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


def server_credentials(cert_file: str, key_file: str) -> grpc.ServerCredentials:
    """gRPC TLS credentials from a PEM certificate (chain) and its private key."""
    return grpc.ssl_server_credentials([(Path(key_file).read_bytes(), Path(cert_file).read_bytes())])
