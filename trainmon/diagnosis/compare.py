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

Stages (loss alignment): the families fall into the stages of one training step, checked in
this order after the two stages that have no step (``model_meta.json``, see ``model_meta``):

================ =================================================================
stage            what is compared
================ =================================================================
metadata         module names and types, param names, shapes, dtypes, requires_grad
initial_params   each param's norm/mean/min/max when monitoring began
hyperparams      family ``hyperparams`` (lr, betas, eps, weight_decay, ..., per group)
sample_data      family ``model_input`` (the batch the model was fed)
forward          ``actv``
loss             ``loss`` (``monitor.record_loss``)
backward         ``actv_grad``, ``grad_unreduced``, ``comm``, ``grad_reduced``, ``grad_probe``, ...
optimizer        ``param_origin``, ``exp_avg``, ``exp_avg_sq``, ``param_updated``, ``update_ratio``
================ =================================================================

Each (stage, rank) is YES (compared, equal within tolerance), NO (differs) or not recorded in
both runs.  ``first_divergence`` is the first difference in this order: a structural difference
or one in the initial params before any step, else the first in training-flow order (within a
step hyperparams come first, then per micro-batch the input, forward and loss).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from trainmon.analysis.flow import FLOW_KEYS, phase_of
from trainmon.analysis.rules import json_number
from trainmon.diagnosis.model_meta import StageDifference, diff_initial, diff_structure, meta_ranks, read_model_meta
from trainmon.diagnosis.names import match_names
from trainmon.diagnosis.reader import GROUP_COLUMN
from trainmon.families import NOT_SCALAR, Family, Phase

__all__ = [
    "Difference",
    "Comparison",
    "StageResult",
    "STAGES",
    "stage_of",
    "rel_diff",
    "FamilyPlan",
    "plan_families",
    "SliceResult",
    "finish_comparison",
    "align",
    "judge",
    "family_part",
    "first_per_rank",
    "largest_rows",
]

STAGES: tuple[str, ...] = (
    "metadata",
    "initial_params",
    "hyperparams",
    "sample_data",
    "forward",
    "loss",
    "backward",
    "optimizer",
)
_STAGE_OF_FAMILY = {
    str(Family.HYPERPARAMS): "hyperparams",
    str(Family.MODEL_INPUT): "sample_data",
    str(Family.LOSS): "loss",
}
_STAGE_OF_PHASE = {
    str(Phase.SETUP): "hyperparams",
    str(Phase.FORWARD): "forward",
    str(Phase.OPTIMIZER): "optimizer",
    str(Phase.OTHER): "other",
}


def stage_of(family: str) -> str:
    """The loss-alignment stage of a family (``backward`` for every phase from backward to the
    reduced grad; ``other`` for families trainmon does not know)."""
    return _STAGE_OF_FAMILY.get(family) or _STAGE_OF_PHASE.get(phase_of(family), "backward")


ALIGN_KEYS = ["vpp_stage", "name", "step", "rank", "micro_step", "occurrence"]


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
    group: int | None = None  # the optimizer param group of a hyperparams row (-1: optimizer-wide)

    @property
    def stage(self) -> str:
        return stage_of(self.kind)

    def describe(self) -> str:
        parts = [f"step {self.step}" + ("" if self.micro_step is None else f" micro_step {self.micro_step}")]
        if self.group is not None:
            parts.append(f"group {self.group}")
        parts.append(f"{self.kind} {self.name}: {self.op} base {self.base:.6g} target {self.target:.6g}")
        return ", ".join(parts)

    def to_json(self) -> dict[str, object]:
        doc = {
            "step": self.step,
            "phase": self.phase,
            "kind": self.kind,
            "name": self.name,
            "rank": self.rank,
            "op": self.op,
            "base": json_number(self.base),
            "target": json_number(self.target),
            "rel_diff": json_number(self.rel_diff),
            "micro_step": self.micro_step,
            "vpp_stage": self.vpp_stage,
            "target_name": self.target_name or self.name,
            "stage": self.stage,
        }
        if self.group is not None:
            doc["group"] = self.group
        return doc


