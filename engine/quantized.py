"""Projection weights that hold 4-bit values, multiplied in that form when a step has few rows.

The default model is a GGUF file whose projections are ``Q4_1``: in each group of 32 inputs of an
output, every weight is ``d * q + m`` with ``q`` in 0..15 and ``d``, ``m`` float16. ``transformers``
dequantizes them to float32 and so do we, but a float32 copy is 4 bytes a weight, and a decode
step of a few dozen rows reads every weight once: it waits on memory, not on arithmetic (MKL runs
it at under half the machine's matrix rate). Kept as ``q``, ``d`` and ``m`` (0.625 bytes a weight),
the same weights are rebuilt in registers, exactly, and multiplied there (``csrc/q4_gemm.c``).

Nothing is approximated: ``pack_q4_1`` recovers ``d``, ``q`` and ``m`` from the float32 weight and
keeps them only when ``d * q + m`` gives back every weight bit for bit (so only weights that are
Q4_1 values to begin with qualify; other models keep the float32 path). The kernel rebuilds each
weight with one fused multiply-add, which is exactly that float32 value (``d * q`` is exact), and
sums the products in float32, by groups of 32 and then across groups, as a blocked GEMM does.
The order of the additions differs from MKL's, so results differ from the float32 path by
rounding only (about 1e-6 relative), which the parity tests against ``transformers`` cover.

The kernel needs x86-64 with AVX-512 and a C compiler (``cc``): it is compiled on first use into
the pdserve cache (``$PDSERVE_CACHE``, default ``~/.cache/pdserve``). Without either, or with
``PDSERVE_Q4=0``, weights stay on the float32 path.
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

import torch

logger = logging.getLogger(__name__)

GROUP = 32  # inputs per (d, m) pair
TILE = 16  # outputs per packed column tile
GROUP_BYTES = 320  # a tile's group: d[16] and m[16] float16, then 16 rows of 16 nibble pairs
MAX_ROWS = 40  # above this many rows MKL's float32 GEMM is faster (compute, not memory, bound)

_SOURCE = Path(__file__).with_name("csrc") / "q4_gemm.c"
_DISABLED = os.environ.get("PDSERVE_Q4", "1") == "0"
_lib = None
_lib_error: str | None = None
_lib_lock = threading.Lock()


def _cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve")) / "kernels"


def _build() -> ctypes.CDLL:
    """Compile the kernel once per source version (atomic rename: actors may race) and load it."""
    src = _SOURCE.read_bytes()
    flags = ["-O3", "-fopenmp", "-shared", "-fPIC"]
    tag = hashlib.sha256(src + " ".join(flags).encode()).hexdigest()[:16]
    out = _cache_dir() / f"q4_gemm-{tag}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            subprocess.run([os.environ.get("CC", "cc"), *flags, "-o", tmp, str(_SOURCE)], check=True,
                           capture_output=True, text=True, timeout=120)
            os.replace(tmp, out)
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(f"compiling {_SOURCE.name} failed: {exc.stderr.strip()[-500:]}") from None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(out))
    lib.q4_supported.restype = ctypes.c_int
    lib.q4_gemm.restype = None
    lib.q4_gemm.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                            ctypes.c_void_p, ctypes.c_int]
    if not lib.q4_supported():
        raise RuntimeError("this CPU has no AVX-512")
    return lib


def kernel():
    """The loaded kernel library, or ``None`` (the reason is in ``unavailable_reason()``)."""
    global _lib, _lib_error
    if _lib is not None or _lib_error is not None:
        return _lib
    with _lib_lock:
        if _lib is None and _lib_error is None:
            if _DISABLED:
                _lib_error = "PDSERVE_Q4=0"
            else:
                try:
                    _lib = _build()
                except Exception as exc:  # no compiler, no AVX-512, an unwritable cache: float32 path
                    _lib_error = str(exc) or type(exc).__name__
                    logger.info("4-bit projection kernel unavailable (%s); using float32 weights", _lib_error)
    return _lib


def unavailable_reason() -> str | None:
    kernel()
    return _lib_error


class Q4Weight:
    """A ``[in, out]`` weight as packed 4-bit groups (see ``csrc/q4_gemm.c`` for the layout)."""

    __slots__ = ("packed", "in_features", "out_features")

    def __init__(self, packed: torch.Tensor, in_features: int, out_features: int) -> None:
        self.packed = packed
        self.in_features = in_features
        self.out_features = out_features

    @property
    def nbytes(self) -> int:
        return self.packed.numel()


def _f16_step(d: torch.Tensor, step: int) -> torch.Tensor:
    """The float16 value ``step`` units in the last place away from ``d`` (positive, finite)."""
    return (d.view(torch.int16) + step).view(torch.float16)


def pack_q4_1(w_in_out: torch.Tensor) -> Q4Weight | None:
    """``w`` (float32 ``[in, out]``) as Q4_1 groups, if every weight is exactly ``d * q + m`` for
    float16 ``d >= 0``, ``m`` and ``q`` in 0..15 over groups of 32 inputs; else ``None``."""
    K, N = w_in_out.shape
    if w_in_out.dtype != torch.float32 or K % GROUP or N % TILE or w_in_out.device.type != "cpu":
        return None
    w = w_in_out.t().reshape(N, K // GROUP, GROUP)  # [out, group, 32]
    m = w.amin(-1)
    if not torch.equal(m.half().float(), m):
        return None
    span = w.amax(-1) - m
    base = (span / 15).half()  # llama.cpp's Q4_1: d = (max - min) / 15, so the max has q = 15
    d = base.clone()
    ok = torch.zeros_like(m, dtype=torch.bool)
    q = torch.zeros(w.shape, dtype=torch.uint8)
    for step in (0, 1, -1, 2, -2):  # float16 rounding of d: the exact one is base or a neighbour
        cand = _f16_step(base, step) if step else base
        cand = torch.where(span == 0, torch.ones_like(cand), cand)
        todo = ~ok & torch.isfinite(cand.float()) & (cand.float() > 0)
        if not todo.any():
            break
        cf = cand.float()[todo].unsqueeze(-1)
        qi = torch.round((w[todo] - m[todo].unsqueeze(-1)) / cf).clamp_(0, 15)
        good = ((qi * cf + m[todo].unsqueeze(-1)) == w[todo]).all(-1)
        idx = todo.nonzero(as_tuple=True)
        sel = tuple(i[good] for i in idx)
        d[sel] = cand[sel]
        q[sel] = qi[good].to(torch.uint8)
        ok[sel] = True
        if bool(ok.all()):
            break
    if not bool(ok.all()):
        return None
    d = torch.where(span == 0, torch.zeros_like(d), d)
    # [out, in] -> tiles of 16 outputs: per tile and group, d[16], m[16], then per input pair
    # (2p, 2p + 1) a byte per output with the even input in the low nibble
    T, G = N // TILE, K // GROUP
    qq = q.view(T, TILE, G, GROUP // 2, 2)
    nib = (qq[..., 0] | (qq[..., 1] << 4)).permute(0, 2, 3, 1)  # [T, G, 16 pairs, 16 outputs]
    dd = d.view(T, TILE, G).permute(0, 2, 1).contiguous().view(torch.uint8)  # [T, G, 32 bytes]
    mm = m.half().view(T, TILE, G).permute(0, 2, 1).contiguous().view(torch.uint8)
    packed = torch.cat([dd, mm, nib.reshape(T, G, 256)], dim=-1).contiguous()
    return Q4Weight(packed.view(-1), K, N)


def q4_linear(x: torch.Tensor, w: Q4Weight) -> torch.Tensor:
    """``x @ W`` for ``x`` float32 ``[rows, in]`` on CPU (only where ``kernel()`` is not ``None``)."""
    lib = _lib or kernel()
    x = x.contiguous()
    rows = x.shape[0]
    y = torch.empty(rows, w.out_features, dtype=torch.float32)
    lib.q4_gemm(x.data_ptr(), rows, w.in_features, w.packed.data_ptr(), w.out_features, y.data_ptr(),
                 torch.get_num_threads())
    return y
