"""The offline anomaly scan: the rules of ``rules.py`` over a run table (one bucket of names,
``engine_buckets``), vectorised.

Works on any output, whether or not alerts were configured during the run; alerts the run
wrote itself (``anomalies.jsonl``) are merged in by ``merge_runtime``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from trainmon.analysis.rules import (
    ALERTS_FILE,
    COUNT_OPS,
    PARAM_AFTER,
    PARAM_BEFORE,
    PARAM_CHANGE_RTOL,
    PARAM_CHANGED,
    RATIO_FAMILIES,
    SKIP_EXPECTED,
    SKIPPED,
    SKIPPED_RUN,
    STEPS_FAMILY,
    Anomaly,
    ByDesign,
    Findings,
    Rules,
    SpikeRule,
    Unjudged,
    judges_drops,
    over_threshold,
    spike_baselines,
    spike_hits,
)
from trainmon.diagnosis.reader import RunTable, ranked_dirs, resolve_run_dir

__all__ = [
    "nonfinite",
    "spikes",
    "threshold_rows",
    "param_changes",
    "scan",
    "scan_all",
    "read_alert_files",
    "merge_runtime",
    "skipped_steps",
    "concat_found",
    "to_anomaly",
]

log = logging.getLogger(__name__)

_SERIES = ["rank", "vpp_stage", "name", "micro_step", "occurrence"]
_COLUMNS = [
    "step",
    "kind",
    "name",
    "rank",
    "op",
    "value",
    "rule",
    "micro_step",
    "vpp_stage",
    "baseline",
    "position",
    "occurrence",
]


def _tensor_rows(frame: pd.DataFrame, stats: Sequence[str]) -> pd.Series:
    # msprobe-style rows for non-tensor inputs have no dtype and only NaN stats: nothing to judge.
    codes, dtypes = pd.factorize(frame["dtype"])  # a handful of dtypes: each judged once
    blank = np.asarray([str(d).strip() in ("", "None", "nan") for d in dtypes] + [True], dtype=bool)
    no_dtype = blank[codes]  # code -1: a missing dtype
    if stats:
        all_nan = np.isnan(frame[list(stats)].to_numpy(dtype=float, na_value=np.nan)).all(axis=1)
    else:
        all_nan = np.ones(len(frame), dtype=bool)
    # A tensor with no elements has no mean/min/max (NaN by definition): never a finding.
    empty = frame["numel"].to_numpy() == 0 if "numel" in frame else np.zeros(len(frame), dtype=bool)
    return pd.Series(~(no_dtype & all_nan) & ~empty, index=frame.index)


def _result(sub: pd.DataFrame, family: str, op: pd.Series | str, value, rule: str, baseline=None) -> pd.DataFrame:
    out = pd.DataFrame(
        {
            "step": sub["step"].to_numpy(),
            "kind": family,
            "name": sub["name"].to_numpy(),
            "rank": sub["rank"].to_numpy(),
            "op": op if isinstance(op, str) else op.to_numpy(),
            "value": np.asarray(value, dtype=float),
            "rule": rule,
            "micro_step": sub["micro_step"].to_numpy(),
            "vpp_stage": sub["vpp_stage"].to_numpy(),
            "baseline": np.nan if baseline is None else np.asarray(baseline, dtype=float),
            "position": sub["position"].to_numpy(),
            "occurrence": sub["occurrence"].to_numpy(),
        }
    )
    return out


def nonfinite(table: RunTable, skipped: set[tuple[int, int]] | None = None) -> pd.DataFrame:
    """One row per recorded tensor holding NaN/Inf (see ``rules.nonfinite_op`` for ``op``), but
    for series non-finite by design (``rules`` docstring) only their rows worse than the first."""
    return _nonfinite(table, skipped)[0]


def _nonfinite(table: RunTable, skipped: set[tuple[int, int]] | None = None) -> tuple[pd.DataFrame, list[ByDesign]]:
    """``nonfinite``'s rows and the by-design notes.  ``skipped``: the (rank, step) pairs the loss
    scaler skipped, whose grads are non-finite by definition (``skipped_steps``): left out, so
    that an overflow on a series' first step does not make it "by design"."""
    found, notes = [], []
    for family, stats in table.family_stats.items():
        if family in RATIO_FAMILIES:
            continue
        sub = table.family(family)
        sub = sub[_tensor_rows(sub, stats)]
        if skipped and family in SKIP_EXPECTED and not sub.empty:
            on_skip = np.fromiter(
                ((int(r), int(st)) in skipped for r, st in zip(sub["rank"], sub["step"])), bool, len(sub)
            )
            sub = sub[~on_skip]
        if sub.empty or not stats:
            continue
        sub = sub.sort_values("step", kind="mergesort")  # a series' first row: earliest step, then file order
        ordered = [c for c in COUNT_OPS if c in stats] + [c for c in stats if c not in COUNT_OPS]
        counts = np.array([op in COUNT_OPS for op in ordered], dtype=bool)
        values = sub[ordered].to_numpy(dtype=float)
        with np.errstate(invalid="ignore"):
            bad = np.where(counts, values > 0, ~np.isfinite(values))
        ids = sub.groupby(_SERIES, sort=False).ngroup().to_numpy()
        first = _first_rows(ids)  # per series id: its first row's index
        by_design = _by_design(ids, first, bad.any(axis=1))
        design_of = by_design[ids]  # per row: its series is non-finite by design
        design = values[first[ids]]  # per row: its series' first row
        with np.errstate(invalid="ignore"):
            worse = np.where(
                counts,
                ~np.isnan(values) & ~np.isnan(design) & (values > design),
                ~np.isfinite(values) & np.isfinite(design),
            )
        judged = np.where(design_of[:, None], worse, bad)
        hit = judged.any(axis=1)
        if hit.any():
            which = judged[hit].argmax(axis=1)  # the first op in ``ordered`` that is bad (or worse)
            op = pd.Series(np.asarray(ordered, dtype=object)[which], dtype=object)
            rows = np.flatnonzero(hit)
            base = np.where(design_of[rows], design[rows, which], np.nan)
            found.append(_result(sub[hit], family, op, values[rows, which], "nonfinite", base))
        if design_of.any():
            notes += _designs(sub, family, ordered, counts, values, bad, ids, first, design, by_design)
    return concat_found(found), notes


