"""The fused one-pass CPU partials (count, sum, sumsq, min, max): a small C kernel.

The eager CPU path runs four ATen reductions per tensor (sum, sum of squares, amin, amax), each
a separate pass over memory plus dispatch overhead.  This kernel reads each tensor once.  It is
plain C (no torch headers): the first use compiles it with the system C compiler in ~0.3 s into
``~/.cache/trainmon`` (``TRAINMON_CACHE_DIR`` to move it), later processes load the cached
library only after the ownership, mode and content-hash checks of ``_kernel_cache``, and it is called through
``ctypes`` with the tensor's data pointer.  On by default for
CPU tensors; ``TRAINMON_FUSED_CPU=0`` turns it off.  No compiler, or a failed build, means one
WARNING per process (naming the fix) and the eager path (same values, slower).

Accuracy: 16 float lanes accumulate blocks of 512 elements (32 per lane), and every block's sums
are added in float64, so the error does not grow with the tensor size (at least as accurate as the
eager blocked path).  A block whose float sums overflow (finite elements above ~1e18) is summed
again in double, so any finite tensor gets finite sums; only such blocks pay for it.  min/max propagate NaN
like ``torch.amin``/``amax``: a NaN anywhere makes the
sum of squares NaN (and only a NaN can), which is the trigger.  The lanes are independent, so the
compiler vectorizes them without fast-math and results do not depend on the vector width.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import torch

from trainmon.stats import _kernel_cache

__all__ = ["enabled", "fill_rows", "partials_f32", "partials_into", "FUSED_DTYPES", "ENV"]

log = logging.getLogger(__name__)

ENV = "TRAINMON_FUSED_CPU"
_OFF = ("0", "false", "no", "off")
FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_C_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

#define LANES 16
#define BLOCK 512

static inline float f32_at(const void* p, int64_t i) { return ((const float*)p)[i]; }
static inline float bf16_at(const void* p, int64_t i) {
  uint32_t u = (uint32_t)((const uint16_t*)p)[i] << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline float f16_at(const void* p, int64_t i) {
  uint16_t h = ((const uint16_t*)p)[i];
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
  if (exp == 0) {
    if (mant == 0) { bits = sign; }
    else { exp = 113; while (!(mant & 0x400u)) { mant <<= 1; exp--; } bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13); }
  } else if (exp == 31) { bits = sign | 0x7f800000u | (mant << 13); }
  else { bits = sign | ((exp + 112) << 23) | (mant << 13); }
  float f; memcpy(&f, &bits, 4); return f;
}

#define ONE_PASS(NAME, LOAD)                                                              \
static void NAME(const void* p, int64_t n, double* out) {                                 \
  double sum = 0.0, sumsq = 0.0;                                                           \
  float mn[LANES], mx[LANES];                                                              \
  for (int j = 0; j < LANES; ++j) { mn[j] = INFINITY; mx[j] = -INFINITY; }                 \
  int64_t i = 0;                                                                           \
  const int64_t whole = n / BLOCK * BLOCK;                                                 \
  for (; i < whole; i += BLOCK) {                                                          \
    float s[LANES] = {0}, q[LANES] = {0};                                                  \
    for (int64_t k = 0; k < BLOCK; k += LANES) {                                           \
      for (int j = 0; j < LANES; ++j) {                                                    \
        float x = LOAD(p, i + k + j);                                                      \
        s[j] += x; q[j] += x * x;                                                          \
        mn[j] = x < mn[j] ? x : mn[j]; mx[j] = x > mx[j] ? x : mx[j];                      \
      }                                                                                    \
    }                                                                                      \
    double bs = 0.0, bq = 0.0;                                                             \
    for (int j = 0; j < LANES; ++j) { bs += s[j]; bq += q[j]; }                            \
    if (!isfinite(bs + bq)) { /* float lanes overflowed (or a NaN/Inf): redo in double */  \
      bs = 0.0; bq = 0.0;                                                                  \
      for (int64_t k = 0; k < BLOCK; ++k) { double x = LOAD(p, i + k); bs += x; bq += x * x; } \
    }                                                                                      \
    sum += bs; sumsq += bq;                                                                \
  }                                                                                        \
  float lo = mn[0], hi = mx[0];                                                            \
  for (int j = 1; j < LANES; ++j) { lo = mn[j] < lo ? mn[j] : lo; hi = mx[j] > hi ? mx[j] : hi; } \
  for (; i < n; ++i) {                                                                     \
    float x = LOAD(p, i);                                                                  \
    sum += x; sumsq += (double)x * x;                                                      \
    lo = x < lo ? x : lo; hi = x > hi ? x : hi;                                            \
  }                                                                                        \
  if (isnan(sumsq)) { lo = hi = NAN; }                                                     \
  out[0] = (double)n; out[1] = sum; out[2] = sumsq; out[3] = lo; out[4] = hi;              \
}

ONE_PASS(pass_f32, f32_at)
ONE_PASS(pass_bf16, bf16_at)
ONE_PASS(pass_f16, f16_at)

/* kind: 0 float32, 1 bfloat16, 2 float16.  Column j of the row gets value cols[j]
   (0 count, 1 sum, 2 sumsq, 3 min, 4 max).  Returns 0, or -1 for an unknown kind. */
int trainmon_partials(const void* data, int64_t n, int kind, double* row, int64_t width,
                      const int64_t* cols) {
  double full[5];
  switch (kind) {
    case 0: pass_f32(data, n, full); break;
    case 1: pass_bf16(data, n, full); break;
    case 2: pass_f16(data, n, full); break;
    default: return -1;
  }
  for (int64_t j = 0; j < width; ++j) row[j] = full[cols[j]];
  return 0;
}
"""

