"""Per-tensor mergeable partials of CPU tensors (accelerator tensors: ``stats.device_rows``).

``write_cpu_rows`` is the engine's path for CPU tensors: rows go straight into its step buffer,
through the fused one-pass kernel (``_fused_cpu``: every column, float32/bf16/fp16 strided
tensors, one C call per batch) unless it is off or unavailable, else through the eager reductions
below (which also serve every other dtype and layout, and define the values the kernel matches).
``compute_partials(tensors, columns, eps)`` returns one float64 row per tensor (a convenience for
tests and tools; accelerator tensors go through ``DeviceRows`` there).

Accuracy notes (why the code looks like this):
- fp32 ``vector_norm`` on CPU drifts on large tensors (~3e-3 relative at 40M elements), so large
  CPU tensors are reduced in blocks of 1K elements whose results are summed in fp64
  (measured: 7e-7 relative error on 40M equal values, against 5e-2 unblocked).
- Low-precision (bf16/fp16) tensors on CPU are upcast in bounded chunks into one reused buffer:
  passing ``dtype=float32`` to a reduction makes ATen copy the whole tensor first, and reducing in
  the native dtype rounds the result to 8 bits of mantissa.  On CUDA the ``dtype=`` reductions
  accumulate in fp32 inside the kernel, so they are used directly.
- NaN/Inf counts cost a full pass each, so they are computed only for tensors whose sum of squares
  is not finite (a NaN or Inf anywhere makes it non-finite); on the CPU that check is free.
- Dtypes without CPU reductions (float8, ...) take the same chunked fp32 upcast as bf16/fp16 (exact:
  every such dtype is narrower than fp32); complex tensors are reduced by their modulus; sparse
  tensors by their stored values merged with their implicit zeros (``stats.odd_tensors``).
- Overflow: fp32 sums of squares overflow for elements above ~1.8e19 (and sums near 3.4e38),
  though every element is finite.  A row whose sum, sum of squares or m2 is not finite while the
  tensor is all finite is recomputed in float64 chunks (``_rescued``): only such tensors pay it.
"""

from __future__ import annotations

import math
import operator
from collections import defaultdict
from collections.abc import Sequence
from typing import cast

import numpy as np
import torch

from trainmon.stats import _fused_cpu
from trainmon.stats.host_rows import HostRows
from trainmon.stats.odd_tensors import STRIDED, Skipped, explicit_values, reason_of, with_implicit_zeros
from trainmon.stats.table import PARTIAL, combine

__all__ = ["compute_partials", "write_cpu_rows", "device_columns"]

# Floating dtypes reduced through an fp32 upcast (bf16/fp16 for accuracy, float8 and the like
# because CPU reductions have no kernels for them): every floating dtype but fp32 and fp64.
_UPCAST = frozenset(
    d
    for d in vars(torch).values()
    if isinstance(d, torch.dtype) and d.is_floating_point and d not in (torch.float32, torch.float64)
)
_BLOCK = 1 << 10  # elements per block when reducing CPU tensors (accuracy, see above)
_BIG = 1 << 16  # tensors larger than this take the blocked path on CPU
_ONE_PASS_EXTREMES = 1 << 20
_CHUNK = 1 << 22  # elements per fp32 chunk when upcasting low precision on CPU

# Columns computed on the device, in order; "count" comes from numel.
_DEVICE_ORDER = ("count", "sum", "sumsq", "min", "max", "nans", "infs", "zeros", "m2")


def device_columns(partials: Sequence[str]) -> tuple[str, ...]:
    """Columns of the partials matrix: ``count`` always first, then what the ops need."""
    wanted = set(partials) | {"count"}
    if wanted & {"nans", "infs"}:
        wanted.add("sumsq")  # the finiteness trigger for the counts
    return tuple(c for c in _DEVICE_ORDER if c in wanted)


@torch.no_grad()
def compute_partials(
    tensors: Sequence[torch.Tensor], columns: Sequence[str], eps: float, no_sync: bool = False
) -> list[torch.Tensor]:
    """Partials rows, one ``[len(columns)]`` float64 CPU tensor per input.  CPU tensors take the
    engine's CPU path (the fused kernel when it is on); others the device path,
    read back at once (this function waits for the device: not for hooks)."""
    from trainmon.stats.device_rows import DeviceRows

    rows: list[torch.Tensor | None] = [None] * len(tensors)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for i, t in enumerate(tensors):
        groups[(t.device, t.dtype)].append(i)
    for (device, dtype), idx in groups.items():
        group = [tensors[i] for i in idx]
        if device.type != "cpu":
            dev = DeviceRows(device, columns, eps)
            dev.write(group)
            mats = list(torch.from_numpy(dev.snapshot().rows(columns)).unbind(0))  # type: ignore[union-attr]
        elif (
            dtype in _FUSED_DTYPES
            and all(t.layout is STRIDED for t in group)
            and (fused := fused_columns(columns)) is not None
        ):
            mats = _fused_rows(group, fused, eps)
        else:
            mats = [_cpu_row(t, columns, eps) for t in group]
        for i, row in zip(idx, mats):
            rows[i] = row
    return rows  # type: ignore[return-value]


