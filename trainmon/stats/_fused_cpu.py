"""The fused one-pass CPU partials: a small C kernel that serves every column.

The eager CPU path runs one ATen reduction per statistic and tensor (sum, sum of squares, amin,
amax, NaN/Inf counts, zero count, variance), each a separate pass over memory plus dispatch
overhead.  This kernel reads each tensor once (a second, cache-resident pass over each block of
512 elements only when ``m2`` is asked for), and a whole batch of tensors is one C call
(``trainmon_partials_many``): the Python side builds three arrays (data pointers, element counts,
dtypes) with list comprehensions, so a batch costs the same few Python frames whatever its size.
It is plain C (no torch headers): the first use compiles it with the system C compiler in ~0.3 s
into ``~/.cache/trainmon`` (``TRAINMON_CACHE_DIR`` to move it), later processes load the cached
library only after the ownership, mode and content-hash checks of ``_kernel_cache``, and it is
called through ``ctypes``.  On by default for CPU tensors; ``TRAINMON_FUSED_CPU=0`` turns it off.
No compiler, or a failed build, means one WARNING per process (naming the fix) and the eager path
(same values, slower).  A second entry, ``trainmon_pair_sumsq`` (``pair_sumsq``), reads the update
ratio's snapshot/param pairs once each for its two norms.

Threads: a call that reads 1 MiB or more shares its tensors, and the segments of its large
tensors, among up to ``torch.get_num_threads()`` threads (the caller's and worker threads the
kernel starts at first need and keeps asleep between calls), as torch's own CPU reductions use
its intra-op threads: a run told to use one thread (``OMP_NUM_THREADS=1``, ``torchrun``'s default)
gets one.  A tensor of more than ``SEGMENT_ELEMENTS`` elements is always read in segments of that
many, combined in order, so no value depends on the number of threads.

Accuracy and semantics (the eager path's, ``partials._cpu_values``):
- Sums: 16 float lanes accumulate blocks of 512 elements (32 per lane), and every block's sums
  are added in float64, so the error does not grow with the tensor size.  A block whose float sums
  are not finite (finite elements above ~1e18 overflow the squares, or a NaN/Inf) is redone in
  double, so any finite tensor gets finite sums; only such blocks pay for it.
- NaN/Inf counts come from that double redo: a finite block has none, so counting is free
  elsewhere (the eager path's trigger, per block instead of per tensor).
- min/max are NaN if any element is NaN, like ``torch.amin``/``amax``; ±Inf are ordinary values.
- zeros counts ``abs(x) < eps`` with ``eps`` rounded to float32, as the eager path's fp32
  comparison does (bf16/fp16 values are exact in float32).
- m2 (sum of squared deviations from the mean): per block, a second float pass shifted by the
  block's float mean (``sum(d^2) - sum(d)^2/512``, exact up to float rounding of the squares);
  blocks combine in double with Chan's formula (``stats.table``).  A NaN or Inf anywhere makes it
  NaN, as ``torch.var`` does.
- Segments of a large tensor combine as the blocks do: sums and counts added in double, extremes
  compared, m2 by Chan's formula.
The lanes are independent, so the compiler vectorizes them without fast-math and results do not
depend on the vector width.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import operator
import os
import platform
import shutil
import subprocess
from array import array
from collections.abc import Sequence
from pathlib import Path

import torch

from trainmon.stats import _kernel_cache

__all__ = ["enabled", "fill_rows", "partials_f32", "partials_into", "FUSED_DTYPES", "ENV", "COLUMNS"]

log = logging.getLogger(__name__)

ENV = "TRAINMON_FUSED_CPU"
_OFF = ("0", "false", "no", "off")
FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class _KindOf(dict):
    """dtype -> the kernel's kind; -1 (refused) for any other dtype."""

    def __missing__(self, _dtype: torch.dtype) -> int:
        return -1


_KIND_OF = _KindOf(_KIND)
_IS_CONTIGUOUS, _DATA_PTR, _NUMEL = torch.Tensor.is_contiguous, torch.Tensor.data_ptr, torch.Tensor.numel
_DTYPE = operator.attrgetter("dtype")
_IS_CPU = operator.attrgetter("is_cpu")
# The kernel reads with up to this many threads (the caller's included), as torch's own CPU ops do.
_threads = torch.get_num_threads
# A tensor of more elements is read as segments of this many (the C source's SEGMENT).
SEGMENT_ELEMENTS = 512 * 512
# The kernel's values, in ``partials._DEVICE_ORDER``: ``cols`` index this tuple.
COLUMNS = ("count", "sum", "sumsq", "min", "max", "nans", "infs", "zeros", "m2")

_C_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>

#define LANES 16
#define BLOCK 512
/* Each 16 elements read ask for the line 8 KiB ahead: a tensor read from memory or L3 came at
   ~60% of torch.sum's speed with the hardware prefetcher alone (single thread, 2026-12-06: fp32
   8 -> 10-11 GB/s, bf16 4.5-4.9 -> 7.7-9.2; in-cache reads unchanged).  A prefetch never faults,
   past a tensor's end included.  ESZ_<load>: the element size of that load's dtype. */
