"""`pdserve loadtest`: drive a server with a workload (``run``), or compare colocated and
disaggregated serving at equal resources (``compare``). See docs/loadtest.md."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import shlex
import signal
import sys
from pathlib import Path

from pdserve.cli import non_negative_float, positive_int
from pdserve.loadtest.arrivals import ARRIVALS
from pdserve.loadtest.driver import RunOptions
from pdserve.loadtest.stats import SLO
from pdserve.loadtest.workload import WORKLOADS, LengthRange, WorkloadConfig, WorkloadError, build_workload
from pdserve.serve import default_transport


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Drive a pdserve server with a seeded workload and report TTFT, inter-token latency, "
                     "throughput and goodput under SLOs; or compare colocated and disaggregated serving at "
                     "equal resources.")
    sub = p.add_subparsers(title="load tests", metavar="{run,compare}", dest="loadtest_command")
    run_p = sub.add_parser("run", help="drive a running server (any address)",
                           description="Drive the pdserve server at --target with a workload at one or more "
                           "request rates; print the table and write the report to --out.")
    run_p.add_argument("--target", default="127.0.0.1:50051", metavar="HOST:PORT",
                       help="the server (default 127.0.0.1:50051)")
    _add_common(run_p, default_out="loadtest-report")
    cmp_p = sub.add_parser("compare", help="colocated vs disaggregated at equal resources, one report",
                           description="Start the colocated and the disaggregated configuration one after the "
                           "other with the same resources in total (P prefill + D decode actors vs P+D colocated "
                           "actors, each alike), run the same seeded workload against each, and write one "
                           "report: Markdown table, JSON with every request, PNG plots.")
    g = cmp_p.add_argument_group("servers")
    g.add_argument("--prefill", type=positive_int, default=1, metavar="P", help="prefill actors (default 1)")
    g.add_argument("--decode", type=positive_int, default=1, metavar="D",
                   help="decode actors (default 1); the colocated side gets P+D actors")
    g.add_argument("--cpus-per-actor", type=non_negative_float, default=1.0, metavar="N",
                   help="Ray CPUs each actor reserves, both sides (default 1)")
    g.add_argument("--gpus-per-actor", type=non_negative_float, default=0.0, metavar="N",
                   help="Ray GPUs each actor reserves, both sides; > 0 runs on CUDA (default 0)")
    g.add_argument("--threads", type=positive_int, default=1, help="torch threads per actor (default 1)")
    g.add_argument("--model", default="default", metavar="PATH",
                   help="'default' (SmolLM2-135M-Instruct), a Hugging Face model directory or a .gguf file")
    g.add_argument("--kv-memory", default=None, metavar="SIZE", help="KV cache per actor, e.g. 512MiB")
    g.add_argument("--max-model-len", type=positive_int, default=None, metavar="N", help="context length")
    g.add_argument("--transport", choices=["grpc", "collective"], default=None,
                   help="KV transport of the disaggregated side (default, as pdserve serve: collective "
                   "with --gpus-per-actor > 0, grpc otherwise)")
    g.add_argument("--modes", default="colocated,disaggregated", metavar="LIST",
                   help="which sides to run, in order (default colocated,disaggregated)")
    g.add_argument("--address", default=None, metavar="RAY_ADDRESS",
                   help="run the servers on this Ray cluster (default: a local Ray started for the test)")
    _add_common(cmp_p, default_out="loadtest-compare")
    rep_p = sub.add_parser("report", help="recompute a report from its results.json, e.g. under other SLOs",
                           description="Read the results.json of an earlier run or compare and write its report "
                           "again (Markdown, JSON, PNGs) with the SLOs given here: every request's "
                           "measurements are in the file, so goodput under any SLO needs no new run.")
    rep_p.add_argument("results", metavar="RESULTS", help="a results.json, or the folder that holds it")
    _add_slo_and_output(rep_p, default_out=None)
    p.set_defaults(loadtest_parser=p)


def _add_common(p: argparse.ArgumentParser, default_out: str) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default="mixed",
                   help="fixed lengths, uniform ranges, mixed (a share of long prompts), chat prompts, or a "
                   "trace replay (default mixed)")
    w.add_argument("--num-requests", "-n", type=positive_int, default=40, metavar="N", help="requests per run (default 40)")
    w.add_argument("--prompt-tokens", type=_length, default=LengthRange(32, 256), metavar="N|LO:HI",
                   help="prompt length, or the short prompts' length in mixed (default 32:256)")
    w.add_argument("--output-tokens", type=_length, default=LengthRange(16, 128), metavar="N|LO:HI",
                   help="output length (default 16:128)")
    w.add_argument("--long-prompt-tokens", type=_length, default=LengthRange(1024, 2048), metavar="N|LO:HI",
                   help="mixed: the long prompts' length (default 1024:2048)")
    w.add_argument("--long-share", type=float, default=0.2, metavar="F",
                   help="mixed: the share of long prompts, in [0, 1] (default 0.2)")
    w.add_argument("--trace", default=None, metavar="FILE.jsonl",
                   help="trace: one JSON object per line: arrival_s, prompt_tokens | prompt | messages, "
                   "output_tokens")
    w.add_argument("--trace-speedup", type=float, default=1.0, metavar="X",
                   help="trace: replay X times faster (default 1)")
    w.add_argument("--seed", type=int, default=0, help="seeds the workload and the arrivals (default 0)")
    a = p.add_argument_group("arrivals")
    a.add_argument("--arrival", choices=ARRIVALS, default="poisson",
                   help="poisson, gamma (bursty; see --burstiness) or burst (all at once) (default poisson)")
    a.add_argument("--rates", type=_rates, default=[1.0], metavar="R[,R...]",
                   help="request rates (requests/s) to sweep, one run each (default 1)")
    a.add_argument("--burstiness", type=float, default=1.0, metavar="B",
                   help="gamma: shape of the gaps; 1 is Poisson, < 1 burstier (default 1)")
    r = p.add_argument_group("requests")
    r.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    r.add_argument("--stop-at-eos", action="store_true",
                   help="let outputs end at the model's end-of-sequence token (default: run to their length)")
    r.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS", help="deadline per request (default 600)")
    r.add_argument("--warmup", type=int, default=2, metavar="N",
                   help="short unmeasured requests sent before each run (default 2)")
    _add_slo_and_output(p, default_out)


def _add_slo_and_output(p: argparse.ArgumentParser, default_out: str | None) -> None:
    s = p.add_argument_group("SLOs (goodput counts the requests that meet every one given)")
    s.add_argument("--slo-ttft-ms", type=float, default=None, metavar="MS", help="time to first token")
    s.add_argument("--slo-itl-ms", type=float, default=None, metavar="MS",
                   help="inter-token latency: a request's own percentile --slo-itl-percentile of its ITLs")
    s.add_argument("--slo-itl-percentile", type=float, default=99.0, metavar="Q",
                   help="which percentile of a request's ITLs --slo-itl-ms bounds (default 99)")
    s.add_argument("--slo-tpot-ms", type=float, default=None, metavar="MS", help="time per output token (mean)")
    s.add_argument("--slo-attainment", type=float, default=0.9, metavar="F",
                   help="a rate 'meets the SLO' when at least this share of requests does (default 0.9)")
    o = p.add_argument_group("output")
    o.add_argument("--out", default=default_out, metavar="DIR",
                   help="folder for report.md, results.json and the PNGs (default "
                   + (default_out or "the folder of the results read") + ")")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")


# ---- argument types ----------------------------------------------------------------------------


def _length(text: str) -> LengthRange:
    try:
        return LengthRange.parse(text)
    except WorkloadError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected request rates like 0.5,1,2, got {text!r}") from None
    if not rates or not all(r > 0 and r != float("inf") for r in rates):
        raise argparse.ArgumentTypeError(f"request rates must be numbers > 0 (requests/s), got {text!r}")
    return rates


# ---- commands ----------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    if args.loadtest_command is None:
        args.loadtest_parser.print_help()
        return 2
    if args.loadtest_command == "report":
        return _cmd_report(args)
    try:
        slo, workload, schedule, options = _setup(args)
        specs = build_workload(workload)
        schedule.plans(specs)  # arrival errors before anything starts
    except (WorkloadError, ValueError) as exc:
        return _fail(str(exc), 2)
    meta = _meta(args, workload, schedule)
    if args.loadtest_command == "run":
        return _cmd_run(args, specs, slo, schedule, options, meta)
    return _cmd_compare(args, specs, slo, schedule, options, meta)


def _setup(args):
    from pdserve.loadtest.sweep import Schedule

    if not 0 <= args.long_share <= 1:
        raise ValueError(f"--long-share must be in [0, 1], got {args.long_share}")
    if args.workload == "trace" and not args.trace:
        raise ValueError("--workload trace needs --trace FILE.jsonl")
    if args.trace and args.workload != "trace":
        raise ValueError("--trace is for --workload trace")
    if args.arrival == "gamma" and not args.burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {args.burstiness}")
    if not args.temperature >= 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    slo = _slo(args)
    workload = WorkloadConfig(kind=args.workload, num_requests=args.num_requests, prompt_tokens=args.prompt_tokens,
                              output_tokens=args.output_tokens, long_prompt_tokens=args.long_prompt_tokens,
                              long_share=args.long_share, trace=args.trace, seed=args.seed)
    schedule = Schedule(arrival=args.arrival, rates=args.rates, burstiness=args.burstiness, seed=args.seed,
                        speedup=args.trace_speedup)
    options = RunOptions(temperature=args.temperature, ignore_eos=not args.stop_at_eos, timeout_s=args.timeout,
                         warmup=args.warmup)
    return slo, workload, schedule, options


def _slo(args) -> SLO:
    if not 0 < args.slo_itl_percentile <= 100:
        raise ValueError(f"--slo-itl-percentile must be in (0, 100], got {args.slo_itl_percentile}")
    if not 0 < args.slo_attainment <= 1:
        raise ValueError(f"--slo-attainment must be in (0, 1], got {args.slo_attainment}")
    for flag in ("slo_ttft_ms", "slo_itl_ms", "slo_tpot_ms"):
        v = getattr(args, flag)
        if v is not None and not v > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0, got {v}")
    ms = lambda v: None if v is None else v / 1e3  # noqa: E731
    return SLO(ttft_s=ms(args.slo_ttft_ms), itl_s=ms(args.slo_itl_ms), tpot_s=ms(args.slo_tpot_ms),
               itl_quantile=args.slo_itl_percentile)


def _meta(args, workload: WorkloadConfig, schedule) -> dict:
    if args.workload == "trace":
        arrivals = f"trace times / {args.trace_speedup:g}"
    elif args.arrival == "burst":
        arrivals = "all at once"
    else:
        arrivals = f"{args.arrival}" + (f" (burstiness {args.burstiness:g})" if args.arrival == "gamma" else "") + \
            f" at {', '.join(f'{r:g}' for r in args.rates)} req/s"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}",
        "command": "pdserve " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        if Path(sys.argv[0]).name in ("pdserve", "cli.py") else " ".join(shlex.quote(a) for a in sys.argv),
        "workload": workload.describe(),
        "arrivals": arrivals,
        "load average before": _loadavg(),
    }


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def _progress(args, total: int):
    from tqdm import tqdm

    return tqdm(total=total, unit="req", disable=args.no_progress, file=sys.stderr, dynamic_ncols=True)


def _cmd_run(args, specs, slo, schedule, options, meta) -> int:
    from pdserve.client import RequestError
    from pdserve.loadtest.report import ModeResult
    from pdserve.loadtest.sweep import run_sweep

    runs_per_mode = len(schedule.plans(specs))
    with _progress(args, runs_per_mode * len(specs)) as bar:
        try:
            info, runs = asyncio.run(run_sweep(args.target, specs, schedule, options, progress=bar))
        except RequestError as exc:
            return _fail(f"{args.target}: {exc.code.name}: {exc.message} (is `pdserve serve` running there?)")
    meta["load average after"] = _loadavg()
    config = (f"{info.num_prefill_workers} prefill + {info.num_decode_workers} decode workers, KV over {info.transport}"
              if info.mode == "disaggregated" else f"{info.num_decode_workers} colocated workers")
    mode = ModeResult.build(info.mode, f"{config} at {args.target}, model {info.model}", info, runs, slo)
    return _finish(args, meta, [mode], slo)


def _cmd_compare(args, specs, slo, schedule, options, meta) -> int:
    from pdserve.loadtest.launcher import LaunchError, RayCluster, ServerProcess, equal_resource_configs
    from pdserve.loadtest.report import ModeResult
    from pdserve.loadtest.sweep import run_sweep

    configs = {c.mode: c for c in equal_resource_configs(
        args.prefill, args.decode, cpus=args.cpus_per_actor, gpus=args.gpus_per_actor, threads=args.threads,
        model=args.model, kv_memory=args.kv_memory, max_model_len=args.max_model_len,
        transport=args.transport or default_transport(args.gpus_per_actor, args.gpus_per_actor))}
    order = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in order if m not in configs]
    if not order or bad or len(set(order)) != len(order):
        return _fail(f"--modes takes colocated and/or disaggregated, each once; got {args.modes!r}", 2)
    out = Path(args.out)
    # Ctrl-C (SIGINT) must reach us even when we were started with it ignored, as a shell does for
    # the background jobs of a script: ignored, it would leave the servers running for the whole
    # sweep. Handled here, the servers we start inherit the default handling too.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    meta["servers"] = {m: configs[m].describe() for m in order}
    runs_per_mode = len(schedule.plans(specs))
    modes = []
    need_cpus = max(configs[m].resources()["CPU"] for m in order)
    try:
        with RayCluster(args.address, num_cpus=need_cpus) as cluster, \
                _progress(args, len(order) * runs_per_mode * len(specs)) as bar:
            for name in order:
                config = configs[name]
                bar.set_description(f"starting {name} server")
                with ServerProcess(config, cluster, out / f"server-{name}.log") as server:
                    info, runs = asyncio.run(run_sweep(server.address, specs, schedule, options, progress=bar,
                                                       label=name))
                modes.append(ModeResult.build(name, config.describe(), info, runs, slo))
    except LaunchError as exc:
        return _fail(str(exc))
    except KeyboardInterrupt:
        print("pdserve loadtest: interrupted; the servers it started are stopped", file=sys.stderr)
        return 130
    meta["load average after"] = _loadavg()
    return _finish(args, meta, modes, slo)


def _cmd_report(args) -> int:
    from pdserve.loadtest.report import JSON_NAME, ResultsError, read_results

    try:
        slo = _slo(args)
        path = Path(args.results)
        path = path / JSON_NAME if path.is_dir() else path
        meta, modes = read_results(path, slo)
    except (ValueError, ResultsError) as exc:
        return _fail(str(exc), 2)
    meta["recomputed"] = (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} from {path} "
                          "with the SLO below")
    args.out = args.out or str(path.parent)
    return _finish(args, meta, modes, slo)


def _finish(args, meta, modes, slo) -> int:
    from pdserve.loadtest.report import markdown, write_report

    paths = write_report(args.out, meta, modes, slo, args.slo_attainment)
    print(markdown(meta, modes, slo, args.slo_attainment))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def _fail(message: str, code: int = 1) -> int:
    print(f"pdserve loadtest: error: {message}", file=sys.stderr)
    return code
