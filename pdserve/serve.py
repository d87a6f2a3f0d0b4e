"""`pdserve serve`: start the worker actors on Ray and serve the router until Ctrl-C.

The flags, the checks made before anything starts (flag combinations, the cluster's resources),
and the start of the colocated or prefill + decode actors. `pdserve.cli` assembles the parser.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import sys

from pdserve.cli import DEFAULT_PORT, fail, non_negative_float, parse_size, positive_int

DEFAULT_METRICS_PORT = 8000  # where vLLM users find /metrics
DEFAULT_HTTP_PORT = 8080  # the OpenAI-compatible API (8000, vLLM's, is the metrics port's here)
LOG_LEVELS = ("debug", "info", "warning", "error")
RAY_NAMESPACE = "pdserve"
TRANSPORTS = ("grpc", "collective")  # the KV transports `--transport` accepts; the first is the default
logger = logging.getLogger("pdserve")


def add_parser(sub) -> None:
    """Add the ``serve`` command to the subparsers ``sub`` of ``pdserve``."""
    p = sub.add_parser(
        "serve",
        help="start workers and the router (gRPC and OpenAI-compatible HTTP APIs)",
        description="Start worker actors on Ray and serve the pdserve.v1 gRPC API and the "
        "OpenAI-compatible HTTP API until Ctrl-C. Starts a local Ray unless --address names a "
        "running cluster.",
    )
    p.add_argument("--mode", choices=["colocated", "disaggregated"], default="colocated",
                   help="colocated: every worker prefills and decodes (default); disaggregated: "
                   "prefill workers compute prompts and push their KV cache to decode workers")
    p.add_argument("--decode", type=positive_int, default=1, metavar="N",
                   help="number of decode workers (in colocated mode: workers) (default 1)")
    p.add_argument("--prefill", type=positive_int, default=None, metavar="N",
                   help="number of prefill workers (disaggregated mode; default 1)")
    p.add_argument("--decode-cpus", type=non_negative_float, default=None, metavar="N",
                   help="Ray CPUs each decode (or colocated) worker reserves (default 1)")
    p.add_argument("--decode-gpus", type=non_negative_float, default=None, metavar="N",
                   help="Ray GPUs each decode (or colocated) worker reserves; > 0 runs it on CUDA (default 0)")
    p.add_argument("--prefill-cpus", type=non_negative_float, default=None, metavar="N",
                   help="Ray CPUs each prefill worker reserves (disaggregated mode; default 1)")
    p.add_argument("--prefill-gpus", type=non_negative_float, default=None, metavar="N",
                   help="Ray GPUs each prefill worker reserves; > 0 runs it on CUDA (disaggregated mode; default 0)")
    p.add_argument("--decode-resources", default=None, metavar="SPEC",
                   help="Ray resources of each decode (or colocated) worker: JSON such as "
                   "'{\"GPU\": 1, \"decode_node\": 1}' or GPU=1,decode_node=1; CPU and GPU there replace "
                   "--decode-cpus/--decode-gpus, other names are custom resources that pin the workers to "
                   "nodes that advertise them (docs/cluster.md)")
    p.add_argument("--prefill-resources", default=None, metavar="SPEC",
                   help="Ray resources of each prefill worker, as --decode-resources (disaggregated mode)")
    p.add_argument("--resource-wait", type=non_negative_float, default=0.0, metavar="SECONDS",
                   help="how long to wait for a cluster that lacks the workers' resources to grow "
                   "(an autoscaler adding nodes); 0 fails at once, naming what is missing (default 0)")
    p.add_argument("--name", default="pdserve", type=_actor_name,
                   help="prefix of this server's actor names (NAME-decode-0, ...): give two servers "
                   "on one Ray cluster different names (default pdserve)")
    p.add_argument("--transport", choices=list(TRANSPORTS), default=None,
                   help="how KV moves from prefill to decode workers: grpc (a stream of frames) or "
                   "collective (torch point-to-point: gloo on CPU, nccl on CUDA) (disaggregated mode; "
                   "default: collective when prefill and decode workers both run on GPUs, grpc otherwise)")
    p.add_argument("--kv-push", choices=["chunk", "layer"], default=None,
                   help="when a prefill worker pushes a computed chunk's KV: chunk (once the chunk is "
                   "computed; a prompt's last chunk after token #1 is sent) or layer (as each group of "
                   "layers is computed, overlapping the chunk itself) (disaggregated mode; default chunk)")
    p.add_argument("--model", default="default", metavar="PATH",
                   help="'default' (SmolLM2-135M-Instruct), a Hugging Face model directory or a .gguf file")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"port to listen on; 0 picks a free one (default {DEFAULT_PORT})")
    p.add_argument("--address", default=None, metavar="RAY_ADDRESS",
                   help="join this Ray cluster (e.g. 'auto' or HOST:6379) instead of starting one")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads per worker (default: torch's choice)")
    p.add_argument("--kv-memory", type=parse_size, default=None, metavar="SIZE",
                   help="KV cache size per worker, e.g. 512MiB or 2GB (default: the engine's)")
    p.add_argument("--max-model-len", type=positive_int, default=None, metavar="N",
                   help="context length (default: the model's)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--max-inflight", type=positive_int, default=256, metavar="N",
                   help="most requests the router keeps on one worker (default 256)")
    p.add_argument("--max-queued", type=positive_int, default=1024, metavar="N",
                   help="most requests waiting for a worker with room (default 1024)")
    p.add_argument("--queue-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="longest wait for a worker with room before RESOURCE_EXHAUSTED (default 30)")
    p.add_argument("--metrics-port", type=_port_or_off, default=None, metavar="PORT",
                   help=f"serve Prometheus metrics at http://HOST:PORT/metrics; 0 picks a free port, 'off' "
                   f"disables (default {DEFAULT_METRICS_PORT}; a free port when --port is 0)")
    p.add_argument("--migration-limit", type=int, default=3, metavar="N",
                   help="times a request may move to a healthy worker after its worker died or its KV "
                   "transfer failed, before it fails with UNAVAILABLE (default 3; 0: never)")
    p.add_argument("--http-port", type=_port_or_off, default=None, metavar="PORT",
                   help=f"serve the OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models, "
                   f"/health, /metrics) on HOST:PORT; 0 picks a free port, 'off' disables (default "
                   f"{DEFAULT_HTTP_PORT}; a free port when --port is 0)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on both APIs (health checks stay open); "
                   "default: $PDSERVE_API_KEY, else no key")
    p.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="serve both APIs over TLS with this certificate (chain); needs --tls-key")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="the private key of --tls-cert")
    p.add_argument("--cluster-secret-file", default=None, metavar="PATH",
                   help="disaggregated mode: the cluster secret that authenticates the KV plane between "
                   "prefill and decode actors (hex, or raw bytes; at least 16 bytes); default: "
                   "$PDSERVE_CLUSTER_SECRET (hex), else a fresh random one per server")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                   help="log level of the server process; 'info' logs one line per finished request "
                   "(default info)")
    p.set_defaults(func=cmd_serve)


def _port_or_off(text: str) -> int | str:
    if text.strip().lower() in ("off", "none", "disabled"):
        return "off"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number (0 for a free one) or 'off', got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number from 0 to 65535 or 'off', got {value}")
    return value


def _actor_name(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", text):
        raise argparse.ArgumentTypeError(f"expected letters, digits, '.', '_' or '-' (at most 64), got {text!r}")
    return text



def _merge_role_resources(args: argparse.Namespace, role: str) -> None:
    """Merge --ROLE-resources with --ROLE-cpus/--ROLE-gpus into ``args.ROLE_role`` (a
    ``RoleResources``) and write the merged CPU/GPU counts back; ``ResourceSpecError`` if they clash."""
    from pdserve.router.resources import parse_resources, role_resources

    flag = f"--{role}-resources"
    merged = role_resources(parse_resources(getattr(args, f"{role}_resources", None) or "", flag),
                            getattr(args, f"{role}_cpus"), getattr(args, f"{role}_gpus"), flag)
    setattr(args, f"{role}_role", merged)
    setattr(args, f"{role}_cpus", merged.num_cpus)
    setattr(args, f"{role}_gpus", merged.num_gpus)


def check_serve_args(args: argparse.Namespace) -> str | None:
    """Fill in the disaggregated-mode defaults; the error for flags the mode does not use."""
    from pdserve.router.resources import ResourceSpecError

    if getattr(args, "decode_role", None) is not None:
        return None  # checked already: the flags now hold the merged values
    try:
        _merge_role_resources(args, "decode")
    except ResourceSpecError as exc:
        return str(exc)
    if getattr(args, "migration_limit", 0) < 0:
        return f"--migration-limit must be >= 0; got {args.migration_limit}"
    if (getattr(args, "tls_cert", None) is None) != (getattr(args, "tls_key", None) is None):
        return "--tls-cert and --tls-key go together: give both, or neither"
    for flag in ("tls_cert", "tls_key"):
        path = getattr(args, flag, None)
        if path is not None and not os.path.isfile(path):
            return f"--{flag.replace('_', '-')}: no such file {path}"
    if args.mode == "colocated":
        if args.prefill is not None:
            return "--prefill applies to --mode disaggregated only; colocated workers prefill themselves"
        for flag in ("prefill_cpus", "prefill_gpus", "prefill_resources", "transport", "kv_push"):
            if getattr(args, flag, None) is not None:
                return f"--{flag.replace('_', '-')} applies to --mode disaggregated only"
        return None
    args.prefill = 1 if args.prefill is None else args.prefill
    try:
        _merge_role_resources(args, "prefill")
    except ResourceSpecError as exc:
        return str(exc)
    args.transport = args.transport or default_transport(args.prefill_gpus, args.decode_gpus)
    return None


def default_transport(prefill_gpus: float | None, decode_gpus: float | None) -> str:
    """``collective`` (NCCL, GPU to GPU) when prefill and decode workers both hold GPUs, else
    ``grpc``: gloo on CPU is no faster than gRPC here, and a CPU side cannot join NCCL."""
    both_on_gpus = (prefill_gpus or 0) > 0 and (decode_gpus or 0) > 0
    return "collective" if both_on_gpus else TRANSPORTS[0]


def check_resources(args: argparse.Namespace, strict: bool) -> str | None:
    """Whether the Ray cluster has the resources the actors ask for, in all and on single nodes
    (an actor runs on one node): actors that do not fit wait forever, so say so at once
    (``strict``; otherwise only warn: with --resource-wait an autoscaler may add nodes)."""
    import ray

    from pdserve.router.resources import cluster_nodes, unplaceable

    want = {"CPU": args.decode * args.decode_cpus, "GPU": args.decode * args.decode_gpus}
    if args.mode == "disaggregated":
        want["CPU"] += args.prefill * args.prefill_cpus
        want["GPU"] += args.prefill * args.prefill_gpus
    have = ray.cluster_resources()
    for kind, need in want.items():
        if need > have.get(kind, 0) + 1e-9:
            message = (f"the workers ask for {need:g} {kind}s in all but the Ray cluster has "
                       f"{have.get(kind, 0):g}; lower --decode-{kind.lower()}s/--prefill-{kind.lower()}s "
                       f"({kind} in --decode-resources/--prefill-resources; fractions are fine, e.g. 0.5) "
                       "or the number of workers")
            if strict:
                return message
            logger.warning("%s (waiting for the cluster to grow)", message)
    demands = [("decode" if args.mode == "disaggregated" else "colocated", args.decode, _role(args, "decode"))]
    if args.mode == "disaggregated":
        demands.append(("prefill", args.prefill, _role(args, "prefill")))
    message = unplaceable(demands, cluster_nodes())
    if message:
        if strict:
            return message + ("" if args.address is None else
                              "; or let an autoscaler add nodes: --resource-wait SECONDS")
        logger.warning("%s (waiting up to %g s for the cluster to grow)", message, args.resource_wait)
    return None


def cmd_serve(args: argparse.Namespace) -> int:
    """Run ``pdserve serve``: check the flags and the cluster, start the workers, serve until Ctrl-C."""
    error = check_serve_args(args)
    if error:
        return fail(error, 2)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")

    from pdserve.engine.model_loader import ModelNotFoundError, load_tokenizer

    try:
        tokenizer = load_tokenizer(args.model)
    except ModelNotFoundError as exc:
        return fail(str(exc))

    if args.mode == "disaggregated":
        try:  # before Ray and the actors start: a bad secret file stops the server at once
            cluster_secret(args)
        except (OSError, ValueError) as exc:
            return fail(f"cannot read the cluster secret: {exc}")

    import ray

    started_ray = not ray.is_initialized()
    if started_ray:
        # One namespace for every pdserve driver, so its named actors can be found in the cluster.
        if args.address:
            ray.init(address=args.address, namespace=RAY_NAMESPACE)
        else:
            ray.init(address="local", include_dashboard=False, namespace=RAY_NAMESPACE)
    workers: list = []
    prefill_workers: list = []
    factory = None
    try:
        error = check_resources(args, strict=not (args.address and args.resource_wait))
        if error:
            return fail(error)
        factory = actor_factory(args)
        from pdserve.router.scaling import StartFailed

        try:
            if args.mode == "disaggregated":
                workers, prefill_workers = start_disaggregated_workers(args, factory)
            else:
                workers = start_colocated_workers(args, factory)
        except StartFailed as exc:
            return fail(str(exc))
        return asyncio.run(_serve(args, workers, tokenizer, prefill_workers, factory))
    finally:
        for w in workers + prefill_workers + (factory.started if factory is not None else []):
            try:
                ray.kill(w)
            except Exception:  # already gone
                pass
        if started_ray:
            ray.shutdown()
        print("pdserve: stopped", file=sys.stderr, flush=True)


def _engine_config(args: argparse.Namespace):
    from pdserve.engine.config import EngineConfig

    config = EngineConfig(model=args.model, device=args.device, threads=args.threads,
                          max_model_len=args.max_model_len, show_progress=False)
    if args.kv_memory is not None:
        config.kv_cache_bytes = args.kv_memory
    return config


def actor_factory(args: argparse.Namespace):
    """What starts this server's worker actors, now and when `pdserve scale` asks for more."""
    from pdserve.decode_worker.worker import WorkerConfig
    from pdserve.router.scaling import ActorFactory

    if args.mode == "disaggregated":
        from pdserve.prefill_worker.worker import PrefillConfig

        secret = cluster_secret(args)  # one per server; every actor it starts (scaled, replaced) gets it
        configs = {"decode": WorkerConfig(engine=_engine_config(args), transport=args.transport, cluster_secret=secret),
                   "prefill": PrefillConfig(engine=_engine_config(args), transport=args.transport, cluster_secret=secret,
                                            **({"kv_push": args.kv_push} if getattr(args, "kv_push", None) else {}))}
        resources = {"decode": _role(args, "decode"), "prefill": _role(args, "prefill")}
    else:
        configs = {"colocated": WorkerConfig(engine=_engine_config(args))}
        resources = {"colocated": _role(args, "decode")}
    return ActorFactory(configs, resources, resource_wait_s=args.resource_wait, name=args.name)