_FUSED_DTYPES = frozenset(_fused_cpu.FUSED_DTYPES)
_DTYPE = operator.attrgetter("dtype")
_FUSED_INDEX = {c: i for i, c in enumerate(_fused_cpu.COLUMNS)}
_FUSED_MAPS: dict[tuple[str, ...], tuple[int, ...] | None] = {}


def fused_columns(columns: Sequence[str]) -> tuple[int, ...] | None:
    """The fused kernel's value for each column (it serves every partial today; a partial added
    without a kernel value takes the eager path), or None when the kernel is off
    (``TRAINMON_FUSED_CPU=0``) or unavailable.  Decided once per engine."""
    key = tuple(columns)
    if key not in _FUSED_MAPS:
        _FUSED_MAPS[key] = tuple(_FUSED_INDEX[c] for c in key) if set(key) <= _FUSED_INDEX.keys() else None
    return _FUSED_MAPS[key] if _FUSED_MAPS[key] is not None and _fused_cpu.enabled() else None


def write_cpu_rows(
    tensors: Sequence[torch.Tensor], columns: Sequence[str], eps: float, host: HostRows, fused: tuple[int, ...] | None
) -> range | list[int | Skipped]:
    """Partials of CPU ``tensors`` written into ``host`` (the engine's step buffer); returns their
    row indices, with a ``Skipped`` for a tensor no reduction could read (the others are
    recorded).  ``fused``: ``fused_columns(columns)``.  The hot path of every hook on a CPU
    model, hence no per-row tensors and few Python frames."""
    with host.lock:
        start = host.reserve(len(tensors))
        if fused is not None and _FUSED_DTYPES.issuperset(map(_DTYPE, tensors)):  # a C loop, no frame
            try:
                _fused_cpu.fill_rows(tensors, host.tensor, start, fused, eps)
                return range(start, start + len(tensors))
            except Exception:
                pass  # a tensor without strided storage among them (sparse, ...): one by one below
        return _rows_one_by_one(tensors, columns, eps, host, fused, start)


def _rows_one_by_one(
    tensors: Sequence[torch.Tensor],
    columns: Sequence[str],
    eps: float,
    host: HostRows,
    fused: tuple[int, ...] | None,
    start: int,
) -> range | list[int | Skipped]:
    """``write_cpu_rows`` a tensor at a time: a tensor that fails is skipped, never its batch."""
    skipped: dict[int, Skipped] = {}
    with torch.no_grad():
        for k, t in enumerate(tensors):
            try:
                if fused is not None and t.dtype in _FUSED_DTYPES and t.layout is STRIDED:
                    _fused_cpu.fill_rows([t], host.tensor, start + k, fused, eps)
                else:
                    host.array[start + k] = _cpu_values(t, columns, eps)
            except Exception as exc:
                skipped[k] = Skipped(reason_of(exc))
    rows = range(start, start + len(tensors))
    return [skipped.get(k, r) for k, r in enumerate(rows)] if skipped else rows


