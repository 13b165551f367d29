"""The statistics trainmon can record, as data: the one statistics table.

Every statistic is derived from a handful of *mergeable partials* computed once per tensor on
its own device.  Partials of the shards of one tensor (or of pieces of one tensor: CPU chunks,
ranks) combine exactly, so a sharded parameter's norm is the norm of the full tensor.

Two tables, and everything else reads them:

* ``PARTIAL``: each partial's merge (``sum``, ``min``, ``max`` or Chan et al.'s ``m2``) and its
  identity (the value of an empty piece).  ``combine`` is the one implementation of those merges
  (numpy, float64, on the host): the engine's shard merge, the CPU chunk merge and
  ``merge_partials`` all call it.
* ``STATS``: each statistic's needed partials and its derive, written once over numpy columns;
  the block derive (``stats.derive``) and the scalar ``derive`` both evaluate that function.

Adding a statistic is therefore one ``Stat`` row (and a partial, if it needs a new one: one
``Partial`` row plus its reduction in ``stats.partials``).  This module imports no torch: the
config loader uses it, and no numpy until a statistic is derived or merged (the config and
output layers stay light).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "PARTIALS",
    "PARTIAL",
    "Partial",
    "Stat",
    "STATS",
    "STAT_NAMES",
    "DEFAULT_OPS",
    "partials_for",
    "derive",
    "derive_columns",
    "combine",
    "merge_partials",
    "unscale",
]

Columns = Mapping[str, "np.ndarray"]  # partial name -> float64 column (one entry per tensor)


def _np() -> Any:
    import numpy

    return numpy


@dataclass(frozen=True)
class Partial:
    name: str
    merge: str  # "sum" | "min" | "max" | "m2" (Chan et al., needs count and sum)
    identity: float  # the partial of an empty piece
    doc: str
    power: int = 0  # the partial of (x / s) is the partial of x / s**power (s > 0); 0: unchanged


PARTIAL: dict[str, Partial] = {
    p.name: p
    for p in (
        Partial("count", "sum", 0.0, "number of elements"),
        Partial("sum", "sum", 0.0, "sum of elements (fp32+ accumulation, fp64 combine)", 1),
        Partial("sumsq", "sum", 0.0, "sum of squares", 2),
        Partial("min", "min", math.inf, "smallest element (NaN if any element is NaN)", 1),
        Partial("max", "max", -math.inf, "largest element (NaN if any element is NaN)", 1),
        Partial("nans", "sum", 0.0, "number of NaN elements"),
        Partial("infs", "sum", 0.0, "number of +-Inf elements"),
        Partial("zeros", "sum", 0.0, "number of elements with abs(x) < eps"),
        Partial("m2", "m2", 0.0, "sum of squared deviations from the mean", 2),
    )
}
PARTIALS: tuple[str, ...] = tuple(PARTIAL)


@dataclass(frozen=True)
class Stat:
    """One statistic: the partials it needs and how it follows from them (numpy columns in,
    one float64 column out).  ``integer``: recorded as an int (counts)."""

    name: str
    needs: tuple[str, ...]
    vector: Callable[[Columns], np.ndarray]
    doc: str
    integer: bool = False

    def derive(self, partials: Mapping[str, float]) -> float | int:
        """The statistic of one tensor (the same function as the block derive, on one row)."""
        np = _np()
        value = float(self.vector({k: np.array([partials[k]], dtype=np.float64) for k in self.needs})[0])
        return int(value) if self.integer else value


def _ratio(a: np.ndarray, n: np.ndarray) -> np.ndarray:
    np = _np()
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(n != 0, a / np.where(n != 0, n, 1.0), np.nan)


def _norm(p: Columns) -> np.ndarray:
    np = _np()
    with np.errstate(invalid="ignore"):
        return np.sqrt(np.where(p["sumsq"] >= 0, p["sumsq"], np.nan))


def _extreme(key: str) -> Callable[[Columns], np.ndarray]:
    return lambda p: _np().where(p["count"] != 0, p[key], _np().nan)


def _std(p: Columns) -> np.ndarray:
    np = _np()
    # Unbiased, like torch.std; m2 is kept instead of sum-of-squares because
    # E[x^2]-E[x]^2 loses ~1e-4 relative precision on LayerNorm-like tensors in fp32.
    n, m2 = p["count"], p["m2"]
    ok = (n >= 2) & np.isfinite(m2)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(ok, np.sqrt(np.maximum(m2, 0.0) / np.where(ok, n - 1, 1.0)), np.nan)


STATS: dict[str, Stat] = {
    s.name: s
    for s in (
        Stat("norm", ("sumsq",), _norm, "L2 norm"),
        Stat("mean", ("count", "sum"), lambda p: _ratio(p["sum"], p["count"]), "arithmetic mean"),
        Stat("min", ("count", "min"), _extreme("min"), "smallest element"),
        Stat("max", ("count", "max"), _extreme("max"), "largest element"),
        Stat(
            "zeros",
            ("count", "zeros"),
            lambda p: _ratio(p["zeros"], p["count"]),
            "fraction of elements with abs(x) < eps",
        ),
        Stat("nans", ("nans",), lambda p: p["nans"], "number of NaN elements", integer=True),
        Stat("infs", ("infs",), lambda p: p["infs"], "number of +-Inf elements", integer=True),
        Stat("std", ("count", "sum", "m2"), _std, "standard deviation (unbiased)"),
    )
}

STAT_NAMES: tuple[str, ...] = tuple(STATS)
DEFAULT_OPS: tuple[str, ...] = ("norm", "mean", "min", "max")


def partials_for(ops: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The partials needed to derive ``ops``, in ``PARTIALS`` order (with what their merges need)."""
    needed = {p for op in ops for p in STATS[op].needs}
    if any(PARTIAL[p].merge == "m2" for p in needed):
        needed |= {"count", "sum"}
    return tuple(p for p in PARTIALS if p in needed)


