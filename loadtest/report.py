"""The report of a load test: a Markdown table, a JSON file with every request, PNG plots.

``ModeResult`` holds one server's sweep (one "mode" of a comparison; a plain ``loadtest run``
has one). ``write_report`` writes, into one folder:

- ``report.md``: what ran (machine, load average, command, workload, SLO), a summary per rate
  (goodput and p99 ITL of each mode side by side, and the ratios), then every aggregate side by
  side per rate;
- ``results.json``: the same aggregates plus every request's measurements;
- ``latency_cdf.png``: CDFs of TTFT and ITL, per mode and rate;
- ``vs_rate.png``: goodput and p99 ITL against the offered request rate, per mode.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from pdserve.loadtest.driver import ClientLag, RequestResult, RunResult
from pdserve.loadtest.stats import SLO, RunStats, run_stats

MD_NAME, JSON_NAME, CDF_PNG, RATE_PNG = "report.md", "results.json", "latency_cdf.png", "vs_rate.png"


@dataclass
class ModeResult:
    """One server's sweep: its description, what it reported about itself, its runs."""

    name: str
    config: str
    server: dict
    runs: list[RunResult]
    stats: list[RunStats] = field(default_factory=list)

    @classmethod
    def build(cls, name: str, config: str, server_info, runs: list[RunResult], slo: SLO) -> "ModeResult":
        server = {k: v for k, v in asdict(server_info).items() if k != "raw"} if server_info is not None else {}
        return cls(name, config, server, runs, [run_stats(r, slo) for r in runs])


def _rate_label(rate: float | None) -> str:
    return "all at once" if rate is None else f"{rate:g}"


def _ms(x: float | None) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 1e3:.0f}"


def _num(x: float | None, digits: int = 2) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return None
    return a / b


# Rows of the detailed table: (label, value of one RunStats as text, raw value, better when higher?)
def _rows(st: RunStats, run: RunResult) -> list[tuple[str, str, float | None, bool]]:
    rows = [
        ("requests ok / sent", f"{st.num_ok} / {st.num_requests}", None, True),
        ("goodput (req/s)", _num(st.goodput, 3), st.goodput, True),
        ("SLO attainment", f"{st.slo_attainment:.0%}", st.slo_attainment, True),
        ("request throughput (req/s)", _num(st.request_throughput, 3), st.request_throughput, True),
        ("output tokens/s", _num(st.output_token_throughput, 1), st.output_token_throughput, True),
    ]
    for name, s in (("TTFT", st.ttft), ("ITL", st.itl), ("TPOT", st.tpot), ("E2E", st.e2e)):
        for q in ("mean", "p50", "p90", "p99"):
            rows.append((f"{name} {q} (ms)", _ms(getattr(s, q)), getattr(s, q), False))
    for label, d in st.by_label.items():
        rows.append((f"TTFT p50 {label} prompts (ms)", _ms(d["ttft"].p50), d["ttft"].p50, False))
        rows.append((f"ITL p99 {label} prompts (ms)", _ms(d["itl"].p99), d["itl"].p99, False))
    for phase, s in st.server.items():
        rows.append((f"server {phase.removesuffix('_s')} mean / p99 (ms)", f"{_ms(s.mean)} / {_ms(s.p99)}", None, False))
    c = run.client
    rows.append(("client send lag p99 / loop lag max (ms)",
                 f"{c.send_lag_p99_s * 1e3:.1f} / {c.loop_lag_max_s * 1e3:.1f}", None, False))
    rows.append(("client CPU (share of a core)", f"{c.cpu_share:.0%}", None, False))
    return rows


def highest_rate_meeting(mode: ModeResult, attainment: float) -> float | None:
    """The highest offered rate at which ``mode`` met the SLO for at least ``attainment`` of its requests."""
    ok = [run.rate for run, st in zip(mode.runs, mode.stats)
          if run.rate is not None and st.slo_attainment >= attainment]
    return max(ok) if ok else None