def _first_rows(ids: np.ndarray) -> np.ndarray:
    """Per series id (0..n-1, rows already in step order): the index of its first row."""
    first = np.full(int(ids.max()) + 1, len(ids), dtype=np.int64)
    np.minimum.at(first, ids, np.arange(len(ids)))
    return first


def _by_design(ids: np.ndarray, first: np.ndarray, bad: np.ndarray) -> np.ndarray:
    """Per series id: non-finite by design (``rules`` docstring): two rows or more, every one
    of them non-finite (``bad``: per row)."""
    every = np.ones(len(first), dtype=bool)
    np.logical_and.at(every, ids, bad)
    return every & (np.bincount(ids, minlength=len(first)) >= 2)


def _designs(sub, family, ordered, counts, values, bad, ids, first, design, by_design) -> list[ByDesign]:
    """The by-design notes of one family's series (``_nonfinite``)."""
    with np.errstate(invalid="ignore"):
        same = np.where(
            counts,
            (values == design) | (np.isnan(values) & np.isnan(design)),
            np.isfinite(values) == np.isfinite(design),
        ).all(axis=1)
    n = len(first)
    constant = np.ones(n, dtype=bool)
    np.logical_and.at(constant, ids, same)
    steps = sub["step"].to_numpy()
    last = np.full(n, np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(last, ids, steps.astype(np.int64))
    notes = []
    for sid in np.flatnonzero(by_design):
        r = int(first[sid])
        row = sub.iloc[r]
        micro = int(row["micro_step"])
        notes.append(
            ByDesign(
                kind=family,
                name=row["name"],
                rank=int(row["rank"]),
                first_step=int(steps[r]),
                last_step=int(last[sid]),
                evidence=tuple((op, float(values[r, i])) for i, op in enumerate(ordered) if bad[r, i]),
                constant=bool(constant[sid]),
                micro_step=None if micro < 0 else micro,
                vpp_stage=int(row["vpp_stage"]),
                occurrence=int(row["occurrence"]),
            )
        )
    return notes


def spikes(table: RunTable, rule: SpikeRule, ops: Sequence[str]) -> pd.DataFrame:
    """Rows whose stat in ``ops`` left its running baseline (``rules`` module docstring)."""
    return _spikes(table, rule, ops)[0]


def _spikes(table: RunTable, rule: SpikeRule, ops: Sequence[str]) -> tuple[pd.DataFrame, Unjudged]:
    """``spikes``' rows, and what the warm-up left unjudged."""
    found, unjudged = [], []
    for family, stats in table.family_stats.items():
        sub = table.family(family)
        sub = sub[_tensor_rows(sub, stats)]
        for op in (o for o in ops if o in stats):
            rows = sub[np.isfinite(sub[op].astype(float))]
            if rows.empty:
                continue
            rows = rows.sort_values("step", kind="mergesort")
            ids = rows.groupby(_SERIES, sort=False).ngroup().to_numpy()
            values = rows[op].to_numpy(dtype=float)
            base = spike_baselines(ids, values, rule)
            warming = np.isnan(base)
            unjudged.append((int(warming.sum()), set(rows["step"].to_numpy()[warming].astype(int).tolist())))
            hit = spike_hits(values, base, rule, down=judges_drops(family))
            if hit.any():
                found.append(_result(rows[hit], family, op, values[hit], "spike", base[hit]))
    return concat_found(found), Unjudged.merge(rule.warmup, unjudged)


def threshold_rows(table: RunTable, threshold: float, ops: Sequence[str]) -> pd.DataFrame:
    """Rows whose stat in ``ops`` is above ``threshold`` (``rules.over_threshold``)."""
    found = []
    for family, stats in table.family_stats.items():
        sub = table.family(family)
        for op in (o for o in ops if o in stats):
            v = sub[op].to_numpy(dtype=float, na_value=np.nan)
            hit = over_threshold(v, threshold)
            if hit.any():
                found.append(_result(sub[hit], family, op, v[hit], "threshold"))
    return concat_found(found)


def concat_found(parts: list[pd.DataFrame]) -> pd.DataFrame:
    """Found rows of several rules (``_result`` frames) as one frame, with its columns when empty."""
    if not parts:
        return pd.DataFrame(columns=_COLUMNS)
    return pd.concat(parts, ignore_index=True)


def param_changes(table: RunTable, rtol: float = PARAM_CHANGE_RTOL) -> pd.DataFrame:
    """``param_changed`` (``rules`` docstring): each ``param_origin`` row of step s + 1 whose
    stats differ from the same parameter's ``param_updated`` row of step s."""
    stats = [op for op in table.family_stats.get(PARAM_AFTER, ()) if op in table.family_stats.get(PARAM_BEFORE, ())]
    after, before = table.family(PARAM_AFTER), table.family(PARAM_BEFORE)
    if not stats or after.empty or before.empty:
        return pd.DataFrame(columns=_COLUMNS)
    keys = ["rank", "vpp_stage", "name", "occurrence", "step"]
    before = before[keys + stats].assign(step=before["step"] + 1)
    both = after.merge(before, on=keys, how="inner", suffixes=("", "__before"), sort=False)
    if both.empty:
        return pd.DataFrame(columns=_COLUMNS)
    now = both[stats].to_numpy(dtype=float)
    was = both[[f"{op}__before" for op in stats]].to_numpy(dtype=float)
    with np.errstate(invalid="ignore"):
        close = np.isfinite(now) & np.isfinite(was) & (np.abs(now - was) <= rtol * np.maximum(np.abs(now), np.abs(was)))
    differ = ~((now == was) | (np.isnan(now) & np.isnan(was)) | close)
    hit = differ.any(axis=1)
    if not hit.any():
        return pd.DataFrame(columns=_COLUMNS)
    which = differ[hit].argmax(axis=1)
    rows = np.flatnonzero(hit)
    op = pd.Series(np.asarray(stats, dtype=object)[which], dtype=object)
    return _result(both[hit], PARAM_AFTER, op, now[rows, which], PARAM_CHANGED, was[rows, which])


def scan(table: RunTable, rules: Rules = Rules()) -> list[Anomaly]:
    """Every anomaly of the table, in training-flow order."""
    return scan_all(table, rules).anomalies


def scan_all(table: RunTable, rules: Rules = Rules(), *, skips: pd.DataFrame | None = None) -> Findings:
    """Every anomaly of the table in training-flow order, the non-finite-by-design notes, and
    what the spike rule's warm-up left unjudged.  ``skips``: the whole run's ``skipped_steps``
    when ``table`` is one bucket of its names (they are then not reported again here)."""
    parts: list[pd.DataFrame] = []
    notes: list[ByDesign] = []
    unjudged: Unjudged | None = None
    own_skips = skips is None
    skips = skipped_steps(table) if skips is None else skips
    if rules.nonfinite:
        skipped = set(zip(skips["rank"].astype(int), skips["step"].astype(int))) if not skips.empty else None
        found_nf, notes = _nonfinite(table, skipped)
        parts.append(found_nf)
    if rules.spike is not None:
        found_sp, unjudged = _spikes(table, rules.spike, rules.ops)
        parts.append(found_sp)
    if rules.threshold is not None:
        parts.append(threshold_rows(table, rules.threshold, rules.ops))
    if rules.param_changed:
        parts.append(param_changes(table))
    found = _without_expected(concat_found([p for p in parts if not p.empty]), skips)
    if own_skips:
        found = concat_found([p for p in (found, skips) if not p.empty])
    anomalies = sorted((to_anomaly(r) for r in found.itertuples(index=False)), key=Anomaly.sort_key)
    return Findings(anomalies, sorted(notes, key=ByDesign.sort_key), unjudged)


def skipped_steps(table: RunTable) -> pd.DataFrame:
    """One row per step the loss scaler skipped (``steps`` family): rule ``skipped`` when the rank's
    previous recorded step was not skipped, ``skipped_run`` when it was; value: the loss scale."""
    sub = table.family(STEPS_FAMILY)
    if sub.empty or "skipped" not in sub:
        return pd.DataFrame(columns=_COLUMNS)
    sub = sub.sort_values(["rank", "step"], kind="mergesort")
    skipped = sub["skipped"].astype(float) > 0
    previous = skipped.groupby(sub["rank"]).shift(1, fill_value=False).astype(bool)
    hit = sub[skipped]
    if hit.empty:
        return pd.DataFrame(columns=_COLUMNS)
    rules = np.where(previous[skipped].to_numpy(), SKIPPED_RUN, SKIPPED)
    scale = hit["loss_scale"].astype(float) if "loss_scale" in hit else np.full(len(hit), np.nan)
    out = _result(hit, STEPS_FAMILY, "skipped", scale, SKIPPED)
    out["rule"] = rules
    return out


def _without_expected(found: pd.DataFrame, skips: pd.DataFrame) -> pd.DataFrame:
    """``found`` minus the non-finite grads of skipped steps (the skip reports them)."""
    if found.empty or skips.empty:
        return found
    skipped = set(zip(skips["rank"].astype(int), skips["step"].astype(int)))
    on_skip = np.array([(int(r), int(s)) in skipped for r, s in zip(found["rank"], found["step"])], dtype=bool)
    expected = (found["rule"] == "nonfinite").to_numpy() & found["kind"].isin(SKIP_EXPECTED).to_numpy() & on_skip
    return found[~expected]


def to_anomaly(r) -> Anomaly:
    """One found row (a ``_result`` frame's tuple) as an :class:`Anomaly`."""
    return Anomaly(
        step=int(r.step),
        kind=r.kind,
        name=r.name,
        rank=int(r.rank),
        op=r.op,
        value=float(r.value),
        rule=r.rule,
        micro_step=None if int(r.micro_step) < 0 else int(r.micro_step),
        vpp_stage=int(r.vpp_stage),
        baseline=None if pd.isna(r.baseline) else float(r.baseline),
        position=int(r.position),
        occurrence=int(r.occurrence),
    )


def read_alert_files(run_dir: str | Path) -> list[Anomaly]:
    """Alerts written during the run (``anomalies.jsonl`` of each rank dir); torn lines skipped."""
    found = []
    for _, rdir in ranked_dirs(resolve_run_dir(run_dir)):
        path = rdir / ALERTS_FILE
        if not path.is_file():
            continue
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            try:
                found.append(Anomaly.from_json(json.loads(line), source="runtime"))
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("trainmon: %s:%d: skipping unreadable alert (%s)", path, lineno, exc)
    return found


def _identity(a: Anomaly) -> tuple:
    return (a.step, a.kind, a.vpp_stage, a.name, a.rank, a.micro_step, a.occurrence, a.op, a.rule)


def merge_runtime(
    found: list[Anomaly],
    run_dir: str | Path,
    *,
    kinds: Sequence[str] | None = None,
    ranks: Sequence[int] | None = None,
    by_design: Sequence[ByDesign] = (),
) -> list[Anomaly]:
    """``found`` plus the run's own alerts it lacks (the scan's entry wins on duplicates).  The
    alert sink cannot know a series' later rows, so it alerts the first row of a series the scan
    found non-finite by design (``by_design``): the scan knows better, those are left out."""
    seen = {_identity(a) for a in found}
    seen |= {
        (n.first_step, n.kind, n.vpp_stage, n.name, n.rank, n.micro_step, n.occurrence, op, "nonfinite")
        for n in by_design
        for op in [*COUNT_OPS, *(op for op, _ in n.evidence)]
    }
    extra = [
        a
        for a in read_alert_files(run_dir)
        if _identity(a) not in seen and (kinds is None or a.kind in kinds) and (ranks is None or a.rank in ranks)
    ]
    return sorted(found + extra, key=Anomaly.sort_key)