def cluster_secret(args: argparse.Namespace) -> bytes:
    """The server's cluster secret (``kv_transfer.auth``): from ``--cluster-secret-file``, else
    ``$PDSERVE_CLUSTER_SECRET``, else generated; loaded once and kept on ``args``. Never printed."""
    from pdserve.kv_transfer.auth import load_cluster_secret

    secret = getattr(args, "cluster_secret", None)
    if secret is None:
        secret, _ = load_cluster_secret(getattr(args, "cluster_secret_file", None))
        args.cluster_secret = secret
    return secret


def _role(args: argparse.Namespace, role: str):
    """The ``RoleResources`` of ``role`` ("decode" or "prefill") from the checked flags."""
    from pdserve.router.resources import RoleResources

    custom = getattr(args, f"{role}_role", None)
    return RoleResources(num_cpus=getattr(args, f"{role}_cpus"), num_gpus=getattr(args, f"{role}_gpus"),
                         custom=dict(custom.custom) if custom is not None else {})


def start_colocated_workers(args: argparse.Namespace, factory=None) -> list:
    """Start ``args.decode`` colocated worker actors and return their handles."""
    factory = factory or actor_factory(args)
    return factory.start("colocated", args.decode)[0]


def start_disaggregated_workers(args: argparse.Namespace, factory=None) -> tuple[list, list]:
    """Start ``args.decode`` decode actors (each with a KV receiver for ``args.transport``) and
    ``args.prefill`` prefill actors, both roles at once; return both lists of handles."""
    from concurrent.futures import ThreadPoolExecutor

    import ray

    factory = factory or actor_factory(args)
    with ThreadPoolExecutor(2) as pool:
        decode = pool.submit(factory.start, "decode", args.decode)
        prefill = pool.submit(factory.start, "prefill", args.prefill)
        started = [f.result()[0] for f in (decode, prefill) if f.exception() is None]
        failed = [f.exception() for f in (decode, prefill) if f.exception() is not None]
    if failed:
        for handles in started:
            for w in handles:
                ray.kill(w)
        raise failed[0]
    return decode.result()[0], prefill.result()[0]


