"""Cross-rank consistency of a data-parallel run: what must agree, per step, does it?

Checks (the ``check`` field), all ranks of the run taken as data-parallel replicas (select one
DP group with ``ranks=``):

``post_reduce_mismatch``
    ``grad_reduced`` stats differ between ranks (after the reduce every rank holds the same grad).
``replicated_mismatch``
    ``param_origin``, ``param_updated``, ``exp_avg``, ``exp_avg_sq`` or ``update_ratio`` differ
    between ranks (replicas apply the same update).
``reduce_average``
    A rank's ``grad_reduced`` mean is not the average (``reduce="sum"``: the sum) of the ranks'
    ``grad_unreduced`` means -- the reduce lost, doubled or corrupted something.
``nonfinite_some_ranks``
    A tensor holds NaN/Inf on some ranks only (any family).
``pre_reduce_outlier``
    One rank's ``grad_unreduced`` norm is ``outlier_factor`` times above or below the others'.

"Differ" means ``|v - ref| > tol * max(|v|, |ref|, rms)`` with ``rms = norm / sqrt(numel)`` of
the row and ``tol = max(rtol, 4 * eps(dtype))``.  With three or more ranks the reference is the
median over ranks and the ranks far from it are named.  Two ranks cannot outvote each other, so
the culprit is the rank that failed ``reduce_average`` (for grads), else the one that moved
further from its own history (median of its previous values), else both are named.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import SupportsIndex

import numpy as np
import pandas as pd

from trainmon.analysis.flow import flow_key, phase_of
from trainmon.analysis.rules import COUNT_OPS, SpikeRule, json_number, spike_baselines
from trainmon.diagnosis.reader import RunTable
from trainmon.diagnosis.scan import nonfinite
from trainmon.families import FAMILIES

__all__ = ["RankIssue", "CHECKS", "check_ranks", "issue_order", "REPLICATED"]

CHECKS: tuple[str, ...] = (
    "post_reduce_mismatch",
    "replicated_mismatch",
    "reduce_average",
    "nonfinite_some_ranks",
    "pre_reduce_outlier",
)
REPLICATED: tuple[str, ...] = tuple(str(f) for f, info in FAMILIES.items() if info.replicated)
_EPS = {"torch.float16": 2.0**-10, "torch.bfloat16": 2.0**-7, "torch.float64": 2.0**-52}


@dataclass(frozen=True)
class RankIssue:
    step: int
    kind: str
    name: str
    rank: int
    check: str
    op: str
    value: float
    expected: float | None = None
    ranks: tuple[int, ...] = ()
    micro_step: int | None = None
    vpp_stage: int = 0
    position: int = 0
    detail: str = ""

    @property
    def phase(self) -> str:
        return phase_of(self.kind)

    def sort_key(self) -> tuple:
        return flow_key(self.step, self.kind, self.micro_step, self.position) + (CHECKS.index(self.check), self.rank)

    def to_json(self) -> dict[str, object]:
        return {
            "step": self.step,
            "phase": self.phase,
            "kind": self.kind,
            "name": self.name,
            "rank": self.rank,
            "check": self.check,
            "op": self.op,
            "value": json_number(self.value),
            "expected": None if self.expected is None else json_number(self.expected),
            "ranks": list(self.ranks),
            "micro_step": self.micro_step,
            "vpp_stage": self.vpp_stage,
            "detail": self.detail,
        }


_KEY = ["step", "vpp_stage", "name", "micro_step", "occurrence"]


def _prepare(frame: pd.DataFrame, rtol: float) -> dict[str, np.ndarray]:
    """Per row: ``_tol`` (``max(rtol, 4 eps(dtype))``) and ``_rms`` (``norm / sqrt(numel)``)."""
    codes, dtypes = pd.factorize(frame["dtype"])  # a handful of dtypes: look each up once
    eps = np.asarray([_EPS.get(d, 2.0**-23) for d in dtypes] + [2.0**-23])[codes]  # -1 (missing): default
    out = {"_tol": np.maximum(rtol, 4 * eps)}
    if "norm" in frame:
        with np.errstate(invalid="ignore", divide="ignore"):
            rms = frame["norm"].to_numpy(dtype=float, na_value=np.nan) / np.sqrt(frame["numel"].to_numpy(dtype=float))
        out["_rms"] = np.where(np.isinf(rms), np.nan, rms)
    else:
        out["_rms"] = np.full(len(frame), np.nan)
    return out


def _pivot(
    frame: pd.DataFrame, columns: Sequence[str], ranks: Sequence[int], extra: Mapping[str, np.ndarray] | None = None
):
    """(group keys incl. position, {column: [groups x ranks] array}) of one family; ``extra``:
    more columns, as arrays aligned with ``frame``'s rows.

    Groups in sorted key order; a (group, rank) recorded twice keeps its first row; ranks not in
    ``ranks`` are left out.  Filled with numpy from group numbers: a MultiIndex ``unstack`` of the
    same took most of ``ranks``' time on big runs."""
    grouped = frame.groupby(_KEY, sort=True, dropna=False)  # a missing key is a group too
    gid = grouped.ngroup().to_numpy()
    first_position = grouped["position"].min()
    keys = first_position.index.to_frame(index=False)
    keys["position"] = first_position.to_numpy()
    col = _slots(frame["rank"].to_numpy(dtype=np.int64), ranks)
    cell = gid * len(ranks) + col
    mine = np.flatnonzero(col >= 0)
    _, first = np.unique(cell[mine], return_index=True)  # each cell's first row, in frame order
    rows = mine[first]
    arrays = {}
    extra = extra or {}
    for c in [*columns, *extra]:
        values = extra[c] if c in extra else frame[c].to_numpy(dtype=float, na_value=np.nan)
        out = np.full((len(keys), len(ranks)), np.nan)
        out[gid[rows], col[rows]] = values[rows]
        arrays[c] = out
    return keys, arrays