#define PREFETCH_BYTES 8192
#define ESZ_f32_at 4
#define ESZ_bf16_at 2
#define ESZ_f16_at 2
/* Output values, in the order of partials._DEVICE_ORDER. */
enum { C_COUNT, C_SUM, C_SUMSQ, C_MIN, C_MAX, C_NANS, C_INFS, C_ZEROS, C_M2, C_ALL };

static inline float f32_at(const void* p, int64_t i) { return ((const float*)p)[i]; }
static inline float bf16_at(const void* p, int64_t i) {
  uint32_t u = (uint32_t)((const uint16_t*)p)[i] << 16; float f; memcpy(&f, &u, 4); return f;
}
/* fp16 -> float without branches (the loops stay vectorized): rebias the exponent (Inf/NaN to
   255); a subnormal gets exponent 2^-14 added and subtracted, which is exact and needs no
   denormal arithmetic (DAZ/FTZ cannot change it). */
static inline float f16_at(const void* p, int64_t i) {
  uint32_t h = ((const uint16_t*)p)[i];
  uint32_t em = (h & 0x7fffu) << 13, exp = em & 0x0f800000u;
  uint32_t bits = em + (exp == 0x0f800000u ? (224u << 23) : exp == 0 ? (113u << 23) : (112u << 23));
  float f; memcpy(&f, &bits, 4);
  f = exp == 0 ? f - 0x1p-14f : f;
  memcpy(&bits, &f, 4); bits |= (h & 0x8000u) << 16;
  memcpy(&f, &bits, 4); return f;
}

/* Chan et al.: fold a piece (count nb, mean mb, m2 m2b) into the running (n, mean, m2). */
static inline void chan(double* n, double* mean, double* m2, double nb, double mb, double m2b) {
  if (*n == 0.0) { *n = nb; *mean = mb; *m2 = m2b; return; }
  double tot = *n + nb, delta = mb - *mean;
  *mean += delta * (nb / tot);
  *m2 += m2b + delta * delta * (*n * nb / tot);
  *n = tot;
}

/* EXACT: elements [i0, i0+len) in double (a block whose float sums are not finite, and the tail):
   sum, sum of squares, NaN/Inf counts and (m2 != 0) the mean and m2 of the piece, two passes. */
#define EXACT(NAME, LOAD)                                                                  \
static void NAME(const void* p, int64_t i0, int64_t len, int m2, double* r) {              \
  double s = 0.0, q = 0.0, nans = 0.0, infs = 0.0;                                        \
  for (int64_t k = i0; k < i0 + len; ++k) {                                               \
    double x = LOAD(p, k); s += x; q += x * x; nans += isnan(x) != 0; infs += isinf(x) != 0; \
  }                                                                                        \
  r[0] = s; r[1] = q; r[2] = nans; r[3] = infs; r[4] = len ? s / (double)len : 0.0; r[5] = 0.0; \
  if (m2) {                                                                                \
    double d2 = 0.0, mean = r[4];                                                          \
    for (int64_t k = i0; k < i0 + len; ++k) { double d = LOAD(p, k) - mean; d2 += d * d; } \
    r[5] = d2;                                                                             \
  }                                                                                        \
}

/* DEV: sum(d) and sum(d^2), d = x - shift, over the block at i (cache-resident: just read).  An
   explicit vector type (GCC and Clang): written as lane arrays, GCC vectorizes this loop across
   blocks with a horizontal add per element, 5x slower. */
typedef float lanes_t __attribute__((vector_size(LANES * sizeof(float))));
typedef double dlanes_t __attribute__((vector_size(LANES * sizeof(double))));
/* A float lane vector in double (one conversion per vector, not per lane); a loop where the
   builtin is missing (GCC before 9). */
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 9)
#define TO_DOUBLE(v) __builtin_convertvector(v, dlanes_t)
#else
static inline dlanes_t to_double(lanes_t v) { dlanes_t d; for (int j = 0; j < LANES; ++j) d[j] = v[j]; return d; }
#define TO_DOUBLE(v) to_double(v)
#endif
#define DEV(NAME, LOAD)                                                                    \
static void NAME(const void* p, int64_t i, float shift, double* sd, double* sdd) {         \
  lanes_t d1 = {0}, d2 = {0};                                                              \
  for (int64_t k = 0; k < BLOCK; k += LANES) {                                             \
    lanes_t x;                                                                             \
    for (int j = 0; j < LANES; ++j) x[j] = LOAD(p, i + k + j);                             \
    x -= shift; d1 += x; d2 += x * x;                                                      \
  }                                                                                        \
  *sd = 0.0; *sdd = 0.0;                                                                   \
  for (int j = 0; j < LANES; ++j) { *sd += d1[j]; *sdd += d2[j]; }                         \
}

/* The lanes FAST and ONE_PASS share: LANE_START before the blocks; LANE_BLOCK reads the block at
   i into the float lanes s, q (sums, squares), mn, mx and z (|x| < eps, when WANT_ZEROS);
   LANE_EXTREMES folds mn/mx into lo/hi, then reads the tail's extremes and zeros. */
