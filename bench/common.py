"""What the benchmarks share: the machine they ran on, timing, a local Ray, and table printing."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence


def machine() -> str:
    """``"<CPU model>, <n> CPUs, <OS> <release>"``: the line a result is recorded with."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}"


def now() -> str:
    """The local date and time, to the second, with its UTC offset (ISO 8601)."""
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The median wall time of ``repeats`` calls of ``fn``, after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def max_positions(hf_config) -> int | None:
    """The longest sequence a Hugging Face config allows (Llama family or GPT-2), if it says."""
    return getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "n_positions", None)


@contextmanager
def local_ray(num_cpus: int) -> Iterator:
    """Yield ``ray``: a fresh local Ray on this machine (never an existing cluster) that is shut
    down afterwards, or the one this process already runs, which is left running."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    try:
        yield ray
    finally:
        if started:
            ray.shutdown()


class Table:
    """Rows of fixed-width columns: the first left-aligned (labels), the others right-aligned.
    Cells are strings, formatted by the caller; a cell wider than its column pushes the rest right."""

    def __init__(self, widths: Sequence[int]) -> None:
        self.widths = list(widths)

    def row(self, *cells: str) -> str:
        first, *rest = cells
        return f"{first:<{self.widths[0]}}" + "".join(f"{c:>{w}}" for c, w in zip(rest, self.widths[1:]))
