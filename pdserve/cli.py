"""The ``pdserve`` command: ``serve``, ``generate``, and subcommands registered below.

Adding a subcommand that lives in another module: put one line in ``COMMANDS`` (a top-level
command such as ``loadtest``) or ``BENCH_COMMANDS`` (``pdserve bench NAME``). The module must
define ``add_arguments(parser)`` and ``run(args) -> int``; it is imported only when its command
is the one being run (or asked for ``--help``), so the other commands start fast.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import re
import signal
import sys
from typing import Sequence

# (name, module, help) of top-level commands defined in other modules.
COMMANDS: list[tuple[str, str, str]] = [
    ("loadtest", "pdserve.loadtest.cli", "drive a server with a workload; compare colocated vs disaggregated"),
]

# (name, module, help) of `pdserve bench NAME` commands.
BENCH_COMMANDS: list[tuple[str, str, str]] = [
    ("engine", "pdserve.engine.bench", "engine vs Hugging Face generate(): decode and prefill tokens/s"),
    ("offline", "pdserve.decode_worker.bench", "offline throughput: continuous batching vs HF static batches"),
    ("transfer", "pdserve.kv_transfer.bench", "KV transfer MB/s vs raw TCP, and TTFT disaggregated vs colocated"),
]

DEFAULT_PORT = 50051
RAY_NAMESPACE = "pdserve"
TRANSPORTS = ("grpc", "collective")  # the KV transports `--transport` accepts; the first is the default
logger = logging.getLogger("pdserve")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The argument parser; ``argv`` decides which registered modules get imported."""
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Disaggregated prefill/decode LLM serving on Ray."
    )
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    _add_serve(sub)
    _add_generate(sub)
    for name, module, help_text in COMMANDS:
        _add_lazy(sub, name, module, help_text, selected=argv[:1] == [name])
    if BENCH_COMMANDS:
        bench = sub.add_parser("bench", help="benchmarks (see `pdserve bench --help`)")
        bench_sub = bench.add_subparsers(title="benchmarks", metavar="BENCH")
        for name, module, help_text in BENCH_COMMANDS:
            _add_lazy(bench_sub, name, module, help_text, selected=argv[:2] == ["bench", name])
    return parser


def _add_lazy(sub, name: str, module: str, help_text: str, selected: bool) -> None:
    p = sub.add_parser(name, help=help_text, description=help_text)
    if selected:
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        p.set_defaults(func=mod.run)


# ---- serve -------------------------------------------------------------------------------------