_state: dict[str, object] = {}
_COLMAPS: dict[tuple[int, ...], object] = {}


def enabled() -> bool:
    """True unless ``TRAINMON_FUSED_CPU=0``, once the kernel is (or can be) built."""
    if os.environ.get(ENV, "").strip().lower() in _OFF:
        return False
    return _function() is not None


def fill_rows(tensors: Sequence[torch.Tensor], out: torch.Tensor, start: int, cols: Sequence[int]) -> None:
    """``partials_into`` without its argument checks, for the engine's own step buffer (the
    per-capture path of every hook)."""
    fn = _state["fn"]
    colmap = _COLMAPS.get(cols)  # type: ignore[call-overload]
    if colmap is None:
        colmap = _COLMAPS[tuple(cols)] = (ctypes.c_int64 * len(cols))(*cols)
    width = len(cols)
    row = out.data_ptr() + start * width * 8
    for t in tensors:
        if not t.is_contiguous():
            with torch.no_grad():  # a copy of an activation must not record autograd history
                t = t.contiguous()
        ptr, n = t.data_ptr(), t.numel()
        if not ptr and n:  # no data behind it (a FakeTensor): reading address 0 would crash the process
            raise ValueError("the tensor has no data (its data pointer is null)")
        if fn(ptr, n, _KIND[t.dtype], row, width, colmap) != 0:  # type: ignore[operator]
            raise ValueError(f"fused CPU kernel: unsupported dtype {t.dtype}")
        row += width * 8


def partials_into(tensors: Sequence[torch.Tensor], out: torch.Tensor, start: int, cols: Sequence[int]) -> None:
    """Write rows ``start..`` of ``out`` (contiguous float64 ``[rows, len(cols)]``, CPU):
    column ``j`` of a tensor's row is fused value ``cols[j]`` (0 count, 1 sum, 2 sumsq, 3 min,
    4 max).  ``tensors``: CPU tensors of a ``FUSED_DTYPES`` dtype."""
    fn = _function()
    if fn is None:
        raise RuntimeError(f"fused CPU kernel unavailable: {_state.get('error')}")
    if (
        start < 0
        or start + len(tensors) > out.shape[0]
        or out.dtype != torch.float64
        or not out.is_contiguous()
        or out.dim() != 2
        or out.shape[1] != len(cols)
    ):
        raise ValueError(
            "partials_into: out must be a contiguous float64 [rows, len(cols)] matrix with room for every tensor"
        )
    fill_rows(tensors, out, start, tuple(cols))


def partials_f32(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[len(tensors) x 5]`` float64: count, sum, sumsq, min, max, one pass per tensor."""
    out = torch.empty((len(tensors), 5), dtype=torch.float64)
    partials_into(tensors, out, 0, range(5))
    return out


def _function():
    if "fn" not in _state:
        _state["fn"] = None
        try:
            lib = _kernel_cache.load(_library_name(), _compile)
            fn = lib.trainmon_partials
            fn.argtypes = [
                ctypes.c_void_p,
                ctypes.c_int64,
                ctypes.c_int,
                ctypes.c_void_p,
                ctypes.c_int64,
                ctypes.c_void_p,
            ]
            fn.restype = ctypes.c_int
            _state["fn"] = fn
        except Exception as exc:
            _state["error"] = f"{type(exc).__name__}: {exc}"
            _warn_unavailable(exc)
    return _state["fn"]


def _warn_unavailable(exc: Exception) -> None:
    """The one warning of a process without the kernel (``_function`` tries to build it once): a
    slower path nobody asked for must be visible under Python's default logging."""
    why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, _kernel_cache.UnsafeCache):
        fix = "set TRAINMON_CACHE_DIR to a folder only you can write"
    elif isinstance(exc, (FileNotFoundError, PermissionError)) or "compiler" in why or " failed:" in why:
        fix = "install a C compiler (cc, gcc or clang) or set CC to one"
    else:
        fix = "see the reason above"
    log.warning(
        "trainmon: the fused CPU stats kernel is unavailable (%s), so CPU tensors take the eager "
        "path: the same values, one ATen reduction per statistic instead of one pass per tensor "
        "(slower). Fix: %s; TRAINMON_FUSED_CPU=0 chooses the eager path without this warning",
        why,
        fix,
    )


def _compiler() -> str:
    cc = os.environ.get("CC") or next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    if not cc:
        raise RuntimeError("no C compiler found (set CC)")
    return cc


def _library_name() -> str:
    """One name per source, compiler flags and CPU, so a cache shared with another CPU never
    loads code it cannot run."""
    key = hashlib.sha1("\0".join([_C_SOURCE, _cpu_flags(), platform.machine()]).encode()).hexdigest()
    return f"trainmon_fused_{key[:16]}.so"


def _compile(tmp: Path) -> Path:
    """Build the kernel inside the private temporary folder ``tmp``; the cache (see
    ``_kernel_cache``) checks, loads and renames it into place, so concurrent processes never
    load half a file and a killed build leaves nothing that blocks the next one."""
    cc = _compiler()
    src, lib = tmp / "kernel.c", tmp / "kernel.so"
    src.write_text(_C_SOURCE)
    errors = []
    # -march=native: this CPU's vector width (its flags are in the name).  Without it if unsupported.
    for arch in (["-march=native"], []):
        proc = subprocess.run(
            [cc, "-O3", *arch, "-shared", "-fPIC", "-o", str(lib), str(src)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if proc.returncode == 0:
            return lib
        errors.append(proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"])
    raise RuntimeError(f"{cc} failed: {errors[-1][0]}")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            return next((ln for ln in fh if ln.startswith(("flags", "Features"))), "")
    except OSError:
        return ""