async def _serve(args: argparse.Namespace, workers: list, tokenizer, prefill_workers: list = (),
                 factory=None) -> int:
    from pdserve.router.metrics import MetricsPortInUse
    from pdserve.router.server import PortInUse, RouterConfig, RouterServer

    from pdserve.router.auth import API_KEY_ENV
    from pdserve.router.openai_api import HttpPortInUse

    metrics_port = args.metrics_port
    if metrics_port is None:
        metrics_port = 0 if args.port == 0 else DEFAULT_METRICS_PORT
    http_port = args.http_port
    if http_port is None:
        http_port = 0 if args.port == 0 else DEFAULT_HTTP_PORT
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    server = RouterServer(workers, tokenizer, RouterConfig(
        host=args.host, port=args.port, model=args.model, mode=args.mode,
        transport=args.transport or TRANSPORTS[0],
        max_inflight_per_worker=args.max_inflight, max_queued_requests=args.max_queued,
        queue_timeout_s=args.queue_timeout, metrics_port=None if metrics_port == "off" else metrics_port,
        http_port=None if http_port == "off" else http_port, api_key=api_key,
        migration_limit=args.migration_limit,
        tls_cert=args.tls_cert, tls_key=args.tls_key,
    ), prefill_workers=list(prefill_workers) or None, actor_factory=factory)
    try:
        address = await server.start()
    except (PortInUse, MetricsPortInUse, HttpPortInUse) as exc:
        return fail(str(exc))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if prefill_workers:
        what = (f"{len(prefill_workers)} prefill + {len(workers)} decode worker"
                f"{'s' if len(workers) != 1 else ''}, KV over {args.transport}")
    else:
        what = f"{len(workers)} worker{'s' if len(workers) != 1 else ''}"
    # One line, so that a launcher reading it learns both addresses at once.
    metrics = f"metrics on http://{args.host}:{server.metrics_port}/metrics; " if server.metrics_port is not None else ""
    scheme = "https" if args.tls_cert else "http"
    http = f"OpenAI API on {scheme}://{args.host}:{server.http_port}/v1; " if server.http_port is not None else ""
    print(f"pdserve: listening on {address} ({args.mode}, {what}, model {args.model}); {metrics}{http}Ctrl-C stops",
          flush=True)
    await stop.wait()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.remove_signal_handler(sig)  # a second Ctrl-C interrupts the shutdown itself
    print("pdserve: shutting down", file=sys.stderr, flush=True)
    await server.stop()
    return 0