def _slots(rank: np.ndarray, ranks: Sequence[int]) -> np.ndarray:
    """Each row's column in ``ranks`` (-1: a rank not in it)."""
    wanted = np.asarray(ranks, dtype=np.int64)
    order = np.argsort(wanted, kind="stable")
    at = np.minimum(np.searchsorted(wanted[order], rank), max(len(wanted) - 1, 0))
    return np.where(wanted[order][at] == rank, order[at], -1) if len(wanted) else np.full(len(rank), -1)


class _Keys:
    """Group keys as plain lists: issues are built one by one, and ``DataFrame.iloc`` per issue
    would dominate a broken run with many of them."""

    def __init__(self, frame: pd.DataFrame):
        self.cols = {c: frame[c].tolist() for c in frame.columns}

    def key(self, g: SupportsIndex) -> tuple:
        return tuple(self.cols[c][g] for c in _KEY)

    def issue(
        self,
        g: SupportsIndex,
        family: str,
        rank: int,
        check: str,
        op: str,
        value: float,
        expected: float | None = None,
        ranks: Sequence[int] = (),
        detail: str = "",
    ) -> RankIssue:
        micro = int(self.cols["micro_step"][g])
        return RankIssue(
            step=int(self.cols["step"][g]),
            kind=family,
            name=str(self.cols["name"][g]),
            rank=int(rank),
            check=check,
            op=op,
            value=float(value),
            expected=None if expected is None or np.isnan(expected) else float(expected),
            ranks=tuple(int(r) for r in ranks),
            micro_step=None if micro < 0 else micro,
            vpp_stage=int(self.cols["vpp_stage"][g]),
            position=int(self.cols["position"][g]),
            detail=detail,
        )


