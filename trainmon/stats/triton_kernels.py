"""The Triton kernels of the device path (imported only by ``stats.device_triton``, which decides
whether Triton is used at all; importing this module imports ``triton``).

``chunk_partials``: one program per chunk of one tensor, reading the chunk once, writing one row
of float32 partials: the sum and the sum of squares of the chunk's elements (scaled by ``2**-k``),
``k``, min, max (NaN if the chunk has one) and the requested counts (exact: a chunk has
at most 2^20 elements).  The read loop adds the plain values (``k = 0``), so it reads at a plain
reduction's speed; only a chunk whose sums are not finite (an overflow: |x| above ~1.8e19, or
Inf/NaN in it) or whose squares underflow is read again, scaled by ``2**-k`` (``k`` the chunk's
exponent, a power of two at or above its largest |x|, as LAPACK's ``nrm2`` scales: exact, and no
overflow whatever the magnitudes).

``tensor_rows``: one program per tensor, combining its chunks' partials (the scaled sums brought
to the largest exponent of the tensor first) into its row of the device row buffer: the sum, the
norm, min, max in float32, the counts in int64.

Chunk descriptors (``TABLE``): an int64 pair per chunk, (element offset from the base tensor's
first element, elements), then the first chunk of every tensor; the tensors of one launch share a
dtype and ``base`` is any one of them.  Without a table, the launch covers one tensor of ``numel``
elements in chunks of ``CHUNK``.  ``WANT`` is a bit set of the partials to compute (``WANT_*``
below, written first in ``WANT_* & WANT``: the interpreter's constexpr has no reflected ``&``);
a chunk's row of partials is always ``P`` floats at the fixed columns ``COL_*``.
"""
# mypy: ignore-errors
# (Triton's language objects are not typed for mypy; the launcher in device_triton.py is.)

from __future__ import annotations

import triton
import triton.language as tl

# The bits of WANT and the columns of a chunk's partials (constexpr: globals a kernel may read).
WANT_SUM = tl.constexpr(1)
WANT_SQ = tl.constexpr(2)
WANT_MIN = tl.constexpr(4)
WANT_NAN = tl.constexpr(8)
WANT_INF = tl.constexpr(16)
WANT_ZERO = tl.constexpr(32)
COL_SUM = tl.constexpr(0)
COL_SQ = tl.constexpr(1)
COL_EXP = tl.constexpr(2)  # the power of two the chunk's sums are scaled by
COL_MIN = tl.constexpr(3)  # and max at COL_MIN + 1
COL_NAN = tl.constexpr(5)
COL_INF = tl.constexpr(6)
COL_ZERO = tl.constexpr(7)
P = tl.constexpr(8)


@triton.jit
def _pow2(k):
    """2**k as float32 for integer ``k`` <= 127; 0 below 2**-126 (only ever a negligible term)."""
    return tl.where(k < -126, 0.0, ((tl.maximum(k, -126) + 127) << 23).to(tl.float32, bitcast=True))


@triton.jit
def _exponent(a):
    """The exponent ``k`` in [-126, 126] with ``a < 2**(k + 1)`` for finite ``a >= 0`` (up to
    ``2**127 <= a``, where ``a / 2**k < 4``); Inf and NaN give 126."""
    biased = (a.to(tl.int32, bitcast=True) >> 23) & 0xFF
    return tl.minimum(tl.maximum(biased, 1), 253) - 127


