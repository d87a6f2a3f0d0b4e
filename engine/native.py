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
import logging
import os
import subprocess
import tempfile
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

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


class Kernel:
    """One C kernel, loaded on first use: ``get()`` gives the library or ``None``, and then ``error``
    says why (the environment variable ``disabled_by`` set to ``0``, no compiler, no AVX-512 ...).
    ``setup(lib)`` declares the library's function types and raises if the CPU cannot run it."""

    def __init__(self, source_name: str, setup, disabled_by: str, fallback: str) -> None:
        self.source_name = source_name
        self.setup = setup
        self.disabled_by = disabled_by
        self.fallback = fallback  # what runs instead, for the log line
        self.lib: ctypes.CDLL | None = None
        self.error: str | None = None
        self._lock = threading.Lock()

    def get(self) -> ctypes.CDLL | None:
        if self.lib is not None or self.error is not None:
            return self.lib
        with self._lock:
            if self.lib is None and self.error is None:
                if os.environ.get(self.disabled_by, "1") == "0":
                    self.error = f"{self.disabled_by}=0"
                else:
                    try:
                        lib = load(self.source_name)
                        self.setup(lib)
                        self.lib = lib
                    except Exception as exc:  # no compiler, no AVX-512, an unwritable cache
                        self.error = str(exc) or type(exc).__name__
                        logger.info("%s unavailable (%s); using %s", self.source_name, self.error, self.fallback)
        return self.lib

    def unavailable_reason(self) -> str | None:
        self.get()
        return self.error