def _history(frame: pd.DataFrame, op: str, ranks: Sequence[int], rule: SpikeRule) -> np.ndarray:
    """Per group and rank: |log| distance of the value from the median of its own past values."""
    rows = frame[np.isfinite(frame[op].astype(float))].sort_values("step", kind="mergesort")
    score = pd.Series(np.nan, index=frame.index)
    if not rows.empty:
        ids = rows.groupby(["rank", *_KEY[1:]], sort=False).ngroup().to_numpy()
        v = rows[op].to_numpy(float)
        base = spike_baselines(ids, v, rule)
        score[rows.index] = np.abs(np.log((np.abs(v) + rule.floor) / (np.abs(base) + rule.floor)))
    _, arrays = _pivot(frame, [], ranks, {"_hist": score.to_numpy()})
    return arrays["_hist"]


def _pick_of_two(
    g: SupportsIndex, present: np.ndarray, history: np.ndarray | None, fallback: np.ndarray | None
) -> np.ndarray:
    """Two ranks disagree: blame the one that moved further from its own past, if that is clear."""
    if history is not None:
        h = history[g]
        if np.isfinite(h[present]).all() and not np.isclose(h[present].max(), h[present].min()):
            return present & (h == np.nanmax(np.where(present, h, np.nan)))
    if fallback is not None:
        return present & fallback
    return present


def _mismatch(
    table: RunTable,
    family: str,
    ranks: Sequence[int],
    rtol: float,
    rule: SpikeRule,
    check: str,
    blame: dict[tuple, set[int]],
) -> list[RankIssue]:
    fam = table.family(family)
    ops = [o for o in table.family_stats[family] if o not in COUNT_OPS]
    if fam.empty or not ops:
        return []
    frame_keys, arr = _pivot(fam, ops, ranks, _prepare(fam, rtol))
    keys = _Keys(frame_keys)
    tol, rms = np.nanmax(arr["_tol"], axis=1), np.nanmax(arr["_rms"], axis=1)
    with np.errstate(invalid="ignore", all="ignore"):
        devs = []
        for op in ops:
            v = arr[op]
            v = np.where(np.isfinite(v), v, np.nan)  # non-finite: nonfinite_some_ranks reports it
            ref = np.nanmedian(v, axis=1, keepdims=True)
            scale = np.fmax(np.fmax(np.abs(v), np.abs(ref)), np.nan_to_num(rms)[:, None])
            devs.append(np.abs(v - ref) / np.where(scale > 0, scale, 1.0))
        dev = np.stack(devs)  # [ops x groups x ranks]
    bad_groups = np.flatnonzero((np.nan_to_num(dev, nan=0.0) > tol[None, :, None]).any(axis=(0, 2)))
    histories: dict[str, np.ndarray] = {}
    issues = []
    for g in bad_groups:
        i = int(np.nanargmax(np.nanmax(dev[:, g, :], axis=1)))
        op, d, v = ops[i], dev[i, g], arr[ops[i]][g]
        present = np.isfinite(v)
        blamed = np.isin(ranks, sorted(blame.get(keys.key(g), ())))
        if (blamed & present).any():
            who = blamed & present
        elif present.sum() >= 3:
            who = present & (d > tol[g])
        else:
            if op not in histories:
                histories[op] = _history(fam, op, ranks, rule)
            who = _pick_of_two(g, present, histories[op], None)
        involved = [r for r, p in zip(ranks, present) if p]
        for r_i in np.flatnonzero(who):
            others = [float(x) for j, x in enumerate(v) if j != r_i and present[j]]
            expected = float(np.median(others)) if others else None
            issues.append(
                keys.issue(
                    g,
                    family,
                    ranks[int(r_i)],
                    check,
                    op,
                    v[r_i],
                    expected,
                    involved,
                    f"{op} differs across ranks by {np.nanmax(d):.3g} (relative)",
                )
            )
    return issues


