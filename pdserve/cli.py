"""The ``pdserve`` command: the parser, the client commands ``generate`` and ``scale``, the
argument types the commands share, and the subcommands registered below. ``serve`` lives in
``pdserve.serve``.

Adding a subcommand that lives in another module: put one line in ``COMMANDS`` (a top-level
command such as ``loadtest``) or ``BENCH_COMMANDS`` (``pdserve bench NAME``). The module must
define ``add_arguments(parser)`` and ``run(args) -> int``; it is imported only when its command
is the one being run (or asked for ``--help``), so the other commands start fast.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from typing import Sequence

# (name, module, help) of top-level commands defined in other modules.
COMMANDS: list[tuple[str, str, str]] = [
    ("loadtest", "pdserve.loadtest.cli", "drive a server with a workload; compare colocated vs disaggregated"),
]

# (name, module, help) of `pdserve bench NAME` commands.
BENCH_COMMANDS: list[tuple[str, str, str]] = [
    ("engine", "pdserve.bench.engine", "engine vs Hugging Face generate(): decode and prefill tokens/s"),
    ("offline", "pdserve.bench.offline", "offline throughput: continuous batching vs HF static batches"),
    ("transfer", "pdserve.bench.transfer", "KV transfer MB/s vs raw TCP, and TTFT disaggregated vs colocated"),
    ("faults", "pdserve.bench.faults", "a worker killed under load: requests lost, goodput, time to recover"),
    ("judge", "pdserve.bench.judge", "a running server driven by AIPerf and by pdserve loadtest: TTFT/ITL side by side"),
]

DEFAULT_PORT = 50051


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
    from pdserve import serve  # here, not at the top: pdserve.serve imports this module's argument types

    serve.add_parser(sub)
    _add_generate(sub)
    _add_scale(sub)
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


# ---- argument types shared by the commands ----------------------------------------------------


def parse_size(text: str) -> int:
    """``"512MiB"``, ``"2GB"``, ``"1g"``, ``"1048576"`` -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 512MiB or 2GB)")
    number, unit, suffix = float(m.group(1)), m.group(2).lower(), m.group(3).lower()
    base = 1000 if suffix == "b" and unit else 1024
    return int(number * base ** " kmgt".index(unit or " "))


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """An argparse type: a number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def fail(message: str, code: int = 1) -> int:
    """Print ``pdserve: error: MESSAGE`` to stderr and return the exit code ``code``."""
    print(f"pdserve: error: {message}", file=sys.stderr)
    return code


# ---- scale -------------------------------------------------------------------------------------


def _add_scale(sub) -> None:
    p = sub.add_parser(
        "scale",
        help="change the number of prefill/decode workers of a running server",
        description="Ask a running `pdserve serve` to run N prefill and M decode workers (colocated "
        "mode: M workers). New workers start and join before the command returns; removed ones drain "
        "(no new requests, running ones finish) and stop. No request is lost.",
    )
    p.add_argument("--prefill", type=positive_int, default=None, metavar="N",
                   help="prefill workers wanted (disaggregated mode); absent: unchanged")
    p.add_argument("--decode", type=positive_int, default=None, metavar="M",
                   help="decode workers wanted (colocated mode: workers); absent: unchanged")
    p.add_argument("--address", "--target", dest="target", default=f"127.0.0.1:{DEFAULT_PORT}",
                   metavar="HOST:PORT", help=f"the server (default 127.0.0.1:{DEFAULT_PORT})")
    p.add_argument("--drain-timeout", type=non_negative_float, default=None, metavar="SECONDS",
                   help="longest wait for a removed worker's running requests; past it they fail "
                   "(default 300)")
    p.add_argument("--timeout", type=non_negative_float, default=None, metavar="SECONDS",
                   help="deadline of the whole call (default: none)")
    add_connection_args(p)
    p.set_defaults(func=cmd_scale)


def add_connection_args(p: argparse.ArgumentParser) -> None:
    """``--api-key`` and ``--tls-ca``: how a client command reaches a server that asks for them."""
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="the server's API key (default: $PDSERVE_API_KEY)")
    p.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="connect over TLS, trusting the CA certificate in this file")


def cmd_scale(args: argparse.Namespace) -> int:
    import grpc

    from pdserve.router.admin import scale

    if args.prefill is None and args.decode is None:
        return fail("say how many workers: --prefill N and/or --decode M", 2)
    try:
        reply = scale(args.target, prefill=args.prefill, decode=args.decode,
                      drain_timeout_s=args.drain_timeout, timeout=args.timeout,
                      api_key=args.api_key, tls_ca=args.tls_ca)
    except grpc.RpcError as exc:
        hint = ""
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            hint = f" (is `pdserve serve` running at {args.target}?)"
        return fail(f"{exc.code().name}: {exc.details()}{hint}")
    changes = []
    if reply.added:
        changes.append("started " + ", ".join(reply.added))
    if reply.removed:
        changes.append("drained and stopped " + ", ".join(reply.removed))
    print(f"pdserve: {reply.num_prefill_workers} prefill + {reply.num_decode_workers} decode workers"
          + (f" ({'; '.join(changes)})" if changes else " (no change)"))
    if reply.num_requests_cut:
        print(f"pdserve: {reply.num_requests_cut} request(s) were still running on removed workers when "
              "the drain timed out and failed", file=sys.stderr)
        return 1
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
    add_connection_args(p)
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
        return fail(str(exc), 2)
    params = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                  top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
                  logprobs=args.logprobs)
    last = None
    with Client(args.target, timeout=args.timeout, api_key=args.api_key, tls_ca=args.tls_ca) as client:
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
            return fail(f"{exc.code.name}: {exc.message}{hint}")
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
