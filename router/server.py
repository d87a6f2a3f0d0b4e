"""The router's servers: gRPC (the Generation and Admin services, health checking, reflection)
and, beside it on the same loop, the OpenAI-compatible HTTP API (``openai_api``).

``RouterServer`` runs on the caller's asyncio loop (``pdserve serve`` runs it on the main
one); ``start_in_thread`` runs one on a loop of its own, for tests and in-process tools. In
colocated mode it fronts a list of worker actors; in disaggregated mode a list of decode worker
actors and a list of prefill worker actors (``prefill_workers``).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import threading
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.router.auth import ApiKeyInterceptor, server_credentials
from pdserve.router.metrics import RouterMetrics
from pdserve.router.admin import SERVICE_NAME as ADMIN_SERVICE_NAME
from pdserve.router.admin import AdminService
from pdserve.router.preprocess import Preprocessor
from pdserve.router.request_parser import parse_generate_request
from pdserve.router.service import GenerationService
from pdserve.router.worker_pool import WorkerPool
from pdserve.v1 import admin_pb2_grpc
from pdserve.v1 import generation_pb2 as pb

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "pdserve.v1.Generation"
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


class PortInUse(OSError):
    """The address asked for could not be bound."""


def _version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - source tree only
        return "unknown"


@dataclass
class RouterConfig:
    """How the router listens and how much it queues."""

    host: str = "127.0.0.1"
    port: int = 50051  # 0 picks a free port
    model: str = "default"  # the name ServerInfo reports
    mode: str = "colocated"  # or "disaggregated" (needs prefill workers)
    transport: str = "grpc"  # how KV moves from prefill to decode workers (disaggregated mode)
    max_inflight_per_worker: int = 256
    max_queued_requests: int = 1024
    queue_timeout_s: float = 30.0  # longest wait for a worker with room, deadline or not
    shutdown_grace_s: float = 5.0
    metrics_port: int | None = None  # HTTP /metrics (Prometheus) on `host`; 0 picks a free port; None: off
    http_port: int | None = None  # the OpenAI-compatible HTTP API on `host`; 0 picks a free port; None: off
    api_key: str | None = None  # required on both front ends (router/auth.py) when set
    tls_cert: str | None = None  # PEM certificate and key: both front ends serve TLS only
    tls_key: str | None = None
    migration_limit: int = 3  # times a request may move to another worker after its worker failed it


def add_generation_service(service: GenerationService, server: grpc.aio.Server) -> None:
    """Register the Generation service as the generated ``add_GenerationServicer_to_server`` does, except
    that requests are parsed with ``parse_generate_request``: a request with invalid UTF-8 (or
    otherwise unparsable) reaches the service as a ``MalformedRequest``, answered INVALID_ARGUMENT
    naming the field, where grpc's own deserializer failure would answer UNKNOWN."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            service.Generate, request_deserializer=parse_generate_request,
            response_serializer=pb.GenerateResponse.SerializeToString),
        "Complete": grpc.unary_unary_rpc_method_handler(
            service.Complete, request_deserializer=parse_generate_request,
            response_serializer=pb.CompleteResponse.SerializeToString),
        "GetServerInfo": grpc.unary_unary_rpc_method_handler(
            service.GetServerInfo, request_deserializer=pb.GetServerInfoRequest.FromString,
            response_serializer=pb.ServerInfo.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


MODES = ("colocated", "disaggregated")
TRANSPORTS = ("grpc", "collective")


class RouterServer:
    """A ``grpc.aio`` server in front of worker actor handles.

    ``workers`` are the colocated workers, or the decode workers when ``config.mode`` is
    ``"disaggregated"``; then ``prefill_workers`` are the prefill workers. With an
    ``actor_factory`` (``router.scaling.ActorFactory``) the ``Admin.Scale`` RPC changes their
    numbers at run time; without one it answers UNIMPLEMENTED.
    """

    def __init__(self, workers: list, tokenizer, config: RouterConfig | None = None,
                 prefill_workers: list | None = None, actor_factory=None):
        self.config = config or RouterConfig()
        if self.config.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}; got {self.config.mode!r}")
        if self.config.mode == "disaggregated":
            if not prefill_workers:
                raise ValueError("disaggregated mode needs at least one prefill worker")
            if self.config.transport not in TRANSPORTS:
                raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}; got {self.config.transport!r}")
        elif prefill_workers:
            raise ValueError("prefill workers are for disaggregated mode; colocated workers prefill themselves")
        self._tokenizer = tokenizer
        self._actor_factory = actor_factory
        self._health = health.aio.HealthServicer()
        disaggregated = self.config.mode == "disaggregated"
        self.pool = WorkerPool(
            workers,
            prefill_actors=list(prefill_workers) if disaggregated else None,
            max_inflight_per_worker=self.config.max_inflight_per_worker,
            max_waiting=self.config.max_queued_requests,
            on_change=self._workers_changed,
            migration_limit=self.config.migration_limit,
            migration_timeout_s=self.config.queue_timeout_s,
            start_worker=self._start_worker if actor_factory is not None else None,
        )
        self.metrics = RouterMetrics(
            self.pool, self.config.mode, self.config.transport if disaggregated else "none",
            model=self.config.model, version=_version())
        self.pool.observer = self.metrics
        self.metrics_port: int | None = None
        self.http_port: int | None = None
        self._http = None  # openai_api.OpenAIFrontEnd
        self._server: grpc.aio.Server | None = None
        self.port: int | None = None

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def start(self) -> str:
        """Connect to the workers, bind the port and serve; return ``host:port``."""
        await self.pool.start()
        info = self.pool.model_info
        preprocessor = Preprocessor(
            self._tokenizer, max_model_len=int(info["max_model_len"]), vocab_size=int(info["vocab_size"])
        )
        server_info = pb.ServerInfo(
            model=self.config.model,
            max_model_len=int(info["max_model_len"]),
            mode=self.config.mode,
            num_prefill_workers=self.pool.num_prefill_alive,
            num_decode_workers=self.pool.num_alive,
            transport=self.config.transport if self.pool.disaggregated else "none",
            vocab_size=int(info["vocab_size"]),
            version=_version(),
        )
        service = GenerationService(
            self.pool, preprocessor, server_info, queue_timeout_s=self.config.queue_timeout_s,
            metrics=self.metrics,
        )
        interceptors = [ApiKeyInterceptor(self.config.api_key)] if self.config.api_key else []
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.so_reuseport", 0),  # a port in use is an error, not a shared port
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ]
        )
        add_generation_service(service, server)
        from pdserve.router.scaling import Scaler

        scaler = Scaler(self.pool, self._actor_factory) if self._actor_factory is not None else None
        admin_pb2_grpc.add_AdminServicer_to_server(AdminService(scaler), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, ADMIN_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server
        )
        target = f"{self.config.host}:{self.config.port}"
        tls = self.config.tls_cert is not None
        try:
            if tls:
                port = server.add_secure_port(target, server_credentials(self.config.tls_cert, self.config.tls_key))
            else:
                port = server.add_insecure_port(target)
        except RuntimeError as exc:
            port = 0
            cause = exc
        else:
            cause = None
        if not port:
            await self.pool.close()
            raise PortInUse(f"cannot listen on {target} (is the port in use?)") from cause
        self.port = port
        self.metrics.bind_loop(asyncio.get_running_loop())
        if self.config.metrics_port is not None:
            try:
                self.metrics_port = self.metrics.start_http(self.config.host, self.config.metrics_port)
            except OSError:
                await server.stop(None)
                await self.pool.close()
                raise
            logger.info("metrics on http://%s:%d/metrics", self.config.host, self.metrics_port)
        await server.start()
        self._server = server
        if self.config.http_port is not None:
            from pdserve.router.openai_api import OpenAIFrontEnd

            self._http = OpenAIFrontEnd(service, self._tokenizer, self.config.model, api_key=self.config.api_key,
                                        metrics=self.metrics, can_serve=lambda: self.pool.can_serve,
                                        max_model_len=int(info["max_model_len"]))
            try:
                self.http_port = await self._http.start(self.config.host, self.config.http_port,
                                                        self.config.tls_cert, self.config.tls_key)
            except OSError:
                await self.stop(0)
                raise
            logger.info("OpenAI-compatible API on %s://%s:%d/v1", "https" if tls else "http",
                        self.config.host, self.http_port)
        await self._set_health(self.pool.can_serve)
        logger.info("router listening on %s", self.address)
        return self.address

    async def stop(self, grace: float | None = None) -> None:
        """Refuse new requests, let running ones finish for ``grace`` seconds, then cancel."""
        if self._server is None:
            return
        await self._health.enter_graceful_shutdown()
        if self._http is not None:
            await self._http.stop()
            self._http = None
        await self._server.stop(self.config.shutdown_grace_s if grace is None else grace)
        await self.pool.close()
        self.metrics.stop_http()
        self._server = None

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    async def _start_worker(self, role: str) -> list:
        """One new actor of ``role``, started by the actor factory (it replaces a dead one)."""
        handles, _ = await asyncio.to_thread(self._actor_factory.start, role, 1)
        return handles

    def _workers_changed(self, can_serve: bool) -> None:
        if self._server is not None:
            asyncio.ensure_future(self._set_health(can_serve))

    async def _set_health(self, can_serve: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if can_serve else health_pb2.HealthCheckResponse.NOT_SERVING
        await self._health.set("", status)
        await self._health.set(SERVICE_NAME, status)


class BackgroundRouter:
    """A ``RouterServer`` on its own event loop in a daemon thread."""

    def __init__(self, workers: list, tokenizer, config: RouterConfig | None = None,
                 prefill_workers: list | None = None, actor_factory=None):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pdserve-router", daemon=True)
        self._thread.start()
        try:
            self.server = RouterServer(workers, tokenizer, config, prefill_workers, actor_factory)
            self.address = self._call(self.server.start())
        except BaseException:
            self._shutdown_loop()
            raise

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def metrics_port(self) -> int | None:
        return self.server.metrics_port

    @property
    def http_port(self) -> int | None:
        return self.server.http_port

    def _call(self, coro, timeout: float | None = 120):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def stop(self, grace: float = 1.0) -> None:
        if self._loop.is_closed():
            return
        try:
            self._call(self.server.stop(grace))
        finally:
            self._shutdown_loop()

    def _shutdown_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


def start_in_thread(workers: list, tokenizer, config: RouterConfig | None = None,
                    prefill_workers: list | None = None, actor_factory=None) -> BackgroundRouter:
    """Start a router on a background thread; returns once it listens (``.address``)."""
    return BackgroundRouter(workers, tokenizer, config, prefill_workers, actor_factory)