def _reduce_average(
    table: RunTable, ranks: Sequence[int], rtol: float, reduce: str
) -> tuple[list[RankIssue], dict[tuple, set[int]]]:
    if not {"grad_unreduced", "grad_reduced"} <= set(table.family_stats):
        return [], {}
    if "mean" not in table.family_stats["grad_unreduced"] or "mean" not in table.family_stats["grad_reduced"]:
        return [], {}
    pre = table.family("grad_unreduced")
    if (pre["micro_step"] >= 0).any():  # per-micro-batch pre-reduce rows: the last one is reduced
        last = pre.groupby(["rank", "step", "vpp_stage", "name", "occurrence"])["micro_step"].transform("max")
        pre = pre[pre["micro_step"] == last].assign(micro_step=-1)
    post = table.family("grad_reduced")
    pre_keys, pre_arr = _pivot(pre, ["mean"], ranks)
    means = pre_arr["mean"]
    complete = np.isfinite(means).all(axis=1)
    expected = np.where(complete, means.sum(axis=1) / (len(ranks) if reduce == "mean" else 1), np.nan)
    exp_by_key = pd.Series(expected, index=pd.MultiIndex.from_frame(pre_keys[_KEY]))
    frame_keys, arr = _pivot(post, ["mean"], ranks, _prepare(post, rtol))
    keys = _Keys(frame_keys)
    exp = exp_by_key.reindex(pd.MultiIndex.from_frame(frame_keys[_KEY])).to_numpy()[:, None]
    v = arr["mean"]
    with np.errstate(invalid="ignore"):
        scale = np.fmax(np.fmax(np.abs(v), np.abs(exp)), np.nan_to_num(arr["_rms"]))
        bad = np.isfinite(v) & np.isfinite(exp) & (np.abs(v - exp) > arr["_tol"] * scale)
    blame: dict[tuple, set[int]]
    issues, blame = [], {}
    word = "average" if reduce == "mean" else "sum"
    for g, r_i in zip(*np.nonzero(bad)):
        issues.append(
            keys.issue(
                g,
                "grad_reduced",
                ranks[r_i],
                "reduce_average",
                "mean",
                v[g, r_i],
                exp[g, 0],
                ranks,
                f"post-reduce mean is not the {word} of the ranks' pre-reduce means",
            )
        )
        blame.setdefault(keys.key(g), set()).add(int(ranks[r_i]))
    return issues, blame


def _partial_nonfinite(table: RunTable) -> list[RankIssue]:
    found = nonfinite(table)
    if found.empty:
        return []
    group = ["kind", *_KEY]
    frame = table.frame.rename(columns={"family": "kind"})
    bad = found.groupby(group)["rank"].nunique().rename("bad")
    present = frame.groupby(group)["rank"].nunique().rename("present")
    both = pd.concat([bad, present.reindex(bad.index)], axis=1)
    partial = both[both["bad"] < both["present"]].index
    if partial.empty:
        return []
    hit = found.set_index(group).loc[lambda d: d.index.isin(partial)].reset_index()
    rows = frame.set_index(group).loc[lambda d: d.index.isin(partial)]
    present_ranks = rows.groupby(level=list(range(len(group))))["rank"].agg(lambda s: tuple(sorted(s)))
    bad_ranks = hit.groupby(group)["rank"].agg(lambda s: sorted(s))
    issues = []
    for r in hit.itertuples(index=False):
        key = (r.kind, r.step, r.vpp_stage, r.name, r.micro_step, r.occurrence)
        micro = int(r.micro_step)
        issues.append(
            RankIssue(
                step=int(r.step),
                kind=r.kind,
                name=r.name,
                rank=int(r.rank),
                check="nonfinite_some_ranks",
                op=r.op,
                value=float(r.value),
                ranks=present_ranks[key],
                micro_step=None if micro < 0 else micro,
                vpp_stage=int(r.vpp_stage),
                position=int(r.position),
                detail=f"NaN/Inf on rank(s) {bad_ranks[key]} only",
            )
        )
    return issues