def markdown(meta: dict, modes: list[ModeResult], slo: SLO, attainment: float = 0.9) -> str:
    lines = ["# pdserve load test", ""]
    for key in ("date", "machine", "command", "workload", "arrivals", "load average before", "load average after",
                "recomputed"):
        if key in meta:
            value = meta[key]
            lines.append(f"- {key}: `{value}`" if key == "command" else f"- {key}: {value}")
    lines.append(f"- SLO: {slo.describe()}")
    for m in modes:
        lines.append(f"- {m.name}: {m.config}")
    lines.append("")
    names = [m.name for m in modes]
    two = len(modes) == 2
    rates = [run.rate for run in modes[0].runs]

    lines += ["## Summary", ""]
    header = ["rate (req/s)"] + [f"goodput {n}" for n in names] + [f"p99 ITL {n} (ms)" for n in names]
    if two:
        header += [f"p99 ITL {names[0]} / {names[1]}", f"goodput {names[1]} / {names[0]}"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for i, rate in enumerate(rates):
        sts = [m.stats[i] for m in modes]
        row = [_rate_label(rate)] + [_num(s.goodput, 3) for s in sts] + [_ms(s.itl.p99) for s in sts]
        if two:
            itl = _ratio(sts[0].itl.p99, sts[1].itl.p99)
            good = _ratio(sts[1].goodput, sts[0].goodput)
            row += ["–" if itl is None else f"{itl:.1f}x",
                    ("∞" if sts[1].goodput > 0 else "–") if good is None else f"{good:.1f}x"]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    for m in modes:
        best = highest_rate_meeting(m, attainment)
        lines.append(f"- highest rate at which {m.name} met the SLO for at least {attainment:.0%} of requests: "
                     + ("none of the rates tried" if best is None else f"{best:g} req/s"))
    warnings = [f"{m.name} @ {_rate_label(run.rate)}: {w}" for m in modes for run in m.runs for w in run.client.warnings]
    if warnings:
        lines.append("- client lag warnings (the client may have set the pace): " + "; ".join(warnings))
    lines.append("")

    for i, rate in enumerate(rates):
        lines += [f"## Rate {_rate_label(rate)}" + (" req/s" if rate is not None else ""), ""]
        header = ["metric"] + names + ([f"{names[1]} advantage"] if two else [])
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        per_mode = [_rows(m.stats[i], m.runs[i]) for m in modes]
        for j, (label, _, _, higher_better) in enumerate(per_mode[0]):
            row = [label] + [rows[j][1] for rows in per_mode]
            if two:
                a, b = per_mode[0][j][2], per_mode[1][j][2]
                r = _ratio(b, a) if higher_better else _ratio(a, b)
                row.append("" if r is None else f"{r:.2f}x")
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    if two:
        lines.append(f"An advantage above 1 means {names[1]} did better: higher for throughput and goodput, "
                     "lower for latencies.")
    return "\n".join(lines) + "\n"


def to_json(meta: dict, modes: list[ModeResult], slo: SLO) -> dict:
    return {
        "meta": meta,
        "slo": asdict(slo),
        "modes": {m.name: {"config": m.config, "server": m.server,
                           "runs": [{**run.to_json(), "stats": st.to_json()} for run, st in zip(m.runs, m.stats)]}
                  for m in modes},
    }


def plot(modes: list[ModeResult], out_dir: Path) -> list[Path]:
    """The two PNGs; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    paths = []

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for k, m in enumerate(modes):
        nruns = len(m.runs)
        for i, run in enumerate(m.runs):
            ok = [r for r in run.results if r.ok]
            for ax, values in ((axes[0], [r.ttft_s for r in ok]), (axes[1], [x for r in ok for x in r.itl_s if x > 0])):
                if not values:
                    continue
                x = np.sort(np.asarray(values))
                y = np.arange(1, len(x) + 1) / len(x)
                ax.step(x, y, where="post", color=colors[k % len(colors)], linestyle=styles[i % len(styles)],
                        alpha=1.0 if nruns == 1 else 0.45 + 0.55 * (i + 1) / nruns,
                        label=f"{m.name} @ {_rate_label(run.rate)}")
    for ax, title in ((axes[0], "TTFT"), (axes[1], "inter-token latency")):
        ax.set_xscale("log")
        ax.set_xlabel("seconds (log scale)")
        ax.set_ylabel("fraction of " + ("requests" if title == "TTFT" else "tokens"))
        ax.set_title(f"{title} CDF")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / CDF_PNG)
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    offered = sorted({run.rate for m in modes for run in m.runs if run.rate is not None})
    for k, m in enumerate(modes):
        pts = [(run.rate, st) for run, st in zip(m.runs, m.stats) if run.rate is not None]
        if not pts:  # all at once: one point at x = 0
            pts = [(0.0, st) for st in m.stats]
        xs = [p[0] for p in pts]
        c = colors[k % len(colors)]
        axes[0].plot(xs, [p[1].goodput for p in pts], "o-", color=c, label=m.name)
        axes[1].plot(xs, [p[1].itl.p99 if p[1].itl.p99 is not None else np.nan for p in pts], "o-", color=c,
                     label=m.name)
    if offered:
        axes[0].plot(offered, offered, ":", color="grey", label="offered rate")
    axes[0].set_title("goodput (requests/s meeting the SLO)")
    axes[0].set_ylabel("requests/s")
    axes[1].set_title("p99 inter-token latency")
    axes[1].set_ylabel("seconds (log scale)")
    axes[1].set_yscale("log")
    axes[1].yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(_plain))
    axes[1].yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(
        lambda v, pos: _plain(v, pos) if v > 0 and round(v / 10 ** math.floor(math.log10(v))) in (2, 5) else ""))
    for ax in axes:
        ax.set_xlabel("offered request rate (requests/s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / RATE_PNG)
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def _plain(v: float, _pos=None) -> str:
    return f"{v:g}"


def write_report(out_dir: str | Path, meta: dict, modes: list[ModeResult], slo: SLO,
                 attainment: float = 0.9) -> dict[str, Path]:
    """Write report.md, results.json and the PNGs into ``out_dir``; return their paths by kind."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = markdown(meta, modes, slo, attainment)
    (out / MD_NAME).write_text(md, encoding="utf-8")
    (out / JSON_NAME).write_text(json.dumps(to_json(meta, modes, slo), indent=1, allow_nan=False,
                                            default=_json_default), encoding="utf-8")
    cdf, rate = plot(modes, out)
    return {"markdown": out / MD_NAME, "json": out / JSON_NAME, "cdf_png": cdf, "rate_png": rate}


class ResultsError(ValueError):
    """A results.json that cannot be read back (the message names the file and the problem)."""


def read_results(path: str | Path, slo: SLO) -> tuple[dict, list[ModeResult]]:
    """The meta data and modes of a ``results.json``, with their statistics recomputed under ``slo``."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        request_fields = {f.name for f in fields(RequestResult)}
        modes = []
        for name, mode in data["modes"].items():
            runs = [RunResult(rate=run["rate"], duration_s=run["duration_s"], client=ClientLag(**run["client"]),
                              results=[RequestResult(**{k: v for k, v in r.items() if k in request_fields})
                                       for r in run["requests"]])
                    for run in mode["runs"]]
            modes.append(ModeResult(name, mode["config"], mode["server"], runs, [run_stats(r, slo) for r in runs]))
        meta = dict(data["meta"])
    except OSError as exc:
        raise ResultsError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ResultsError(f"{path} is not the results.json of a pdserve load test ({type(exc).__name__}: {exc})") from None
    if not modes:
        raise ResultsError(f"{path} holds no runs")
    return meta, modes


def _json_default(obj):
    if isinstance(obj, (np.floating, np.integer)):
        return obj.item()
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")
