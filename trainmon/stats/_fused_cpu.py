"""Opt-in fused one-pass CPU partials (count, sum, sumsq, min, max), JIT-compiled C++.

The eager CPU path runs four ATen reductions per tensor (sum, sum of squares, amin, amax), each
a separate pass plus dispatch overhead.  This kernel reads each tensor once.  It is used only when
``TRAINMON_FUSED_CPU=1`` is set and the build succeeds; the build runs on first use through
``torch.utils.cpp_extension.load_inline`` and torch caches it (``~/.cache/torch_extensions``).
Any failure logs one warning and the caller keeps the eager path.

Accuracy: 16 float lanes accumulate blocks of 512 elements (32 per lane), and every block's sums
are added in float64, so the error does not grow with the tensor size (at least as accurate as the
eager blocked path).  min/max propagate NaN like ``torch.amin``/``amax``: a NaN anywhere makes the
sum of squares NaN (and only a NaN can), which is the trigger.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
from typing import Sequence

import torch

__all__ = ["enabled", "partials_f32", "FUSED_DTYPES"]

log = logging.getLogger(__name__)

ENV = "TRAINMON_FUSED_CPU"
FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_CPP = r"""
#include <torch/extension.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cmath>
#include <limits>
#include <vector>

namespace {
constexpr int64_t LANES = 16;
constexpr int64_t BLOCK = 512;  // elements per float block; each lane sums BLOCK / LANES of them

template <typename T>
void one_pass(const T* p, int64_t n, double* out) {
  double sum = 0.0, sumsq = 0.0;
  float mn[LANES], mx[LANES];
  for (int64_t j = 0; j < LANES; ++j) {
    mn[j] = std::numeric_limits<float>::infinity();
    mx[j] = -std::numeric_limits<float>::infinity();
  }
  int64_t i = 0;
  const int64_t whole = n / BLOCK * BLOCK;
  for (; i < whole; i += BLOCK) {
    float s[LANES] = {0}, q[LANES] = {0};
    for (int64_t k = 0; k < BLOCK; k += LANES) {
      for (int64_t j = 0; j < LANES; ++j) {  // independent lanes: vectorizes without fast-math
        float x = static_cast<float>(p[i + k + j]);
        s[j] += x;
        q[j] += x * x;
        mn[j] = x < mn[j] ? x : mn[j];
        mx[j] = x > mx[j] ? x : mx[j];
      }
    }
    double bs = 0.0, bq = 0.0;
    for (int64_t j = 0; j < LANES; ++j) { bs += s[j]; bq += q[j]; }
    sum += bs;
    sumsq += bq;
  }
  float lo = mn[0], hi = mx[0];
  for (int64_t j = 1; j < LANES; ++j) { lo = mn[j] < lo ? mn[j] : lo; hi = mx[j] > hi ? mx[j] : hi; }
  for (; i < n; ++i) {  // tail, under one block: plain double accumulation
    float x = static_cast<float>(p[i]);
    sum += x;
    sumsq += static_cast<double>(x) * x;
    lo = x < lo ? x : lo;
    hi = x > hi ? x : hi;
  }
  if (std::isnan(sumsq)) {  // only a NaN element makes a sum of squares NaN
    lo = hi = std::numeric_limits<float>::quiet_NaN();
  }
  out[0] = static_cast<double>(n);
  out[1] = sum;
  out[2] = sumsq;
  out[3] = lo;
  out[4] = hi;
}
}  // namespace

torch::Tensor partials_f32(std::vector<torch::Tensor> tensors) {
  auto result = torch::empty({static_cast<int64_t>(tensors.size()), 5},
                             torch::dtype(torch::kFloat64));
  double* out = result.data_ptr<double>();
  for (size_t r = 0; r < tensors.size(); ++r) {
    torch::Tensor t = tensors[r];
    TORCH_CHECK(t.device().is_cpu(), "partials_f32: CPU tensors only");
    t = t.contiguous();
    const int64_t n = t.numel();
    double* row = out + 5 * r;
    switch (t.scalar_type()) {
      case torch::kFloat: one_pass(t.data_ptr<float>(), n, row); break;
      case torch::kBFloat16: one_pass(t.data_ptr<c10::BFloat16>(), n, row); break;
      case torch::kHalf: one_pass(t.data_ptr<c10::Half>(), n, row); break;
      default: TORCH_CHECK(false, "partials_f32: float32/bfloat16/float16 only, got ", t.scalar_type());
    }
  }
  return result;
}
"""

_state: dict[str, object] = {}


def enabled() -> bool:
    """True when the env var asks for the fused kernel and it is (or can be) built."""
    if os.environ.get(ENV, "") not in ("1", "true", "yes", "on"):
        return False
    return _module() is not None


def partials_f32(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[len(tensors) x 5]`` float64: count, sum, sumsq, min, max, one pass per tensor."""
    mod = _module()
    if mod is None:
        raise RuntimeError(f"fused CPU kernel unavailable: {_state.get('error')}")
    return mod.partials_f32(list(tensors))


def _module():
    if "module" in _state:
        return _state["module"]
    _state["module"] = None
    try:
        from torch.utils.cpp_extension import load_inline
        _state["module"] = load_inline(
            name=_ext_name(), cpp_sources=[_CPP], functions=["partials_f32"],
            extra_cflags=["-O3", "-std=c++17", "-march=native"], verbose=False)
    except Exception as exc:  # noqa: BLE001 -- any build/load failure means: eager path
        _state["error"] = f"{type(exc).__name__}: {exc}"
        log.warning("trainmon: %s=1 but the fused CPU kernel did not build (%s); using the "
                    "eager path", ENV, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    return _state["module"]


def _ext_name() -> str:
    # -march=native code must not be reused on another CPU sharing the cache: the CPU's flags and
    # the source are part of the name.
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            flags = next((ln for ln in fh if ln.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    key = hashlib.sha1((_CPP + flags + platform.machine() + torch.__version__).encode()).hexdigest()
    return f"trainmon_fused_cpu_{key[:12]}"