def derive(ops: tuple[str, ...] | list[str], partials: Mapping[str, float]) -> dict[str, float | int]:
    """Statistics named by ``ops`` from one tensor's partials."""
    return {op: STATS[op].derive(partials) for op in ops}


def derive_columns(ops: Sequence[str], columns: Sequence[str], mat: np.ndarray) -> np.ndarray:
    """``[rows, len(ops)]`` float64 statistics from a ``[rows, len(columns)]`` partials matrix."""
    np = _np()
    p = {c: mat[:, j] for j, c in enumerate(columns)}
    out = np.empty((mat.shape[0], len(ops)), dtype=np.float64)
    for j, op in enumerate(ops):
        out[:, j] = STATS[op].vector(p)
    return out


def combine(mat: np.ndarray, columns: Sequence[str]) -> np.ndarray:
    """Exact merge of ``[pieces, rows, columns]`` float64 partials over the pieces: the one
    implementation of every partial's merge.  min/max propagate NaN (like ``torch.amin``)."""
    np = _np()
    mat = np.asarray(mat, dtype=np.float64)
    out = np.empty(mat.shape[1:], dtype=np.float64)
    col = {c: j for j, c in enumerate(columns)}
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        for c, j in col.items():
            kind = PARTIAL[c].merge
            if kind == "sum":
                out[:, j] = mat[:, :, j].sum(0)
            elif kind in ("min", "max"):
                out[:, j] = (np.min if kind == "min" else np.max)(mat[:, :, j], axis=0)
            else:
                out[:, j] = _chan_m2(mat[:, :, col["count"]], mat[:, :, col["sum"]], mat[:, :, j])
    return out


def _chan_m2(n: np.ndarray, s: np.ndarray, m2: np.ndarray) -> np.ndarray:
    """Chan et al.'s parallel m2: sum of the pieces' m2 plus n_k (mean_k - mean)^2; empty
    pieces contribute nothing."""
    np = _np()
    mean = s.sum(0) / np.where(n.sum(0) > 0, n.sum(0), 1.0)
    live = n > 0
    piece_mean = np.where(live, s / np.where(live, n, 1.0), 0.0)
    spread = np.where(live, n * (piece_mean - mean) ** 2, 0.0)
    return np.where(live, m2, 0.0).sum(0) + spread.sum(0)


def merge_partials(parts: list[Mapping[str, float]]) -> dict[str, float]:
    """Exact combination of the partials of disjoint pieces of one tensor (see ``combine``)."""
    np = _np()
    if not parts:
        return {}
    keys = [k for k in PARTIALS if k in set().union(*parts)]
    merged = combine(np.array([[[p[k] for k in keys]] for p in parts], dtype=np.float64), keys)
    return dict(zip(keys, merged[0].tolist()))


def unscale(rows: list[list[float]], columns: Sequence[str], scale: float) -> list[list[float]]:
    """Partials of ``x / scale`` from partials of ``x`` (``Partial.power``): how an fp16 loss
    scale is taken out without dividing every grad into a new tensor."""
    factors = [scale ** -PARTIAL[c].power for c in columns]
    return [[v * f for v, f in zip(row, factors)] for row in rows]