def update_norms(snapshots: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``[n, 2]`` float64 norms of each snapshot and of its difference from the param it was
    taken of (the update ratio's), one read of each tensor in one C call; None where the fused
    kernel is off or cannot read the pairs (the caller then takes torch's ops)."""
    if not _fused_cpu.enabled():
        return None
    try:
        return _fused_cpu.pair_sumsq(snapshots, params).sqrt_()
    except ValueError:
        return None  # not contiguous CPU fp32/bf16/fp16 pairs


def _fused_rows(group: list[torch.Tensor], fused: tuple[int, ...], eps: float) -> list[torch.Tensor]:
    """The fused kernel (on unless TRAINMON_FUSED_CPU=0): every column in one read per tensor."""
    mat = torch.empty((len(group), len(fused)), dtype=torch.float64)
    _fused_cpu.partials_into(group, mat, 0, fused, eps)
    return list(mat.unbind(0))


def _extremes(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Cache-resident tensors: amin + amax beat one aminmax on CPU (measured, torch 2.13); past
    # ~1M elements the single pass over memory wins.
    if t.numel() > _ONE_PASS_EXTREMES or t.device.type != "cpu":
        return torch.aminmax(t)
    return t.amin(), t.amax()


def _cpu_row(t: torch.Tensor, columns: Sequence[str], eps: float) -> torch.Tensor:
    return torch.tensor(_cpu_values(t, columns, eps), dtype=torch.float64)


def _cpu_values(t: torch.Tensor, columns: Sequence[str], eps: float) -> list[float]:
    """One CPU tensor's partials, every reduction back to back while the tensor is in cache:
    measured 2x faster than one reduction over all tensors, then the next (40 x 1 MiB)."""
    if t.layout is not STRIDED:
        return _sparse_values(t, columns, eps)
    if t.is_complex():
        t = t.abs()  # the modulus, as ``collectors.base.capture_views`` records complex tensors
    if t.dtype in _UPCAST:
        return _chunked_partials(t, columns, eps).tolist()
    t = _as_float(t)
    if t.numel() == 0:
        return [0.0 if c == "count" else _IDENTITY[c] for c in columns]
    part: dict[str, torch.Tensor | float] = {"count": float(t.numel())}
    if "sum" in columns:
        part["sum"] = t.sum()
    if "sumsq" in columns:
        part["sumsq"] = _blocked_sumsq(t) if t.numel() > _BIG else torch.mul(t, t).sum()
    if "min" in columns or "max" in columns:
        part["min"], part["max"] = _extremes(t)
    if "zeros" in columns:
        part["zeros"] = (t.abs() < eps).sum()
    if "m2" in columns:
        part["m2"] = torch.var(t, correction=0) * t.numel()
    if "nans" in columns or "infs" in columns:
        finite = bool(torch.isfinite(cast(torch.Tensor, part["sumsq"])))  # a host read is free on the CPU
        part["nans"] = torch.isnan(t).sum() if not finite else 0.0
        part["infs"] = torch.isinf(t).sum() if not finite else 0.0
    # On the CPU the values are already computed (no stream to wait for): reading them as Python
    # floats costs less than stacking and converting 0-d tensors.
    values = [float(part[c]) for c in columns]
    if (
        not math.isfinite(sum(v for c, v in zip(columns, values) if c in _ACCUMULATED))
        and t.dtype != torch.float64
        and bool(torch.isfinite(t).all())
    ):
        return _chunked_partials(t, columns, eps, torch.float64).tolist()  # overflow: see the docstring
    return values


def _sparse_values(t: torch.Tensor, columns: Sequence[str], eps: float) -> list[float]:
    """A sparse tensor's partials: its stored values' merged with its implicit zeros'."""
    values = explicit_values(t)
    row = np.array([_cpu_values(values, columns, eps)])
    return with_implicit_zeros(row, columns, np.array([t.numel() - values.numel()]), eps)[0].tolist()


def _as_float(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        return t
    # Integer/bool tensors (token ids, masks): rare and small, a float copy is fine.
    return t.to(torch.float64 if t.dtype == torch.int64 else torch.float32)


def _blocked_sumsq(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    whole = flat.numel() // _BLOCK * _BLOCK
    blocks = torch.linalg.vector_norm(flat[:whole].view(-1, _BLOCK), dim=1).double().square().sum()
    if whole < flat.numel():
        blocks = blocks + torch.linalg.vector_norm(flat[whole:]).double().square()
    return blocks


_ACCUMULATED = frozenset({"sum", "sumsq", "m2"})  # columns that can overflow on finite input
_IDENTITY = {name: p.identity for name, p in PARTIAL.items()}


def _chunked_partials(
    t: torch.Tensor, columns: Sequence[str], eps: float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Partials of a CPU tensor upcast chunk by chunk into one reused ``dtype`` buffer (fp32 for
    low precision; fp64 to recompute a row whose fp32 accumulation overflowed)."""
    flat = t.reshape(-1)
    n = flat.numel()
    if n == 0:
        return _cpu_row(flat.to(dtype), columns, eps)
    buf = torch.empty(min(n, _CHUNK), dtype=dtype)
    row = None
    for start in range(0, n, _CHUNK):
        part = buf[: min(_CHUNK, n - start)]
        part.copy_(flat[start : start + part.numel()])
        chunk_row = _cpu_row(part, columns, eps)
        row = chunk_row if row is None else _merge_rows(row, chunk_row, columns)
    return row  # type: ignore[return-value]


def _merge_rows(a: torch.Tensor, b: torch.Tensor, columns: Sequence[str]) -> torch.Tensor:
    """Exact merge of two partial rows of disjoint pieces (``stats.table.combine``)."""
    return torch.from_numpy(combine(torch.stack([a, b]).double().numpy()[:, None, :], columns)[0])
