"""The statistics trainmon can record, as data.

Every statistic is derived from a handful of *mergeable partials* computed once per tensor
on its own device.  Partials of the shards of one tensor (or of one tensor on several ranks)
combine exactly, so a sharded parameter's norm is the norm of the full tensor.  Adding a
statistic is one row in ``STATS``.  This module imports no torch: the config loader uses it.

Partials (columns of the engine's per-step partials matrix):

======== ========================================== =================
partial  meaning                                    combine
======== ========================================== =================
count    number of elements                         sum
sum      sum of elements (fp32+ accumulation)       sum
sumsq    sum of squares                             sum
min      smallest element                           min
max      largest element                            max
nans     number of NaN elements                     sum
infs     number of +-Inf elements                   sum
zeros    number of elements with abs(x) < eps       sum
m2       sum of squared deviations from the mean    Chan et al. merge
======== ========================================== =================
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping

__all__ = ["PARTIALS", "Stat", "STATS", "STAT_NAMES", "DEFAULT_OPS", "partials_for", "derive",
           "merge_partials"]

PARTIALS: tuple[str, ...] = ("count", "sum", "sumsq", "min", "max", "nans", "infs", "zeros", "m2")
_SUMMED = ("count", "sum", "sumsq", "nans", "infs", "zeros")


@dataclass(frozen=True)
class Stat:
    name: str
    needs: tuple[str, ...]
    derive: Callable[[Mapping[str, float]], float | int]
    doc: str


def _mean(p: Mapping[str, float]) -> float:
    return p["sum"] / p["count"] if p["count"] else math.nan


def _std(p: Mapping[str, float]) -> float:
    # Unbiased, like torch.std; m2 is kept instead of sum-of-squares because
    # E[x^2]-E[x]^2 loses ~1e-4 relative precision on LayerNorm-like tensors in fp32.
    n = p["count"]
    if n < 2 or not math.isfinite(p["m2"]):
        return math.nan
    return math.sqrt(max(p["m2"], 0.0) / (n - 1))


def _extreme(key: str) -> Callable[[Mapping[str, float]], float]:
    return lambda p: p[key] if p["count"] else math.nan


STATS: dict[str, Stat] = {s.name: s for s in (
    Stat("norm", ("sumsq",), lambda p: math.sqrt(p["sumsq"]) if p["sumsq"] >= 0 else math.nan,
         "L2 norm"),
    Stat("mean", ("count", "sum"), _mean, "arithmetic mean"),
    Stat("min", ("count", "min"), _extreme("min"), "smallest element"),
    Stat("max", ("count", "max"), _extreme("max"), "largest element"),
    Stat("zeros", ("count", "zeros"), lambda p: p["zeros"] / p["count"] if p["count"] else math.nan,
         "fraction of elements with abs(x) < eps"),
    Stat("nans", ("nans",), lambda p: int(p["nans"]), "number of NaN elements"),
    Stat("infs", ("infs",), lambda p: int(p["infs"]), "number of +-Inf elements"),
    Stat("std", ("count", "sum", "m2"), _std, "standard deviation (unbiased)"),
)}

STAT_NAMES: tuple[str, ...] = tuple(STATS)
DEFAULT_OPS: tuple[str, ...] = ("norm", "mean", "min", "max")


def partials_for(ops: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The partials needed to derive ``ops``, in ``PARTIALS`` order."""
    needed = {p for op in ops for p in STATS[op].needs}
    if "m2" in needed:
        needed |= {"count", "sum"}
    return tuple(p for p in PARTIALS if p in needed)


def derive(ops: tuple[str, ...] | list[str], partials: Mapping[str, float]) -> dict[str, float | int]:
    """Statistics named by ``ops`` from one tensor's partials."""
    return {op: STATS[op].derive(partials) for op in ops}


def merge_partials(parts: list[Mapping[str, float]]) -> dict[str, float]:
    """Exact combination of the partials of disjoint pieces of one tensor."""
    keys = set().union(*parts) if parts else set()
    out: dict[str, float] = {k: 0.0 for k in keys & set(_SUMMED)}
    if "min" in keys:
        out["min"] = math.inf
    if "max" in keys:
        out["max"] = -math.inf
    m2, n_acc, mean_acc = 0.0, 0.0, 0.0
    for p in parts:
        for k in keys & set(_SUMMED):
            out[k] += p[k]
        if "min" in keys:
            out["min"] = min(out["min"], p["min"]) if not math.isnan(p["min"]) else math.nan
        if "max" in keys:
            out["max"] = max(out["max"], p["max"]) if not math.isnan(p["max"]) else math.nan
        if "m2" in keys and p["count"]:
            n_b, mean_b = p["count"], p["sum"] / p["count"]
            delta = mean_b - mean_acc
            tot = n_acc + n_b
            m2 += p["m2"] + delta * delta * n_acc * n_b / tot
            mean_acc += delta * n_b / tot
            n_acc = tot
    if "m2" in keys:
        out["m2"] = m2
    return out