def _outliers(table: RunTable, ranks: Sequence[int], factor: float, rule: SpikeRule) -> list[RankIssue]:
    if "norm" not in table.family_stats.get("grad_unreduced", ()):
        return []
    fam = table.family("grad_unreduced")
    frame_keys, arr = _pivot(fam, ["norm"], ranks)
    keys = _Keys(frame_keys)
    v = np.where(np.isfinite(arr["norm"]), np.abs(arr["norm"]), np.nan) + rule.floor
    n = np.isfinite(v).sum(axis=1)
    with np.errstate(invalid="ignore", all="ignore"):
        med = np.nanmedian(v, axis=1, keepdims=True)
        many = (n >= 3)[:, None] & ((v / med >= factor) | (v / med <= 1 / factor))
        spread = np.nanmax(v, axis=1) / np.nanmin(v, axis=1)
    two = np.flatnonzero((n == 2) & (spread >= factor))
    history = _history(fam, "norm", ranks, rule) if len(two) else None
    issues = []
    for g, r_i in zip(*np.nonzero(many)):
        issues.append(
            keys.issue(
                g,
                "grad_unreduced",
                ranks[r_i],
                "pre_reduce_outlier",
                "norm",
                arr["norm"][g, r_i],
                float(med[g, 0] - rule.floor),
                ranks,
                f"norm {v[g, r_i] / med[g, 0]:.3g}x the median over ranks",
            )
        )
    for g in two:
        present = np.isfinite(v[g])
        who = _pick_of_two(g, present, history, v[g] == np.nanmax(v[g]))
        for r_i in np.flatnonzero(who):
            other = (
                float(np.nanmax(np.where(present & ~who, arr["norm"][g], np.nan))) if (present & ~who).any() else None
            )
            issues.append(
                keys.issue(
                    g,
                    "grad_unreduced",
                    ranks[int(r_i)],
                    "pre_reduce_outlier",
                    "norm",
                    arr["norm"][g, r_i],
                    other,
                    [r for r, p in zip(ranks, present) if p],
                    f"norm {spread[g]:.3g}x apart between the two ranks",
                )
            )
    return issues


def check_ranks(
    table: RunTable,
    *,
    rtol: float = 1e-5,
    outlier_factor: float = 10.0,
    reduce: str = "mean",
    checks: Sequence[str] = CHECKS,
    rule: SpikeRule = SpikeRule(),
    ranks: Sequence[int] | None = None,
) -> list[RankIssue]:
    """Every cross-rank inconsistency of the table, in training-flow order.

    ``ranks``: the run's ranks when ``table`` holds only some of its tensors (a bucket of names:
    ``engine_buckets``), default the table's own.  Every check is per tensor, so the issues of a
    run are those of its buckets, merged with :func:`issue_order`."""
    ranks = list(table.ranks if ranks is None else ranks)
    if len(ranks) < 2:
        return []
    with warnings.catch_warnings():
        # Groups a rank did not record are all-NaN slices: expected, and handled as absent.
        warnings.simplefilter("ignore", RuntimeWarning)
        issues = _all_checks(table, ranks, rtol, outlier_factor, reduce, checks, rule)
    return sorted(issues, key=issue_order)


def issue_order(issue: RankIssue) -> tuple:
    """Training-flow order; issues equal in it (two tensors at one position) by tensor name."""
    return (*issue.sort_key(), issue.vpp_stage, issue.name)


def _all_checks(
    table: RunTable,
    ranks: list[int],
    rtol: float,
    outlier_factor: float,
    reduce: str,
    checks: Sequence[str],
    rule: SpikeRule,
) -> list[RankIssue]:
    issues: list[RankIssue] = []
    averaged, blame = _reduce_average(table, ranks, rtol, reduce)
    if "reduce_average" in checks:
        issues += averaged
    if "post_reduce_mismatch" in checks and "grad_reduced" in table.family_stats:
        issues += _mismatch(table, "grad_reduced", ranks, rtol, rule, "post_reduce_mismatch", blame)
    if "replicated_mismatch" in checks:
        for family in (f for f in REPLICATED if f in table.family_stats):
            issues += _mismatch(table, family, ranks, rtol, rule, "replicated_mismatch", {})
    if "nonfinite_some_ranks" in checks:
        issues += _partial_nonfinite(table)
    if "pre_reduce_outlier" in checks:
        issues += _outliers(table, ranks, outlier_factor, rule)
    return issues