#define LANE_START                                                                         \
  float mn[LANES], mx[LANES];                                                              \
  for (int j = 0; j < LANES; ++j) { mn[j] = INFINITY; mx[j] = -INFINITY; }                 \
  int64_t i = 0;                                                                           \
  const int64_t whole = n / BLOCK * BLOCK;
#define LANE_BLOCK(LOAD, WANT_ZEROS)                                                       \
    float s[LANES] = {0}, q[LANES] = {0};                                                  \
    int32_t z[LANES] = {0};                                                                \
    for (int64_t k = 0; k < BLOCK; k += LANES) {                                           \
      __builtin_prefetch((const char*)p + (i + k) * ESZ_##LOAD + PREFETCH_BYTES);          \
      for (int j = 0; j < LANES; ++j) {                                                    \
        float x = LOAD(p, i + k + j);                                                      \
        s[j] += x; q[j] += x * x;                                                          \
        mn[j] = x < mn[j] ? x : mn[j]; mx[j] = x > mx[j] ? x : mx[j];                      \
        if (WANT_ZEROS) z[j] += fabsf(x) < eps;                                            \
      }                                                                                    \
    }
#define LANE_EXTREMES(LOAD, WANT_ZEROS)                                                    \
  float lo = mn[0], hi = mx[0];                                                            \
  for (int j = 1; j < LANES; ++j) { lo = mn[j] < lo ? mn[j] : lo; hi = mx[j] > hi ? mx[j] : hi; } \
  for (int64_t k = i; k < n; ++k) {                                                        \
    float x = LOAD(p, k);                                                                  \
    lo = x < lo ? x : lo; hi = x > hi ? x : hi;                                            \
    if (WANT_ZEROS) zeros += fabsf(x) < eps;                                               \
  }

/* FAST: ONE_PASS without m2, for the common case of finite block sums: each lane's block sums go
   into double lanes, so a block ends with no horizontal sum (a chain of 32 dependent adds that
   took as long as the block's reads: the pass ran at half of torch.sum's speed).  Returns 0 when
   a sum is not finite (NaN, Inf, float overflow): ONE_PASS then starts over, block by block. */
#define FAST(NAME, LOAD, EXACT_FN)                                                         \
static inline int NAME(const void* p, int64_t n, float eps, int want_zeros, double* out) { \
  dlanes_t as = {0}, aq = {0};                                                             \
  int64_t zl[LANES] = {0};                                                                 \
  LANE_START                                                                               \
  for (; i < whole; i += BLOCK) {                                                          \
    LANE_BLOCK(LOAD, want_zeros)                                                           \
    lanes_t sv, qv; memcpy(&sv, s, sizeof sv); memcpy(&qv, q, sizeof qv);                  \
    as += TO_DOUBLE(sv); aq += TO_DOUBLE(qv);                                              \
    for (int j = 0; j < LANES; ++j) zl[j] += z[j];                                         \
  }                                                                                        \
  double sum = 0.0, sumsq = 0.0, zeros = 0.0;                                              \
  for (int j = 0; j < LANES; ++j) { sum += as[j]; sumsq += aq[j]; zeros += (double)zl[j]; } \
  LANE_EXTREMES(LOAD, want_zeros)                                                          \
  if (i < n) {                                                                             \
    double r[6]; EXACT_FN(p, i, n - i, 0, r);                                              \
    if (r[2] != 0.0 || r[3] != 0.0) return 0;                                              \
    sum += r[0]; sumsq += r[1];                                                            \
  }                                                                                        \
  if (!isfinite(sum + sumsq)) return 0;                                                    \
  out[C_COUNT] = (double)n; out[C_SUM] = sum; out[C_SUMSQ] = sumsq; out[C_MIN] = lo;       \
  out[C_MAX] = hi; out[C_NANS] = 0.0; out[C_INFS] = 0.0; out[C_ZEROS] = want_zeros ? zeros : 0.0; \
  out[C_M2] = 0.0; out[C_ALL] = n ? sum / (double)n : 0.0; /* the mean, for Chan */          \
  return 1;                                                                                \
}

/* ONE_PASS: one tensor's values: FAST's, unless m2 is wanted or FAST met a sum that is not
   finite; then block by block.  ZEROS and M2 are compile-time constants.  Blocks of 512
   elements go through 16 independent float lanes (vectorized without fast-math); each block's
   sums are added in double.
   A block whose float sums are not finite (overflow, NaN or Inf) is redone in double, which also
   counts its NaN/Inf elements: finite blocks have none.  m2: a second float pass over the
   (cache-resident) block, shifted by its float mean, gives the block's exact-order m2; blocks are
   combined in double with Chan's formula. */
#define ONE_PASS(NAME, LOAD, EXACT_FN, DEV_FN, FAST_FN, ZEROS, M2)                       \
static void NAME(const void* p, int64_t n, float eps, double* out) {                      \
  if (!M2 && FAST_FN(p, n, eps, ZEROS, out)) return;                                       \
  double sum = 0.0, sumsq = 0.0, nans = 0.0, infs = 0.0, zeros = 0.0;                     \
  double cn = 0.0, cmean = 0.0, cm2 = 0.0;                                                 \
  LANE_START                                                                               \
  for (; i < whole; i += BLOCK) {                                                          \
    LANE_BLOCK(LOAD, ZEROS)                                                                \
    double bs = 0.0, bq = 0.0, bmean = 0.0, bm2 = 0.0;                                     \
    for (int j = 0; j < LANES; ++j) { bs += s[j]; bq += q[j]; }                            \
    if (ZEROS) { int64_t zb = 0; for (int j = 0; j < LANES; ++j) zb += z[j]; zeros += (double)zb; } \
    int exact = !isfinite(bs + bq);                                                        \
    if (M2 && !exact) {                                                                    \
      float shift = (float)(bs / BLOCK); double sd, sdd; DEV_FN(p, i, shift, &sd, &sdd);   \
      bmean = (double)shift + sd / BLOCK; bm2 = sdd - sd * sd / BLOCK;                     \
      exact = !isfinite(bm2); /* deviations overflowed the float lanes */                  \
    }                                                                                      \
    if (exact) {                                                                           \
      double r[6]; EXACT_FN(p, i, BLOCK, M2, r);                                           \
      bs = r[0]; bq = r[1]; nans += r[2]; infs += r[3]; bmean = r[4]; bm2 = r[5];          \
    }                                                                                      \
    sum += bs; sumsq += bq;                                                                \
    if (M2) chan(&cn, &cmean, &cm2, BLOCK, bmean, bm2 < 0.0 ? 0.0 : bm2);                  \
  }                                                                                        \
  LANE_EXTREMES(LOAD, ZEROS)                                                               \
  if (i < n) {                                                                             \
    double r[6]; EXACT_FN(p, i, n - i, M2, r);                                             \
    sum += r[0]; sumsq += r[1]; nans += r[2]; infs += r[3];                                \
    if (M2) chan(&cn, &cmean, &cm2, (double)(n - i), r[4], r[5]);                          \
  }                                                                                        \
  if (nans != 0.0) { lo = hi = NAN; }  /* like torch.amin/amax */                         \
  out[C_COUNT] = (double)n; out[C_SUM] = sum; out[C_SUMSQ] = sumsq; out[C_MIN] = lo;       \
  out[C_MAX] = hi; out[C_NANS] = nans; out[C_INFS] = infs; out[C_ZEROS] = zeros;          \
  /* a NaN or Inf anywhere: m2 is NaN, as torch.var gives */                               \
  out[C_M2] = (nans != 0.0 || infs != 0.0) ? NAN : cm2;                                    \
  out[C_ALL] = M2 ? cmean : (n ? sum / (double)n : 0.0); /* the mean, for Chan */           \
}

#define PASSES(T, LOAD)                                                                    \
  EXACT(exact_##T, LOAD)                                                                   \
  DEV(dev_##T, LOAD)                                                                       \
  FAST(fast_##T, LOAD, exact_##T)                                                          \
  ONE_PASS(pass_##T, LOAD, exact_##T, dev_##T, fast_##T, 0, 0)                             \
  ONE_PASS(pass_##T##_z, LOAD, exact_##T, dev_##T, fast_##T, 1, 0)                         \
  ONE_PASS(pass_##T##_m, LOAD, exact_##T, dev_##T, fast_##T, 0, 1)                         \
  ONE_PASS(pass_##T##_zm, LOAD, exact_##T, dev_##T, fast_##T, 1, 1)

PASSES(f32, f32_at)
PASSES(bf16, bf16_at)
PASSES(f16, f16_at)

/* PAIR: the update ratio's sums over a snapshot a and the values b it became (one kind):
   r[0] = sum(a^2), r[1] = sum((a - b)^2), in one read of each (the torch ops it replaces read
   five times the bytes).  Differences in float: exact for bf16/fp16 values, one rounding for
   fp32.  Block sums in float lanes are added in double lanes; a pair whose sums come out not
   finite (a float overflow, NaN, Inf) is read again in double, so only NaN and Inf stay. */
#define PAIR(NAME, LOAD)                                                                   \
static void NAME(const void* a, const void* b, int64_t n, double* r) {                     \
  dlanes_t sa = {0}, sd = {0};                                                             \
  int64_t i = 0;                                                                           \
  const int64_t whole = n / BLOCK * BLOCK;                                                 \
  for (; i < whole; i += BLOCK) {                                                          \
    lanes_t qa = {0}, qd = {0};                                                            \
    for (int64_t k = 0; k < BLOCK; k += LANES) {                                           \
      __builtin_prefetch((const char*)a + (i + k) * ESZ_##LOAD + PREFETCH_BYTES);          \
      __builtin_prefetch((const char*)b + (i + k) * ESZ_##LOAD + PREFETCH_BYTES);          \
      lanes_t x, y;                                                                        \
      for (int j = 0; j < LANES; ++j) { x[j] = LOAD(a, i + k + j); y[j] = LOAD(b, i + k + j); } \
      y = x - y; qa += x * x; qd += y * y;                                                 \
    }                                                                                      \
    sa += TO_DOUBLE(qa); sd += TO_DOUBLE(qd);                                              \
  }                                                                                        \
  double s0 = 0.0, s1 = 0.0;                                                               \
  for (int j = 0; j < LANES; ++j) { s0 += sa[j]; s1 += sd[j]; }                            \
  for (; i < n; ++i) { double x = LOAD(a, i), d = x - (double)LOAD(b, i); s0 += x * x; s1 += d * d; } \
  if (!isfinite(s0 + s1)) {                                                                \
    s0 = s1 = 0.0;                                                                         \
    for (int64_t k = 0; k < n; ++k) {                                                      \
      double x = LOAD(a, k), d = x - (double)LOAD(b, k); s0 += x * x; s1 += d * d;        \
    }                                                                                      \
  }                                                                                        \
  r[0] = s0; r[1] = s1;                                                                    \
}
PAIR(pair_f32, f32_at)
PAIR(pair_bf16, bf16_at)
PAIR(pair_f16, f16_at)
typedef void (*pair_fn)(const void*, const void*, int64_t, double*);
static const pair_fn PAIR_OF[3] = {pair_f32, pair_bf16, pair_f16};

typedef void (*pass_fn)(const void*, int64_t, float, double*);
static const pass_fn PASS[3][4] = {
  {pass_f32, pass_f32_z, pass_f32_m, pass_f32_zm},
  {pass_bf16, pass_bf16_z, pass_bf16_m, pass_bf16_zm},
  {pass_f16, pass_f16_z, pass_f16_m, pass_f16_zm},
};
static const int64_t ESIZE[3] = {4, 2, 2};

/* A tensor of more than SEGMENT elements is read as segments of SEGMENT elements (the last one
   shorter), whatever the number of threads, so its values never depend on it: each segment's
   values as a tensor's, combined in order in double (Chan's formula for m2).  Segments let
   threads share one large tensor. */
#define SEGMENT ((int64_t)BLOCK * 512)
/* A call reading fewer bytes runs on the calling thread alone: waking a worker costs more. */
#define PARALLEL_MIN_BYTES ((int64_t)1 << 20)
#define MAX_WORKERS 63
#define PART (C_ALL + 1) /* a piece's values, then its mean (for Chan's formula) */
#define C_MEAN C_ALL

static int64_t segments(int64_t n) { return n > SEGMENT ? (n + SEGMENT - 1) / SEGMENT : 1; }

/* Fold piece r into acc (the tensor's values so far, in segment order). */
static void fold(double* acc, const double* r) {
  double n = acc[C_COUNT], mean = acc[C_MEAN], m2 = acc[C_M2];
  chan(&n, &mean, &m2, r[C_COUNT], r[C_MEAN], r[C_M2]);
  acc[C_COUNT] = n; acc[C_MEAN] = mean; acc[C_M2] = m2;
  acc[C_SUM] += r[C_SUM]; acc[C_SUMSQ] += r[C_SUMSQ];
  acc[C_MIN] = r[C_MIN] < acc[C_MIN] ? r[C_MIN] : acc[C_MIN];
  acc[C_MAX] = r[C_MAX] > acc[C_MAX] ? r[C_MAX] : acc[C_MAX];
  acc[C_NANS] += r[C_NANS]; acc[C_INFS] += r[C_INFS]; acc[C_ZEROS] += r[C_ZEROS];
}

/* A whole tensor's values from its pieces (one piece: as read). */
static void finish(double* acc, int64_t pieces) {
  if (pieces == 1) return;
  if (acc[C_NANS] != 0.0) acc[C_MIN] = acc[C_MAX] = NAN;
  if (acc[C_NANS] != 0.0 || acc[C_INFS] != 0.0) acc[C_M2] = NAN;
}

typedef struct {
  const int64_t *ptrs, *numels; const int32_t* kinds;
  const int64_t* pairs; /* the update ratio's second tensors (PAIR), or NULL (PASS) */
  int variant; float feps;
  int64_t items; int64_t* item_tensor; int64_t* item_start; double* parts;
  int64_t next, done;  /* atomics: the next item to take, items finished */
  int seats, inside;   /* under pool.mu: workers that may join, workers inside */
} job_t;

static void read_piece(const job_t* job, int64_t t, int64_t i0, double* r) {
  int64_t len = job->numels[t] - i0 < SEGMENT ? job->numels[t] - i0 : SEGMENT;
  const int64_t at = i0 * ESIZE[job->kinds[t]];
  const char* data = (const char*)(intptr_t)job->ptrs[t] + at;
  if (job->pairs)
    PAIR_OF[job->kinds[t]](data, (const char*)(intptr_t)job->pairs[t] + at, len, r);
  else
    PASS[job->kinds[t]][job->variant](data, len, job->feps, r);
}

static void run_items(job_t* job) {
  for (;;) {
    int64_t k = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
    if (k >= job->items) return;
    read_piece(job, job->item_tensor[k], job->item_start[k], job->parts + k * PART);
    __atomic_fetch_add(&job->done, 1, __ATOMIC_RELEASE);
  }
}

/* Worker threads, started at the first call that wants them and kept (idle ones sleep on a
   condition variable: no spinning beside the training's own threads).  One call uses them at a
   time; a second thread's call meanwhile reads alone. */
static struct {
  pthread_mutex_t mu; pthread_cond_t wake, idle;
  int workers, forked_handler; uint64_t gen; job_t* job;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, NULL};
static pthread_mutex_t call_mu = PTHREAD_MUTEX_INITIALIZER;

static void* worker(void* unused) {
  (void)unused;
  uint64_t seen = 0;
  pthread_mutex_lock(&pool.mu);
  for (;;) {
    while (pool.gen == seen) pthread_cond_wait(&pool.wake, &pool.mu);
    seen = pool.gen;
    job_t* job = pool.job;
    if (!job || job->seats <= 0) continue;
    job->seats--; job->inside++;
    pthread_mutex_unlock(&pool.mu);
    run_items(job);
    pthread_mutex_lock(&pool.mu);
    if (--job->inside == 0) pthread_cond_signal(&pool.idle);
  }
  return NULL;
}

/* A forked child has none of the parent's threads: its pool starts empty. */
static void after_fork_in_child(void) {
  pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
  pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
  pool.mu = mu; call_mu = mu; pool.wake = cv; pool.idle = cv;
  pool.workers = 0; pool.gen = 0; pool.job = NULL;
}

/* Under pool.mu: at least `want` workers if the system gives them; how many there are. */
static int start_workers(int want) {
  if (!pool.forked_handler) pool.forked_handler = pthread_atfork(NULL, NULL, after_fork_in_child) == 0;
  if (!pool.forked_handler) return 0;
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old); /* signals stay with the process's own threads */
  while (pool.workers < want) {
    pthread_t th;
    if (pthread_create(&th, NULL, worker, NULL) != 0) break;
    pthread_detach(th);
    pool.workers++;
  }
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  return pool.workers;
}

static void run_parallel(job_t* job, int helpers) {
  if (pthread_mutex_trylock(&call_mu) != 0) { run_items(job); return; }
  pthread_mutex_lock(&pool.mu);
  int have = start_workers(helpers);
  job->seats = have < helpers ? have : helpers; job->inside = 0;
  pool.job = job; pool.gen++;
  pthread_cond_broadcast(&pool.wake);
  pthread_mutex_unlock(&pool.mu);
  run_items(job);
  /* the items the workers took: at most one each, still running */
  while (__atomic_load_n(&job->done, __ATOMIC_ACQUIRE) < job->items) sched_yield();
  pthread_mutex_lock(&pool.mu);
  pool.job = NULL;
  while (job->inside > 0) pthread_cond_wait(&pool.idle, &pool.mu);
  pthread_mutex_unlock(&pool.mu);
  pthread_mutex_unlock(&call_mu);
}

static int wants_threads(int64_t threads, int64_t items, int64_t bytes) {
  return threads > 1 && items > 1 && bytes >= PARALLEL_MIN_BYTES;
}

/* The n tensors' segments (items) read into job->parts, on up to `threads` threads: 0, or -2
   when memory for the items ran out.  The caller frees job->item_tensor and job->parts. */
static int read_items(job_t* job, int64_t n, int64_t items, int64_t threads, int64_t bytes) {
  job->items = items;
  job->item_tensor = malloc((size_t)items * 2 * sizeof(int64_t));
  job->parts = malloc((size_t)items * PART * sizeof(double));
  if (!job->item_tensor || !job->parts) { free(job->item_tensor); free(job->parts); return -2; }
  job->item_start = job->item_tensor + items;
  for (int64_t t = 0, k = 0; t < n; ++t)
    for (int64_t s = 0; s < segments(job->numels[t]); ++s, ++k) { job->item_tensor[k] = t; job->item_start[k] = s * SEGMENT; }
  if (wants_threads(threads, items, bytes)) {
    int64_t helpers = threads - 1 < MAX_WORKERS ? threads - 1 : MAX_WORKERS;
    run_parallel(job, (int)(helpers < items - 1 ? helpers : items - 1));
  } else {
    run_items(job);
  }
  return 0;
}

/* The worker threads started in this process (after a fork: the child's own). */
int64_t trainmon_worker_threads(void) {
  pthread_mutex_lock(&pool.mu);
  int64_t workers = pool.workers;
  pthread_mutex_unlock(&pool.mu);
  return workers;
}

/* Rows of n tensors: tensor t (data ptrs[t], numels[t] elements of kinds[t]: 0 float32,
   1 bfloat16, 2 float16) fills out[t * width + j] with value cols[j] (C_COUNT .. C_M2).  zeros
   counts |x| < eps compared in float32, as the eager path's fp32 comparison does.  Up to
   `threads` threads read (the caller's included) when the call reads at least
   PARALLEL_MIN_BYTES; the values do not depend on it.  Returns 0, -1 for a bad column, -2 when
   memory for the pieces ran out, or t + 1 for the first tensor it cannot read (unknown kind,
   null data). */
int64_t trainmon_partials_many(const int64_t* ptrs, const int64_t* numels, const int32_t* kinds,
                               int64_t n, double* out, int64_t width, const int64_t* cols,
                               double eps, int64_t threads) {
  int variant = 0;
  for (int64_t j = 0; j < width; ++j) {
    if (cols[j] < 0 || cols[j] >= C_ALL) return -1;
    if (cols[j] == C_ZEROS) variant |= 1;
    if (cols[j] == C_M2) variant |= 2;
  }
  int64_t items = 0, bytes = 0;
  for (int64_t t = 0; t < n; ++t) {
    if (kinds[t] < 0 || kinds[t] > 2 || numels[t] < 0 || (!ptrs[t] && numels[t])) return t + 1;
    items += segments(numels[t]);
    bytes += numels[t] * ESIZE[kinds[t]];
  }
  job_t job = {ptrs, numels, kinds, NULL, variant, (float)eps, 0, NULL, NULL, NULL, 0, 0, 0, 0};
  double one[PART];
  if (items == n && !wants_threads(threads, items, bytes)) {
    for (int64_t t = 0; t < n; ++t) { /* no tensor in segments, one thread: as read */
      read_piece(&job, t, 0, one);
      for (int64_t j = 0; j < width; ++j) out[t * width + j] = one[cols[j]];
    }
    return 0;
  }
  if (read_items(&job, n, items, threads, bytes) != 0) return -2;
  for (int64_t t = 0, k = 0; t < n; ++t) {
    int64_t pieces = segments(numels[t]);
    memcpy(one, job.parts + k * PART, sizeof one);
    for (int64_t s = 1; s < pieces; ++s) fold(one, job.parts + (k + s) * PART);
    finish(one, pieces);
    k += pieces;
    for (int64_t j = 0; j < width; ++j) out[t * width + j] = one[cols[j]];
  }
  free(job.item_tensor); free(job.parts);
  return 0;
}

/* The update ratio's sums of n pairs: snapshot ptrs[t] and values pairs[t] (numels[t] elements
   of kinds[t] each) give out[2t] = sum(a^2), out[2t+1] = sum((a-b)^2), segments added in order
   (values independent of `threads`).  Returns 0, -2 (out of memory) or t + 1 for the first pair
   it cannot read. */
int64_t trainmon_pair_sumsq(const int64_t* ptrs, const int64_t* pairs, const int64_t* numels,
                            const int32_t* kinds, int64_t n, double* out, int64_t threads) {
  int64_t items = 0, bytes = 0;
  for (int64_t t = 0; t < n; ++t) {
    if (kinds[t] < 0 || kinds[t] > 2 || numels[t] < 0 || ((!ptrs[t] || !pairs[t]) && numels[t])) return t + 1;
    items += segments(numels[t]);
    bytes += 2 * numels[t] * ESIZE[kinds[t]];
  }
  job_t job = {ptrs, numels, kinds, pairs, 0, 0.0f, 0, NULL, NULL, NULL, 0, 0, 0, 0};
  if (items == n && !wants_threads(threads, items, bytes)) {
    for (int64_t t = 0; t < n; ++t) read_piece(&job, t, 0, out + 2 * t);
    return 0;
  }
  if (read_items(&job, n, items, threads, bytes) != 0) return -2;
  for (int64_t t = 0, k = 0; t < n; ++t) {
    out[2 * t] = out[2 * t + 1] = 0.0;
    for (int64_t s = 0; s < segments(numels[t]); ++s, ++k) {
      out[2 * t] += job.parts[k * PART]; out[2 * t + 1] += job.parts[k * PART + 1];
    }
  }
  free(job.item_tensor); free(job.parts);
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


def fill_rows(
    tensors: Sequence[torch.Tensor], out: torch.Tensor, start: int, cols: Sequence[int], eps: float = 1e-8
) -> None:
    """``partials_into`` without its argument checks, for the engine's own step buffer: one C
    call for the whole batch.  The per-tensor arrays are built with list comprehensions (one
    Python frame each, whatever the number of tensors: the hot path of every capture).  Raises
    ValueError if a tensor cannot be read (the caller then goes one by one)."""
    colmap = _COLMAPS.get(cols)  # type: ignore[call-overload]
    if colmap is None:
        colmap = _COLMAPS[tuple(cols)] = (ctypes.c_int64 * len(cols))(*cols)
    if not all(map(_IS_CONTIGUOUS, tensors)):
        # detach: a copy of an activation must not record autograd history
        tensors = [t if t.is_contiguous() else t.detach().contiguous() for t in tensors]
    # Kept alive until the call returns (the copies above, too, through ``tensors``).  ``map``
    # over C methods: no Python frame, whatever the number of tensors.
    ptrs = array("q", map(_DATA_PTR, tensors))
    numels = array("q", map(_NUMEL, tensors))
    kinds = array("i", map(_KIND_OF.__getitem__, map(_DTYPE, tensors)))
    width = len(cols)
    bad = _state["fn"](  # type: ignore[operator]
        ptrs.buffer_info()[0],
        numels.buffer_info()[0],
        kinds.buffer_info()[0],
        len(ptrs),
        out.data_ptr() + start * width * 8,
        width,
        colmap,
        eps,
        _threads(),
    )
    if bad:
        raise ValueError(_refusal(bad, tensors))


def pair_sumsq(snapshots: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[n, 2]`` float64: ``sum(a**2)`` and ``sum((a - b)**2)`` of each pair (a snapshot and the
    values it became: the update ratio's two norms, squared), one read of each tensor, in one C
    call.  Pairs: contiguous CPU tensors of one ``FUSED_DTYPES`` dtype and size.  Raises
    ValueError for anything else (the caller then takes torch's ops)."""
    if _function() is None:
        raise ValueError(f"fused CPU kernel unavailable: {_state.get('error')}")
    both = (*snapshots, *values)
    if not (all(map(_IS_CPU, both)) and all(map(_IS_CONTIGUOUS, both))):
        raise ValueError("pair_sumsq: contiguous CPU tensors only")
    if list(map(_NUMEL, snapshots)) != list(map(_NUMEL, values)) or list(map(_DTYPE, snapshots)) != list(
        map(_DTYPE, values)
    ):
        raise ValueError("pair_sumsq: the two tensors of a pair must have one size and one dtype")
    out = torch.empty((len(snapshots), 2), dtype=torch.float64)
    ptrs = array("q", map(_DATA_PTR, snapshots))
    pairs = array("q", map(_DATA_PTR, values))
    numels = array("q", map(_NUMEL, snapshots))
    kinds = array("i", map(_KIND_OF.__getitem__, map(_DTYPE, snapshots)))
    bad = _state["lib"].trainmon_pair_sumsq(  # type: ignore[attr-defined]
        ptrs.buffer_info()[0],
        pairs.buffer_info()[0],
        numels.buffer_info()[0],
        kinds.buffer_info()[0],
        len(ptrs),
        out.data_ptr(),
        _threads(),
    )
    if bad:
        raise ValueError(_refusal(bad, snapshots))
    return out


def worker_threads() -> int:
    """The kernel's worker threads started in this process so far (0 before a parallel call)."""
    fn = _function()
    if fn is None:
        return 0
    lib = _state["lib"]
    return int(lib.trainmon_worker_threads())  # type: ignore[attr-defined]


def _refusal(code: int, tensors: Sequence[torch.Tensor]) -> str:
    """The kernel's refusal as a sentence (never on the hot path)."""
    if code == -2:
        return "fused CPU kernel: out of memory for a large tensor's segments"
    if code < 0:
        return "fused CPU kernel: a column index outside 0..8"
    t = tensors[code - 1]
    if t.dtype not in _KIND:
        return f"fused CPU kernel: unsupported dtype {t.dtype}"
    return "the tensor has no data (its data pointer is null)"  # a FakeTensor: reading 0 would crash


def partials_into(
    tensors: Sequence[torch.Tensor], out: torch.Tensor, start: int, cols: Sequence[int], eps: float = 1e-8
) -> None:
    """Write rows ``start..`` of ``out`` (contiguous float64 ``[rows, len(cols)]``, CPU):
    column ``j`` of a tensor's row is fused value ``cols[j]`` (0 count, 1 sum, 2 sumsq, 3 min,
    4 max, 5 nans, 6 infs, 7 zeros (``abs(x) < eps``), 8 m2).  ``tensors``: CPU tensors of a
    ``FUSED_DTYPES`` dtype."""
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
    fill_rows(tensors, out, start, tuple(cols), eps)


def partials_f32(tensors: Sequence[torch.Tensor], eps: float = 1e-8) -> torch.Tensor:
    """``[len(tensors) x 9]`` float64, one pass per tensor: count, sum, sumsq, min, max, nans,
    infs, zeros, m2 (``COLUMNS``)."""
    out = torch.empty((len(tensors), len(COLUMNS)), dtype=torch.float64)
    partials_into(tensors, out, 0, range(len(COLUMNS)), eps)
    return out


def _function():
    if "fn" not in _state:
        _state["fn"] = None
        try:
            lib = _kernel_cache.load(_library_name(), _compile)
            fn = lib.trainmon_partials_many
            fn.argtypes = [
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_int64,
                ctypes.c_void_p,
                ctypes.c_int64,
                ctypes.c_void_p,
                ctypes.c_double,
                ctypes.c_int64,
            ]
            fn.restype = ctypes.c_int64
            lib.trainmon_worker_threads.restype = ctypes.c_int64
            lib.trainmon_pair_sumsq.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
            lib.trainmon_pair_sumsq.restype = ctypes.c_int64
            _state["lib"], _state["fn"] = lib, fn
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
            [cc, "-O3", *arch, "-shared", "-fPIC", "-pthread", "-o", str(lib), str(src)],
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