@triton.jit
def chunk_partials(
    x_ptr,
    desc_ptr,
    part_ptr,
    numel,
    eps,
    TABLE: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    WANT: tl.constexpr,
):
    pid = tl.program_id(0)
    if TABLE:
        start = tl.load(desc_ptr + 2 * pid)
        n = tl.load(desc_ptr + 2 * pid + 1)
    else:
        start = pid.to(tl.int64) * CHUNK
        n = tl.minimum(numel - start, CHUNK)
    # The read loop adds the plain values (no per-lane scaling: it runs at the speed of a plain
    # reduction such as torch.aminmax); a chunk whose sums float32 cannot hold (|x| above ~1.8e19)
    # or whose squares underflow (|x| below ~2**-50) is read a second time, scaled (below): rare.
    acc_s = tl.zeros([BLOCK], dtype=tl.float32)
    acc_q = tl.zeros([BLOCK], dtype=tl.float32)
    peak = tl.zeros([BLOCK], dtype=tl.float32)
    lo = tl.full([BLOCK], float("inf"), tl.float32)
    hi = tl.full([BLOCK], float("-inf"), tl.float32)
    nans = tl.zeros([BLOCK], dtype=tl.int32)
    infs = tl.zeros([BLOCK], dtype=tl.int32)
    zeros = tl.zeros([BLOCK], dtype=tl.int32)
    for b in range(0, n, BLOCK):
        offs = b + tl.arange(0, BLOCK)
        inside = offs < n
        x = tl.load(x_ptr + start + offs, mask=inside, other=0.0).to(tl.float32)
        a = tl.abs(x)
        isnan = x != x
        if (WANT_SUM | WANT_SQ) & WANT:
            acc_s += x
            acc_q += x * x
            peak = tl.maximum(peak, a)
        if (WANT_MIN | WANT_NAN) & WANT:
            nans += isnan.to(tl.int32)
        if WANT_MIN & WANT:
            lo = tl.minimum(lo, tl.where(inside & ~isnan, x, float("inf")))
            hi = tl.maximum(hi, tl.where(inside & ~isnan, x, float("-inf")))
        if WANT_INF & WANT:
            infs += (a == float("inf")).to(tl.int32)
        if WANT_ZERO & WANT:
            zeros += (inside & (a < eps)).to(tl.int32)
    row = part_ptr + pid.to(tl.int64) * P
    if (WANT_SUM | WANT_SQ) & WANT:
        s = tl.sum(acc_s, axis=0)
        q = tl.sum(acc_q, axis=0)
        top = tl.max(peak, axis=0)
        k = tl.zeros([], dtype=tl.int32)
        # Sums that are Inf/NaN (an overflow, or Inf/NaN in the data: the scaled pass gives those
        # as such) or squares below float32's normal range beside a non-zero |x|: the scaled pass.
        if ((s - s) != 0) | ((q - q) != 0) | ((q < 7.9e-31) & (top > 0)):
            k = _exponent(top)  # a power of two at or above the chunk's largest |x|: sums stay finite
            scale = _pow2(-k)
            acc_s = tl.zeros([BLOCK], dtype=tl.float32)
            acc_q = tl.zeros([BLOCK], dtype=tl.float32)
            for b in range(0, n, BLOCK):
                offs = b + tl.arange(0, BLOCK)
                xs = tl.load(x_ptr + start + offs, mask=offs < n, other=0.0).to(tl.float32) * scale
                acc_s += xs
                acc_q += xs * xs
            s = tl.sum(acc_s, axis=0)
            q = tl.sum(acc_q, axis=0)
        if WANT_SUM & WANT:
            tl.store(row + COL_SUM, s)
        if WANT_SQ & WANT:
            tl.store(row + COL_SQ, q)
        tl.store(row + COL_EXP, k.to(tl.float32))
    if WANT_MIN & WANT:
        has_nan = tl.sum(nans, axis=0) > 0
        tl.store(row + COL_MIN, tl.where(has_nan, float("nan"), tl.min(lo, axis=0)))
        tl.store(row + COL_MIN + 1, tl.where(has_nan, float("nan"), tl.max(hi, axis=0)))
    if WANT_NAN & WANT:
        tl.store(row + COL_NAN, tl.sum(nans, axis=0).to(tl.float32))
    if WANT_INF & WANT:
        tl.store(row + COL_INF, tl.sum(infs, axis=0).to(tl.float32))
    if WANT_ZERO & WANT:
        tl.store(row + COL_ZERO, tl.sum(zeros, axis=0).to(tl.float32))


