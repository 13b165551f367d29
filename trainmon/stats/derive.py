"""``stats.table.derive`` for a whole block of rows at once, with numpy.

The engine derives each capture's statistics as one matrix operation instead of one Python call
per row and statistic: at a few hundred rows per step that Python work ran on the writer thread
while the training thread waited for the GIL.  Same values as the scalar ``derive`` (tested
against it, edge cases included); counts come back as ints.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

__all__ = ["derive_block"]

_Cols = dict  # partial name -> float64 column


def _safe_div(a: np.ndarray, n: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(n != 0, a / np.where(n != 0, n, 1.0), np.nan)


def _norm(p: _Cols) -> np.ndarray:
    s = p["sumsq"]
    with np.errstate(invalid="ignore"):
        return np.sqrt(np.where(s >= 0, s, np.nan))


def _extreme(key: str) -> Callable[[_Cols], np.ndarray]:
    return lambda p: np.where(p["count"] != 0, p[key], np.nan)


def _std(p: _Cols) -> np.ndarray:
    n, m2 = p["count"], p["m2"]
    ok = (n >= 2) & np.isfinite(m2)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(ok, np.sqrt(np.maximum(m2, 0.0) / np.where(ok, n - 1, 1.0)), np.nan)


_VECTOR: dict[str, Callable[[_Cols], np.ndarray]] = {
    "norm": _norm,
    "mean": lambda p: _safe_div(p["sum"], p["count"]),
    "min": _extreme("min"),
    "max": _extreme("max"),
    "zeros": lambda p: _safe_div(p["zeros"], p["count"]),
    "nans": lambda p: p["nans"],
    "infs": lambda p: p["infs"],
    "std": _std,
}
_COUNTS = frozenset({"nans", "infs"})


def derive_block(ops: Sequence[str], columns: Sequence[str], partials: list[list[float]]) -> list[list]:
    """Rows of statistics ``ops`` (Python floats, ints for counts) from rows of ``partials``."""
    if not partials:
        return []
    mat = np.asarray(partials, dtype=np.float64)
    p = {c: mat[:, j] for j, c in enumerate(columns)}
    out = np.empty((len(partials), len(ops)), dtype=np.float64)
    for j, op in enumerate(ops):
        out[:, j] = _VECTOR[op](p)
    counts = [j for j, op in enumerate(ops) if op in _COUNTS]
    if not counts:
        return out.tolist()
    rows = out.tolist()
    for row in rows:
        for j in counts:
            row[j] = int(row[j])
    return rows
