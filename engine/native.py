"""Compile and load the engine's C kernels (``engine/csrc``) on first use.

Each kernel is compiled once per source version with the system's C compiler (``$CC``, default
``cc``) into the pdserve cache (``$PDSERVE_CACHE``, default ``~/.cache/pdserve``, under
``kernels/``), by an atomic rename, since several actors of one machine may race to build it. A
kernel that cannot be built (no compiler, an unwritable cache) raises, and its caller keeps its
torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]


def cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve")) / "kernels"


def load(source_name: str) -> ctypes.CDLL:
    """``csrc/<source_name>`` compiled (once per source version and flags) and loaded."""
    source = CSRC / source_name
    src = source.read_bytes()
    tag = hashlib.sha256(src + " ".join(FLAGS).encode()).hexdigest()[:16]
    out = cache_dir() / f"{source.stem}-{tag}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            subprocess.run([os.environ.get("CC", "cc"), *FLAGS, "-o", tmp, str(source)], check=True,
                           capture_output=True, text=True, timeout=120)
            os.replace(tmp, out)
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(f"compiling {source.name} failed: {exc.stderr.strip()[-500:]}") from None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(out))