@triton.jit
def tensor_rows(
    part_ptr,
    first_ptr,
    n_chunks,
    first_tensor,
    values_ptr,
    values_stride,
    counts_ptr,
    counts_stride,
    TABLE: tl.constexpr,
    BLOCK: tl.constexpr,
    WANT: tl.constexpr,
    V_SUM: tl.constexpr,
    V_SQ: tl.constexpr,
    V_MIN: tl.constexpr,
    K_NAN: tl.constexpr,
    K_INF: tl.constexpr,
    K_ZERO: tl.constexpr,
):
    pid = tl.program_id(0)
    if TABLE:
        c0 = tl.load(first_ptr + first_tensor + pid)
        c1 = tl.load(first_ptr + first_tensor + pid + 1)
    else:
        c0 = 0
        c1 = n_chunks
    values = values_ptr + pid.to(tl.int64) * values_stride
    counts = counts_ptr + pid.to(tl.int64) * counts_stride
    if (WANT_SUM | WANT_SQ) & WANT:
        top = -126
        for c in range(c0, c1, BLOCK):
            idx = c + tl.arange(0, BLOCK)
            e = tl.load(part_ptr + idx * P + COL_EXP, mask=idx < c1, other=-126.0)
            top = tl.maximum(top, tl.max(e, axis=0).to(tl.int32))
        s = tl.zeros([BLOCK], dtype=tl.float32)
        q = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(c0, c1, BLOCK):
            idx = c + tl.arange(0, BLOCK)
            inside = idx < c1
            shift = tl.load(part_ptr + idx * P + COL_EXP, mask=inside, other=-126.0).to(tl.int32) - top
            if WANT_SUM & WANT:
                s += tl.load(part_ptr + idx * P + COL_SUM, mask=inside, other=0.0) * _pow2(shift)
            if WANT_SQ & WANT:
                q += tl.load(part_ptr + idx * P + COL_SQ, mask=inside, other=0.0) * _pow2(2 * shift)
        if V_SUM >= 0:
            tl.store(values + V_SUM, tl.sum(s, axis=0) * _pow2(top))
        if V_SQ >= 0:
            # sqrt_rn: rounded as IEEE says (tl.sqrt may be the approximate one)
            tl.store(values + V_SQ, tl.sqrt_rn(tl.sum(q, axis=0)) * _pow2(top))
    if V_MIN >= 0:
        lo = tl.full([BLOCK], float("inf"), tl.float32)
        hi = tl.full([BLOCK], float("-inf"), tl.float32)
        nan = tl.zeros([BLOCK], dtype=tl.int32)
        for c in range(c0, c1, BLOCK):
            idx = c + tl.arange(0, BLOCK)
            inside = idx < c1
            a = tl.load(part_ptr + idx * P + COL_MIN, mask=inside, other=float("inf"))
            b = tl.load(part_ptr + idx * P + COL_MIN + 1, mask=inside, other=float("-inf"))
            nan += (a != a).to(tl.int32)
            lo = tl.minimum(lo, tl.where(a != a, float("inf"), a))
            hi = tl.maximum(hi, tl.where(b != b, float("-inf"), b))
        has_nan = tl.sum(nan, axis=0) > 0
        tl.store(values + V_MIN, tl.where(has_nan, float("nan"), tl.min(lo, axis=0)))
        tl.store(values + V_MIN + 1, tl.where(has_nan, float("nan"), tl.max(hi, axis=0)))
    if K_NAN >= 0:
        tl.store(counts + K_NAN, _count(part_ptr, c0, c1, COL_NAN, BLOCK))
    if K_INF >= 0:
        tl.store(counts + K_INF, _count(part_ptr, c0, c1, COL_INF, BLOCK))
    if K_ZERO >= 0:
        tl.store(counts + K_ZERO, _count(part_ptr, c0, c1, COL_ZERO, BLOCK))


@triton.jit
def _count(part_ptr, c0, c1, COL: tl.constexpr, BLOCK: tl.constexpr):
    """The int64 sum of one count column over chunks ``[c0, c1)`` (each chunk's count is exact)."""
    total = tl.zeros([BLOCK], dtype=tl.int64)
    for c in range(c0, c1, BLOCK):
        idx = c + tl.arange(0, BLOCK)
        total += tl.load(part_ptr + idx * P + COL, mask=idx < c1, other=0.0).to(tl.int64)
    return tl.sum(total, axis=0)