def _add_serve(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="start workers and the gRPC router",
        description="Start worker actors on Ray and serve the pdserve.v1 gRPC API until Ctrl-C. "
        "Starts a local Ray unless --address names a running cluster.",
    )
    p.add_argument("--mode", choices=["colocated", "disaggregated"], default="colocated",
                   help="colocated: every worker prefills and decodes (default); disaggregated: "
                   "prefill workers compute prompts and push their KV cache to decode workers")
    p.add_argument("--decode", type=_positive_int, default=1, metavar="N",
                   help="number of decode workers (in colocated mode: workers) (default 1)")
    p.add_argument("--prefill", type=_positive_int, default=None, metavar="N",
                   help="number of prefill workers (disaggregated mode; default 1)")
    p.add_argument("--decode-cpus", type=_non_negative_float, default=1.0, metavar="N",
                   help="Ray CPUs each decode (or colocated) worker reserves (default 1)")
    p.add_argument("--decode-gpus", type=_non_negative_float, default=0.0, metavar="N",
                   help="Ray GPUs each decode (or colocated) worker reserves; > 0 runs it on CUDA (default 0)")
    p.add_argument("--prefill-cpus", type=_non_negative_float, default=None, metavar="N",
                   help="Ray CPUs each prefill worker reserves (disaggregated mode; default 1)")
    p.add_argument("--prefill-gpus", type=_non_negative_float, default=None, metavar="N",
                   help="Ray GPUs each prefill worker reserves; > 0 runs it on CUDA (disaggregated mode; default 0)")
    p.add_argument("--transport", choices=list(TRANSPORTS), default=None,
                   help="how KV moves from prefill to decode workers: grpc (a stream of frames) or "
                   "collective (torch point-to-point: gloo on CPU, nccl on CUDA) (disaggregated mode; "
                   "default grpc)")
    p.add_argument("--model", default="default", metavar="PATH",
                   help="'default' (SmolLM2-135M-Instruct), a Hugging Face model directory or a .gguf file")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"port to listen on; 0 picks a free one (default {DEFAULT_PORT})")
    p.add_argument("--address", default=None, metavar="RAY_ADDRESS",
                   help="join this Ray cluster (e.g. 'auto' or HOST:6379) instead of starting one")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="torch threads per worker (default: torch's choice)")
    p.add_argument("--kv-memory", type=parse_size, default=None, metavar="SIZE",
                   help="KV cache size per worker, e.g. 512MiB or 2GB (default: the engine's)")
    p.add_argument("--max-model-len", type=_positive_int, default=None, metavar="N",
                   help="context length (default: the model's)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--max-inflight", type=_positive_int, default=256, metavar="N",
                   help="most requests the router keeps on one worker (default 256)")
    p.add_argument("--max-queued", type=_positive_int, default=1024, metavar="N",
                   help="most requests waiting for a worker with room (default 1024)")
    p.add_argument("--queue-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="longest wait for a worker with room before RESOURCE_EXHAUSTED (default 30)")
    p.set_defaults(func=cmd_serve)


def parse_size(text: str) -> int:
    """``"512MiB"``, ``"2GB"``, ``"1g"``, ``"1048576"`` -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 512MiB or 2GB)")
    number, unit, suffix = float(m.group(1)), m.group(2).lower(), m.group(3).lower()
    base = 1000 if suffix == "b" and unit else 1024
    return int(number * base ** " kmgt".index(unit or " "))


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def _fail(message: str, code: int = 1) -> int:
    print(f"pdserve: error: {message}", file=sys.stderr)
    return code


def _check_serve_args(args: argparse.Namespace) -> str | None:
    """Fill in the disaggregated-mode defaults; the error for flags the mode does not use."""
    if args.mode == "colocated":
        if args.prefill is not None:
            return "--prefill applies to --mode disaggregated only; colocated workers prefill themselves"
        for flag in ("prefill_cpus", "prefill_gpus", "transport"):
            if getattr(args, flag) is not None:
                return f"--{flag.replace('_', '-')} applies to --mode disaggregated only"
        return None
    args.prefill = 1 if args.prefill is None else args.prefill
    args.prefill_cpus = 1.0 if args.prefill_cpus is None else args.prefill_cpus
    args.prefill_gpus = 0.0 if args.prefill_gpus is None else args.prefill_gpus
    args.transport = args.transport or TRANSPORTS[0]
    return None


def _check_resources(args: argparse.Namespace, strict: bool) -> str | None:
    """Whether the Ray cluster has the CPUs and GPUs the actors ask for: actors that do not fit
    wait forever for resources, so say so at once (``strict``: the Ray we started ourselves;
    otherwise only warn, since a cluster may grow)."""
    import ray

    want = {"CPU": args.decode * args.decode_cpus, "GPU": args.decode * args.decode_gpus}
    if args.mode == "disaggregated":
        want["CPU"] += args.prefill * args.prefill_cpus
        want["GPU"] += args.prefill * args.prefill_gpus
    have = ray.cluster_resources()
    for kind, need in want.items():
        if need > have.get(kind, 0) + 1e-9:
            message = (f"the workers ask for {need:g} {kind}s in all but the Ray cluster has "
                       f"{have.get(kind, 0):g}; lower --decode-{kind.lower()}s/--prefill-{kind.lower()}s "
                       "(fractions are fine, e.g. 0.5) or the number of workers")
            if strict:
                return message
            logger.warning("%s (waiting for the cluster to grow)", message)
    return None


def cmd_serve(args: argparse.Namespace) -> int:
    error = _check_serve_args(args)
    if error:
        return _fail(error, 2)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    from pdserve.engine.model_loader import ModelNotFoundError, load_tokenizer

    try:
        tokenizer = load_tokenizer(args.model)
    except ModelNotFoundError as exc:
        return _fail(str(exc))

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
    try:
        error = _check_resources(args, strict=started_ray and not args.address)
        if error:
            return _fail(error)
        if args.mode == "disaggregated":
            workers, prefill_workers = start_disaggregated_workers(args)
        else:
            workers = start_colocated_workers(args)
        return asyncio.run(_serve(args, workers, tokenizer, prefill_workers))
    finally:
        for w in workers + prefill_workers:
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


def start_colocated_workers(args: argparse.Namespace) -> list:
    """Start ``args.decode`` colocated worker actors and return their handles."""
    try:
        from pdserve.decode_worker.worker import start_workers
    except ImportError as exc:
        raise SystemExit(f"pdserve: error: the worker actor is not available in this build ({exc})")
    return start_workers(_engine_config(args), num_workers=args.decode,
                         num_cpus=args.decode_cpus, num_gpus=args.decode_gpus)


def start_disaggregated_workers(args: argparse.Namespace) -> tuple[list, list]:
    """Start ``args.decode`` decode actors (each with a KV receiver for ``args.transport``) and
    ``args.prefill`` prefill actors, both roles at once; return both lists of handles."""
    from concurrent.futures import ThreadPoolExecutor

    import ray

    from pdserve.decode_worker.worker import WorkerConfig, start_workers
    from pdserve.prefill_worker.worker import PrefillConfig, start_prefill_workers

    with ThreadPoolExecutor(2) as pool:
        decode = pool.submit(start_workers, WorkerConfig(engine=_engine_config(args), transport=args.transport),
                             num_workers=args.decode, num_cpus=args.decode_cpus, num_gpus=args.decode_gpus,
                             role="decode")
        prefill = pool.submit(start_prefill_workers,
                              PrefillConfig(engine=_engine_config(args), transport=args.transport),
                              num_workers=args.prefill, num_cpus=args.prefill_cpus, num_gpus=args.prefill_gpus)
        started = [f.result() for f in (decode, prefill) if f.exception() is None]
        failed = [f.exception() for f in (decode, prefill) if f.exception() is not None]
    if failed:
        for handles in started:
            for w in handles:
                ray.kill(w)
        raise failed[0]
    return decode.result(), prefill.result()


async def _serve(args: argparse.Namespace, workers: list, tokenizer, prefill_workers: list = ()) -> int:
    from pdserve.router.server import PortInUse, RouterConfig, RouterServer

    server = RouterServer(workers, tokenizer, RouterConfig(
        host=args.host, port=args.port, model=args.model, mode=args.mode,
        transport=args.transport or TRANSPORTS[0],
        max_inflight_per_worker=args.max_inflight, max_queued_requests=args.max_queued,
        queue_timeout_s=args.queue_timeout,
    ), prefill_workers=list(prefill_workers) or None)
    try:
        address = await server.start()
    except PortInUse as exc:
        return _fail(str(exc))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if prefill_workers:
        what = (f"{len(prefill_workers)} prefill + {len(workers)} decode worker"
                f"{'s' if len(workers) != 1 else ''}, KV over {args.transport}")
    else:
        what = f"{len(workers)} worker{'s' if len(workers) != 1 else ''}"
    print(f"pdserve: listening on {address} ({args.mode}, {what}, model {args.model}); Ctrl-C stops",
          flush=True)
    await stop.wait()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.remove_signal_handler(sig)  # a second Ctrl-C interrupts the shutdown itself
    print("pdserve: shutting down", file=sys.stderr, flush=True)
    await server.stop()
    return 0


# ---- generate ----------------------------------------------------------------------------------


def _add_generate(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="send one request to a server and stream the answer",
        description="Send TEXT (or chat messages) to a pdserve server and stream the answer to "
        "stdout. TEXT defaults to standard input.",
    )
    p.add_argument("text", nargs="?", metavar="TEXT", help="the prompt ('-' or absent: read stdin)")
    p.add_argument("--target", default=f"127.0.0.1:{DEFAULT_PORT}", metavar="HOST:PORT",
                   help=f"server address (default 127.0.0.1:{DEFAULT_PORT})")
    p.add_argument("--chat", action="store_true", help="send TEXT as one user message (chat template)")
    p.add_argument("--messages", metavar="FILE.json",
                   help="chat messages: a JSON list of {role, content}; TEXT, if given, is appended "
                   "as a user message")
    p.add_argument("--max-tokens", type=int, default=None, metavar="N")
    p.add_argument("--temperature", type=float, default=None, metavar="T", help="0 is greedy (default 1)")
    p.add_argument("--top-p", type=float, default=None, metavar="P")
    p.add_argument("--top-k", type=int, default=None, metavar="K")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], metavar="STRING", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", action="store_true", help="report each token's log-probability (--json)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS", help="deadline of the request")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per streamed response instead of plain text")
    p.set_defaults(func=cmd_generate)


def _request_input(args: argparse.Namespace) -> dict:
    text = args.text
    if args.messages:
        try:
            with open(args.messages, encoding="utf-8") as f:
                messages = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"--messages {args.messages}: {exc}") from None
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise ValueError(f"--messages {args.messages}: expected a JSON list of {{\"role\": ..., \"content\": ...}}")
        if text is not None:
            messages.append({"role": "user", "content": _read_text(text)})
        return {"messages": messages}
    text = _read_text(text)
    if args.chat:
        return {"messages": [{"role": "user", "content": text}]}
    return {"prompt": text}


def _read_text(text: str | None) -> str:
    if text is None or text == "-":
        if sys.stdin is None or sys.stdin.isatty():
            raise ValueError("give TEXT, pipe it on stdin, or use --messages FILE.json")
        return sys.stdin.read()
    return text


def cmd_generate(args: argparse.Namespace, out=None) -> int:
    from pdserve.client import Client, RequestError

    out = out or sys.stdout
    try:
        inputs = _request_input(args)
    except ValueError as exc:
        return _fail(str(exc), 2)
    params = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                  top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
                  logprobs=args.logprobs)
    last = None
    with Client(args.target, timeout=args.timeout) as client:
        try:
            with client.generate(**inputs, **params) as stream:
                for chunk in stream:
                    last = chunk
                    if args.json:
                        out.write(json.dumps(_chunk_json(chunk), ensure_ascii=False) + "\n")
                    else:
                        out.write(chunk.text)
                    out.flush()
        except RequestError as exc:
            if not args.json and last is not None:
                out.write("\n")
            hint = ""
            if exc.code.name == "UNAVAILABLE" and last is None and "connect" in exc.message.lower():
                hint = f" (is `pdserve serve` running at {args.target}?)"
            return _fail(f"{exc.code.name}: {exc.message}{hint}")
    if not args.json and last is not None:
        out.write("\n")
        out.flush()
        t = last.timings
        rate = (last.completion_tokens - 1) / t.decode_s if t.decode_s > 0 and last.completion_tokens > 1 else 0.0
        print(f"[{last.finish_reason}: {last.prompt_tokens} prompt + {last.completion_tokens} "
              f"completion tokens; ttft {t.ttft_s:.3f} s, decode {rate:.1f} tokens/s, "
              f"total {t.e2e_s:.3f} s]", file=sys.stderr)
    return 0


def _chunk_json(chunk) -> dict:
    obj: dict = {"token_ids": chunk.token_ids, "text": chunk.text}
    if chunk.logprobs is not None:
        obj["logprobs"] = chunk.logprobs
    if chunk.finish_reason is not None:
        t = chunk.timings
        obj.update(
            request_id=chunk.request_id,
            finish_reason=chunk.finish_reason,
            prompt_tokens=chunk.prompt_tokens,
            completion_tokens=chunk.completion_tokens,
            timings={"queued_s": t.queued_s, "prefill_s": t.prefill_s, "transfer_s": t.transfer_s,
                     "ttft_s": t.ttft_s, "decode_s": t.decode_s, "e2e_s": t.e2e_s},
        )
    return obj


if __name__ == "__main__":
    sys.exit(main())
