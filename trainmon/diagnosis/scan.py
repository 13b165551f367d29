"""The offline anomaly scan: the rules of ``rules.py`` over a whole run table, vectorised.

Works on any CSV output, whether or not alerts were configured during the run; alerts the run
wrote itself (``anomalies.jsonl``) are merged in by ``find_anomalies``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from trainmon.diagnosis.reader import RunTable, load_run, ranked_dirs, resolve_run_dir
from trainmon.diagnosis.rules import (
    ALERTS_FILE,
    COUNT_OPS,
    RATIO_FAMILIES,
    SKIP_EXPECTED,
    SKIPPED,
    SKIPPED_RUN,
    STEPS_FAMILY,
    Anomaly,
    Rules,
    SpikeRule,
)

__all__ = ["nonfinite", "spikes", "over_threshold", "scan", "read_alert_files", "merge_runtime", "find_anomalies"]

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
# Series per block of the spike matrix: bounds memory at block x longest series floats.
_BLOCK = 4096


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


def nonfinite(table: RunTable) -> pd.DataFrame:
    """One row per recorded tensor holding NaN/Inf (see ``rules.nonfinite_op`` for ``op``)."""
    found = []
    for family, stats in table.family_stats.items():
        if family in RATIO_FAMILIES:
            continue
        sub = table.family(family)
        sub = sub[_tensor_rows(sub, stats)]
        if sub.empty or not stats:
            continue
        ordered = [c for c in COUNT_OPS if c in stats] + [c for c in stats if c not in COUNT_OPS]
        values = sub[ordered].to_numpy(dtype=float)
        with np.errstate(invalid="ignore"):
            bad = np.column_stack(
                [values[:, i] > 0 if op in COUNT_OPS else ~np.isfinite(values[:, i]) for i, op in enumerate(ordered)]
            )
        hit = bad.any(axis=1)
        if hit.any():
            first = bad[hit].argmax(axis=1)  # the first op in ``ordered`` that is bad
            op = pd.Series(np.asarray(ordered, dtype=object)[first], dtype=object)
            found.append(_result(sub[hit], family, op, values[hit][np.arange(len(first)), first], "nonfinite"))
    return _concat(found)


def _baselines(keys: np.ndarray, values: np.ndarray, rule: SpikeRule) -> np.ndarray:
    """Median of each value's previous ``window`` values of the same series (NaN in warm-up).

    ``keys`` are series ids, rows already in step order within a series.
    """
    order = np.argsort(keys, kind="stable")
    k_sorted, v_sorted = keys[order], values[order]
    starts = np.r_[0, np.flatnonzero(np.diff(k_sorted)) + 1]
    lengths = np.diff(np.r_[starts, len(k_sorted)])
    index = np.arange(len(k_sorted)) - np.repeat(starts, lengths)
    out_sorted = np.full(len(k_sorted), np.nan)
    for first in range(0, len(starts), _BLOCK):
        block = slice(first, first + _BLOCK)
        s, n = starts[block], lengths[block]
        rows = np.arange(s[0], s[-1] + n[-1])
        col = np.repeat(np.arange(len(s)), n)
        matrix = np.full((int(n.max()), len(s)), np.nan)
        matrix[index[rows], col] = v_sorted[rows]
        base = pd.DataFrame(matrix).rolling(rule.window, min_periods=rule.warmup).median().shift(1)
        out_sorted[rows] = base.to_numpy()[index[rows], col]
    out = np.empty_like(out_sorted)
    out[order] = out_sorted
    return out


def spikes(table: RunTable, rule: SpikeRule, ops: Sequence[str]) -> pd.DataFrame:
    """Rows whose stat in ``ops`` left its running baseline (``rules`` module docstring)."""
    found = []
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
            base = _baselines(ids, values, rule)
            with np.errstate(invalid="ignore", divide="ignore"):  # a zero/NaN baseline: judged below
                ratio = (np.abs(values) + rule.floor) / (np.abs(base) + rule.floor)
                hit = (ratio >= rule.factor) | (ratio <= 1.0 / rule.factor)
            hit &= ~np.isnan(base)
            if hit.any():
                found.append(_result(rows[hit], family, op, values[hit], "spike", base[hit]))
    return _concat(found)


def over_threshold(table: RunTable, threshold: float, ops: Sequence[str]) -> pd.DataFrame:
    found = []
    for family, stats in table.family_stats.items():
        sub = table.family(family)
        for op in (o for o in ops if o in stats):
            v = sub[op].astype(float)
            hit = np.isfinite(v) & (v.abs() > threshold)
            if hit.any():
                found.append(_result(sub[hit], family, op, v[hit], "threshold"))
    return _concat(found)


def _concat(parts: list[pd.DataFrame]) -> pd.DataFrame:
    if not parts:
        return pd.DataFrame(columns=_COLUMNS)
    return pd.concat(parts, ignore_index=True)


def scan(table: RunTable, rules: Rules = Rules()) -> list[Anomaly]:
    """Every anomaly of the table, in training-flow order."""
    parts = []
    if rules.nonfinite:
        parts.append(nonfinite(table))
    if rules.spike is not None:
        parts.append(spikes(table, rules.spike, rules.ops))
    if rules.threshold is not None:
        parts.append(over_threshold(table, rules.threshold, rules.ops))
    skips = skipped_steps(table)
    found = _without_expected(_concat([p for p in parts if not p.empty]), skips)
    found = _concat([p for p in (found, skips) if not p.empty])
    return sorted((_to_anomaly(r) for r in found.itertuples(index=False)), key=Anomaly.sort_key)


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


def _to_anomaly(r) -> Anomaly:
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
    found: list[Anomaly], run_dir: str | Path, *, kinds: Sequence[str] | None = None, ranks: Sequence[int] | None = None
) -> list[Anomaly]:
    """``found`` plus the run's own alerts it lacks (the scan's entry wins on duplicates)."""
    seen = {_identity(a) for a in found}
    extra = [
        a
        for a in read_alert_files(run_dir)
        if _identity(a) not in seen and (kinds is None or a.kind in kinds) and (ranks is None or a.rank in ranks)
    ]
    return sorted(found + extra, key=Anomaly.sort_key)


def find_anomalies(
    run_dir: str | Path,
    rules: Rules = Rules(),
    *,
    runtime: bool = True,
    kinds: Sequence[str] | None = None,
    ranks: Sequence[int] | None = None,
) -> list[Anomaly]:
    """Scan a run's CSVs and merge the alerts the run wrote itself."""
    table = load_run(run_dir, families=kinds, ranks=ranks)
    found = scan(table, rules)
    return merge_runtime(found, table.path, kinds=kinds, ranks=ranks) if runtime else found
