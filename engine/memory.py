"""Peak memory of this process: what a worker reports as its footprint.

On CUDA the figure is the peak of tensor memory the caching allocator handed out
(``torch.cuda.max_memory_allocated``), the number a user compares with the GPU's size. On CPU it
is the peak resident set size of the whole process (``getrusage``), which also counts the Python
interpreter, the libraries and Ray's own worker state: what the operating system had to give.
"""

from __future__ import annotations

import resource
import sys

import torch


def peak_rss_bytes() -> int:
    """Peak resident set size of this process since it started, in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kilobytes; macOS reports bytes.
    return int(peak if sys.platform == "darwin" else peak * 1024)


def peak_memory_bytes(device: str | torch.device = "cpu") -> int:
    """The peak memory of the work on ``device``: CUDA tensor memory, or the process's RSS on CPU."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated(dev))
    return peak_rss_bytes()


def describe_peak(nbytes: int, device: str = "cpu") -> str:
    """``"412 MiB (peak RSS)"`` or ``"1536 MiB (CUDA max allocated)"``, for benchmark tables."""
    what = "CUDA max allocated" if device == "cuda" else "peak RSS"
    return f"{nbytes / 2**20:.0f} MiB ({what})"