@dataclass(frozen=True)
class StageResult:
    """One (stage, rank): ``match`` True (YES), False (NO), None (not recorded in both runs)."""

    stage: str
    rank: int
    match: bool | None
    first: Difference | StageDifference | None = None  # when match is False
    note: str = ""  # why a stage could not be compared

    @property
    def label(self) -> str:
        return {True: "YES", False: "NO", None: "-"}[self.match]

    def to_json(self) -> dict[str, object]:
        return {
            "stage": self.stage,
            "rank": self.rank,
            "match": self.match,
            "first": self.first.to_json() if self.first is not None else None,
            "note": self.note,
        }


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
    stages: list[StageResult] = field(default_factory=list)
    static_divergence: Difference | StageDifference | None = None  # metadata / initial_params

    @property
    def first_difference(self) -> Difference | StageDifference | None:
        """The first difference in stage order: a static one (no step) before any step's."""
        return self.static_divergence or self.first_divergence

    def to_json(self) -> dict[str, object]:
        return {
            "rtol": self.rtol,
            "atol": self.atol,
            "first_divergence": self.first_difference.to_json() if self.first_difference else None,
            "largest_by_family": {f: [d.to_json() for d in ds] for f, ds in self.largest_by_family.items()},
            "aligned_rows": self.aligned_rows,
            "diverged_rows": self.diverged_rows,
            "only_in_base": self.only_in_base,
            "only_in_target": self.only_in_target,
            "renamed": self.renamed,
            "families": list(self.families),
            "stages": [r.to_json() for r in self.stages],
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


@dataclass(frozen=True)
class FamilyPlan:
    """How one family of the two runs is compared, decided on the whole runs (not on a slice)."""

    ops: tuple[str, ...]
    names: dict[str, str]  # target name -> base name (``names.match_names`` of the families' names)
    grouped: bool  # base rows carry an optimizer param group (``extra:group``)

    @property
    def renamed(self) -> int:
        return sum(1 for t, b in self.names.items() if t != b)


def plan_families(
    base_stats: dict[str, tuple[str, ...]],
    target_stats: dict[str, tuple[str, ...]],
    ops: Sequence[str] | None,
    names_of: Callable[[str], tuple[Iterable[str], Iterable[str]]],
    grouped_of: Callable[[str], bool],
) -> dict[str, FamilyPlan]:
    """The families both runs hold with common stats, in base order; ``names_of(family)`` gives the
    family's names in base and in target, ``grouped_of(family)`` whether base rows have a group."""
    plans = {}
    for family, stats in base_stats.items():
        if family in NOT_SCALAR or family not in target_stats:
            continue
        common = tuple(o for o in stats if o in target_stats[family] and (ops is None or o in ops))
        if common:
            base_names, target_names = names_of(family)
            plans[family] = FamilyPlan(common, match_names(base_names, target_names), grouped_of(family))
    return plans


def align(base: pd.DataFrame, target: pd.DataFrame, names: Mapping, grouped: bool) -> pd.DataFrame:
    """The one alignment rule: one family's rows of both runs paired on ``ALIGN_KEYS``, the
    target's names first mapped onto the base's (``names``: target name -> base name, from
    ``plan_families``; text, or the staged runs' name codes).  ``base``: the alignment keys and
    whatever else the comparison reads (ops, ``numel``, flow keys, the group column when
    ``grouped``); ``target``: the alignment keys and its ops, which come back as ``op@t`` beside
    ``target_name``; ``group``: a hyperparams row's param group (-1: optimizer-wide; -2: the
    family has none).  Keys are unique on each side (``occurrence`` numbers a repeated name), so
    rows pair one to one: what is not returned is on one side only."""
    target = target[target["name"].isin(names.keys())]
    target = target.assign(target_name=target["name"], name=target["name"].map(names))
    merged = base.merge(target, on=ALIGN_KEYS, how="inner", suffixes=("", "@t"))
    merged["group"] = merged.pop(GROUP_COLUMN).fillna(-1).astype(np.int64) if grouped else -2
    return merged


def judge(merged: pd.DataFrame, family: str, ops: Sequence[str], rtol: float, atol: float) -> pd.DataFrame:
    """Every aligned row's verdict, the one place the comparison rule is written: ``merged`` holds
    each op of base (column ``op``) and of target (``op@t``), ``numel`` and the alignment and flow
    keys; added: the row's worst ``op`` with its ``base``, ``target`` and ``rel_diff``, whether it
    ``diverged``, and its ``kind``.  Used for each group the engine aligned."""
    ops = list(ops)
    rms = merged["norm"] / np.sqrt(merged["numel"]) if "norm" in ops else pd.Series(0.0, index=merged.index)
    rms = rms.replace([np.inf, -np.inf], np.nan).fillna(0.0).to_numpy()
    b = np.column_stack([merged[op].to_numpy(float) for op in ops])
    t = np.column_stack([merged[op + "@t"].to_numpy(float) for op in ops])
    rel = np.column_stack([rel_diff(b[:, i], t[:, i], 0.0 if op == "norm" else rms) for i, op in enumerate(ops)])
    with np.errstate(invalid="ignore"):
        over = (rel > rtol) & ~(np.abs(t - b) <= atol)
        # A row reports its worst op beyond tolerance, else its worst op (rel/(1+rel) keeps inf
        # comparable and below the +2 of an op beyond tolerance).
        score = np.where(over, 2.0, 0.0) + np.where(np.isinf(rel), 1.0, rel / (1.0 + rel))
    pick = np.argmax(score, axis=1)
    rows = np.arange(len(merged))
    merged["op"] = np.asarray(ops, dtype=object)[pick]
    merged["base"] = b[rows, pick]
    merged["target"] = t[rows, pick]
    merged["rel_diff"] = rel[rows, pick]
    merged["diverged"] = over.any(axis=1)
    merged["kind"] = family
    return merged


def family_part(family: str, judged: pd.DataFrame, top: int) -> SliceResult:
    """What one family's judged rows (``judge``) add to a comparison: rows aligned per (stage,
    rank), the family's largest differences, each rank's first diverged row."""
    out = SliceResult(aligned_rows=len(judged))
    if judged.empty:
        return out
    for rank, n in judged.groupby("rank").size().items():
        out.aligned[(stage_of(family), int(rank))] = int(n)
    out.largest[family] = [largest_rows([judged], top)]
    hit = judged[judged["diverged"].to_numpy()]
    out.diverged_rows = len(hit)
    if not hit.empty:
        out.firsts.append(first_per_rank([hit]))
    return out


def first_per_rank(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """Each rank's first row in training-flow order, of the rows of ``frames`` together."""
    rows = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
    return _own(rows.sort_values(list(FLOW_KEYS), kind="mergesort").groupby("rank", sort=False).head(1))


def _difference(r) -> Difference:
    return Difference(
        step=int(r.step),
        phase=r.phase,
        kind=r.kind,
        name=r.name,
        rank=int(r.rank),
        op=str(r.op),
        base=float(r.base),
        target=float(r.target),
        rel_diff=float(r.rel_diff),
        micro_step=None if int(r.micro_step) < 0 else int(r.micro_step),
        vpp_stage=int(r.vpp_stage),
        target_name=str(r.target_name),
        group=None if int(r.group) == -2 else int(r.group),
    )


# Largest differences first; equal ones in training-flow order (the order of the aligned rows).
_LARGEST = (["rel_diff", *FLOW_KEYS], [False] + [True] * len(FLOW_KEYS))


def largest_rows(frames: list[pd.DataFrame], top: int) -> pd.DataFrame:
    rows = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
    return _own(rows.sort_values(_LARGEST[0], ascending=_LARGEST[1], kind="mergesort").head(top))


def _own(rows: pd.DataFrame) -> pd.DataFrame:
    """The few ``rows`` as a frame that shares no memory with the frame they were cut from.
    ``DataFrame.copy()`` is not enough: the index and pandas' Arrow-backed string columns of a
    deep copy still point into the source's whole buffers, so the few rows kept per alignment
    group held every group's columns alive (2.5 GB for ``compare`` of two 100.8M-row runs)."""
    return pd.DataFrame({c: rows[c].tolist() for c in rows.columns}, columns=rows.columns)


@dataclass
class SliceResult:
    """What the rows of some tensors contribute to a comparison; slices of disjoint tensors add up."""

    aligned_rows: int = 0
    diverged_rows: int = 0
    only_in_base: int = 0
    only_in_target: int = 0
    aligned: dict[tuple[str, int], int] = field(default_factory=dict)  # (stage, rank) -> rows
    largest: dict[str, list[pd.DataFrame]] = field(default_factory=dict)  # family -> its top rows
    firsts: list[pd.DataFrame] = field(default_factory=list)  # per family and rank: first diverged row

    def add(self, other: SliceResult) -> None:
        self.aligned_rows += other.aligned_rows
        self.diverged_rows += other.diverged_rows
        self.only_in_base += other.only_in_base
        self.only_in_target += other.only_in_target
        for key, n in other.aligned.items():
            self.aligned[key] = self.aligned.get(key, 0) + n
        for family, frames in other.largest.items():
            self.largest.setdefault(family, []).extend(frames)
        self.firsts += other.firsts


def finish_comparison(
    part: SliceResult, plans: dict[str, FamilyPlan], base_path, target_path, *, rtol: float, atol: float, top: int
) -> Comparison:
    """The comparison of the runs whose slices added up to ``part``."""
    result = Comparison(rtol=rtol, atol=atol)
    result.aligned_rows, result.diverged_rows = part.aligned_rows, part.diverged_rows
    result.only_in_base, result.only_in_target = part.only_in_base, part.only_in_target
    result.renamed = sum(plan.renamed for plan in plans.values())
    result.families = tuple(plans)
    for family in (f for f in plans if f in part.largest):
        largest = largest_rows(part.largest[family], top)
        result.largest_by_family[family] = [_difference(r) for r in largest.itertuples(index=False) if r.rel_diff > 0]
    firsts: dict[tuple[str, int], Difference] = {}
    if part.firsts:
        first = pd.concat(part.firsts, ignore_index=True).sort_values(list(FLOW_KEYS), kind="mergesort")
        result.first_divergence = _difference(next(first.itertuples(index=False)))
        for r in first.itertuples(index=False):
            firsts.setdefault((stage_of(r.kind), int(r.rank)), _difference(r))
    result.stages = _static_stages(base_path, target_path, rtol, atol) + _step_stages(part.aligned, firsts)
    result.static_divergence = next(
        (r.first for r in result.stages if r.stage in STAGES[:2] and r.match is False), None
    )
    return result


def _step_stages(aligned: dict[tuple[str, int], int], firsts: dict[tuple[str, int], Difference]) -> list[StageResult]:
    ranks = sorted({rank for _, rank in aligned})
    out = []
    for stage in (*STAGES[2:], "other"):
        for rank in ranks:
            if (stage, rank) in firsts:
                out.append(StageResult(stage, rank, False, firsts[(stage, rank)]))
            elif aligned.get((stage, rank)):
                out.append(StageResult(stage, rank, True))
            elif stage != "other":
                out.append(StageResult(stage, rank, None, note="not recorded in both runs"))
    return out


def _static_stages(base_path, target_path, rtol: float, atol: float) -> list[StageResult]:
    b_paths, t_paths = meta_ranks(base_path), meta_ranks(target_path)
    out: list[StageResult] = []
    for rank in sorted(set(b_paths) | set(t_paths)):
        b, b_why = read_model_meta(b_paths[rank]) if rank in b_paths else (None, "")
        t, t_why = read_model_meta(t_paths[rank]) if rank in t_paths else (None, "")
        if b is None or t is None:
            note = (
                b_why
                or t_why
                or (
                    "model_meta.json in neither run"
                    if b is None and t is None
                    else f"model_meta.json only in {'target' if b is None else 'base'}"
                )
            )
            out += [StageResult(stage, rank, None, note=note) for stage in STAGES[:2]]
            continue
        structure = diff_structure(b, t, rank)
        out.append(StageResult("metadata", rank, structure is None, structure))
        initial = diff_initial(b, t, rank, rtol, atol, rel_diff)
        out.append(StageResult("initial_params", rank, initial is None, initial))
    return sorted(out, key=lambda r: STAGES.index(r.stage))
