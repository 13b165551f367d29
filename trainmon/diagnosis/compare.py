"""Comparing two runs row by row: where do they first differ?

Rows are aligned by (family, vpp_stage, name, step, rank, micro_step, occurrence); names are
matched through ``names.match_names`` so wrapper prefixes do not break the alignment.  Steps,
ranks or tensors present in one run only are counted and skipped.

For each aligned stat, ``rel_diff = |target - base| / max(|base|, |target|, rms)`` where ``rms``
is the row's ``norm / sqrt(numel)`` (for every op but ``norm`` itself, when the row has a norm
and a shape): means and extremes near zero are judged against the tensor's magnitude, not
against themselves.  Two NaNs, or two infinities of one sign, are equal; a non-finite value
against anything else differs by ``inf``.  A stat diverges when ``rel_diff > rtol`` and
``|target - base| > atol``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import pandas as pd

from trainmon.diagnosis.flow import FLOW_KEYS
from trainmon.diagnosis.names import match_names
from trainmon.diagnosis.reader import RunTable
from trainmon.diagnosis.rules import json_number

__all__ = ["Difference", "Comparison", "compare_runs", "rel_diff"]

_ALIGN = ["vpp_stage", "name", "step", "rank", "micro_step", "occurrence"]


@dataclass(frozen=True)
class Difference:
    step: int
    phase: str
    kind: str
    name: str
    rank: int
    op: str
    base: float
    target: float
    rel_diff: float
    micro_step: int | None = None
    vpp_stage: int = 0
    target_name: str = ""

    def to_json(self) -> dict[str, object]:
        return {"step": self.step, "phase": self.phase, "kind": self.kind, "name": self.name,
                "rank": self.rank, "op": self.op, "base": json_number(self.base),
                "target": json_number(self.target), "rel_diff": json_number(self.rel_diff),
                "micro_step": self.micro_step, "vpp_stage": self.vpp_stage,
                "target_name": self.target_name or self.name}


@dataclass
class Comparison:
    rtol: float
    atol: float
    first_divergence: Difference | None = None
    largest_by_family: dict[str, list[Difference]] = field(default_factory=dict)
    aligned_rows: int = 0
    diverged_rows: int = 0
    only_in_base: int = 0
    only_in_target: int = 0
    renamed: int = 0
    families: tuple[str, ...] = ()

    def to_json(self) -> dict[str, object]:
        return {
            "rtol": self.rtol, "atol": self.atol,
            "first_divergence": self.first_divergence.to_json() if self.first_divergence else None,
            "largest_by_family": {f: [d.to_json() for d in ds] for f, ds in self.largest_by_family.items()},
            "aligned_rows": self.aligned_rows, "diverged_rows": self.diverged_rows,
            "only_in_base": self.only_in_base, "only_in_target": self.only_in_target,
            "renamed": self.renamed, "families": list(self.families),
        }


def rel_diff(base: np.ndarray, target: np.ndarray, scale: np.ndarray | float = 0.0) -> np.ndarray:
    """Elementwise relative difference as the module docstring defines it."""
    b, t = np.asarray(base, dtype=float), np.asarray(target, dtype=float)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        den = np.maximum(np.maximum(np.abs(b), np.abs(t)), np.nan_to_num(np.asarray(scale, dtype=float)))
        out = np.abs(t - b) / den
        out = np.where(den == 0, 0.0, out)
    finite = np.isfinite(b) & np.isfinite(t)
    same_special = (np.isnan(b) & np.isnan(t)) | (np.isinf(b) & (b == t))
    return np.where(finite, out, np.where(same_special, 0.0, np.inf))


def _rename_target(base: pd.DataFrame, target: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    mapping = match_names(base["name"].unique(), target["name"].unique())
    renamed = sum(1 for t, b in mapping.items() if t != b)
    target = target[target["name"].isin(mapping.keys())].copy()
    target["target_name"] = target["name"]
    target["name"] = target["name"].map(mapping)
    return target, renamed


def _family_diffs(family: str, base: pd.DataFrame, target: pd.DataFrame, ops: Sequence[str],
                  rtol: float, atol: float) -> tuple[pd.DataFrame, int, int, int]:
    target, renamed = _rename_target(base, target)
    keep_b = [*_ALIGN, *(c for c in FLOW_KEYS if c not in _ALIGN), "phase", "numel", *ops]
    merged = base[keep_b].merge(target[[*_ALIGN, "target_name", *ops]], on=_ALIGN, how="inner",
                                suffixes=("", "@t"))
    only_b, only_t = len(base) - len(merged), len(target) - len(merged)
    if merged.empty:
        return merged, only_b, only_t, renamed
    rms = merged["norm"] / np.sqrt(merged["numel"]) if "norm" in ops else pd.Series(0.0, index=merged.index)
    rms = rms.replace([np.inf, -np.inf], np.nan).fillna(0.0).to_numpy()
    b = np.column_stack([merged[op].to_numpy(float) for op in ops])
    t = np.column_stack([merged[op + "@t"].to_numpy(float) for op in ops])
    rel = np.column_stack([rel_diff(b[:, i], t[:, i], 0.0 if op == "norm" else rms)
                           for i, op in enumerate(ops)])
    with np.errstate(invalid="ignore"):
        over = (rel > rtol) & ~(np.abs(t - b) <= atol)
        # A row reports its worst op beyond tolerance, else its worst op (rel/(1+rel) keeps inf
        # comparable and below the +2 of an op beyond tolerance).
        score = np.where(over, 2.0, 0.0) + np.where(np.isinf(rel), 1.0, rel / (1.0 + rel))
    pick = np.argmax(score, axis=1)
    rows = np.arange(len(merged))
    merged["op"] = np.asarray(ops)[pick]
    merged["base"] = b[rows, pick]
    merged["target"] = t[rows, pick]
    merged["rel_diff"] = rel[rows, pick]
    merged["diverged"] = over.any(axis=1)
    merged["kind"] = family
    return merged, only_b, only_t, renamed


def _difference(r) -> Difference:
    return Difference(step=int(r.step), phase=r.phase, kind=r.kind, name=r.name, rank=int(r.rank),
                      op=str(r.op), base=float(r.base), target=float(r.target),
                      rel_diff=float(r.rel_diff),
                      micro_step=None if int(r.micro_step) < 0 else int(r.micro_step),
                      vpp_stage=int(r.vpp_stage), target_name=str(r.target_name))


def compare_runs(base: RunTable, target: RunTable, *, rtol: float = 1e-3, atol: float = 0.0,
                 ops: Sequence[str] | None = None, top: int = 5) -> Comparison:
    """Align two runs and find the first divergence in training-flow order."""
    result = Comparison(rtol=rtol, atol=atol)
    diverged, families = [], []
    for family, base_stats in base.family_stats.items():
        target_stats = target.family_stats.get(family)
        if target_stats is None:
            result.only_in_base += len(base.family(family))
            continue
        common = [o for o in base_stats if o in target_stats and (ops is None or o in ops)]
        if not common:
            continue
        merged, only_b, only_t, renamed = _family_diffs(family, base.family(family),
                                                        target.family(family), common, rtol, atol)
        families.append(family)
        result.only_in_base += only_b
        result.only_in_target += only_t
        result.renamed += renamed
        result.aligned_rows += len(merged)
        if merged.empty:
            continue
        largest = merged.sort_values("rel_diff", ascending=False, kind="mergesort").head(top)
        result.largest_by_family[family] = [_difference(r) for r in largest.itertuples(index=False)
                                            if r.rel_diff > 0]
        hit = merged[merged["diverged"]]
        result.diverged_rows += len(hit)
        if not hit.empty:
            diverged.append(hit.sort_values(list(FLOW_KEYS), kind="mergesort").head(1))
    for family in target.family_stats:
        if family not in base.family_stats:
            result.only_in_target += len(target.family(family))
    result.families = tuple(families)
    if diverged:
        first = pd.concat(diverged, ignore_index=True).sort_values(list(FLOW_KEYS), kind="mergesort")
        result.first_divergence = _difference(next(first.itertuples(index=False)))
    return result
