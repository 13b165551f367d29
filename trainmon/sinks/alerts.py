"""Run-time alerts as a sink: the anomaly rules applied to every row as it is recorded.

It receives each step's ``StatRow``s like any sink (off the training thread, behind the async
writer), judges them with ``trainmon.analysis.rules`` and

* appends one JSON object per anomaly to ``<rank_dir>/anomalies.jsonl`` (fields in
  docs/diagnosis.md): one ``os.write`` of whole lines per step on an ``O_APPEND`` fd, so a killed
  run leaves only whole lines and every alert of a finished ``write`` is on disk;
* logs each (name, rule) once at WARNING, then only counts: at 10, 100, 1000 ... alerts of the
  same pair, and a summary at ``close``; at most ``max_log_lines`` first messages per step;
* records its first alert in an :class:`AlertListener` (the escalation's ``runtime.alert_latch``)
  when given one, and marks every judged step there, so the step driver can escalate
  (``runtime.escalation``).

The file is created with the first alert: a healthy run has none.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from trainmon.analysis.rules import (
    ALERTS_FILE,
    RATIO_FAMILIES,
    SKIP_EXPECTED,
    SKIPPED,
    SKIPPED_RUN,
    STEPS_FAMILY,
    Anomaly,
    NonfiniteDesigns,
    Rules,
    SpikeRule,
    SpikeTracker,
    judges_drops,
    nonfinite_op,
    over_threshold,
)
from trainmon.sinks.base import Sink, SinkOptions
from trainmon.stats.rows import StatRow, StepRows, paced

__all__ = ["AlertListener", "AlertSettings", "AlertSink", "ALERTS_FILE"]

log = logging.getLogger(__name__)

_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)


class AlertListener(Protocol):
    """What the sink tells about alerts, from the writer thread (``runtime.alert_latch.AlertLatch``
    is the one in use; a Protocol so that ``sinks`` never imports ``runtime``)."""

    attached: bool  # set by the sink that feeds it

    def fire(self, *, step: int, rank: int, rule: str, kind: str, name: str, op: str) -> bool:
        """An alert of ``step``; True if it is the first one the listener keeps."""
        ...

    def checked(self, step: int) -> None:
        """Every row of ``step`` was judged (alert or not)."""
        ...


@dataclass(frozen=True)
class AlertSettings:
    """What the alert sink checks and what it does on an alert."""

    rules: Rules = field(default_factory=Rules)
    max_log_lines: int = 5  # first-time messages per step

    @classmethod
    def from_alert_config(cls, alert: object) -> AlertSettings:
        """From ``config.AlertConfig`` (read by attribute, so its final shape may grow).

        ``AnomalyNan`` -> nonfinite (always on) plus ``threshold``; ``AnomalyTurbulence`` -> the
        spike rule, ``factor`` = 1 + msprobe's relative ``threshold`` unless ``factor`` is given,
        with optional ``floor``, ``warmup``, ``window``, ``ops``.
        """
        threshold: float | None = None
        spike: SpikeRule | None = None
        ops: tuple[str, ...] = ("norm",)
        for rule in _get(alert, "rules", ()) or ():
            name, args = _rule_parts(rule)
            if name in ("AnomalyNan", "nonfinite"):
                threshold = args.get("threshold", threshold)
            elif name in ("AnomalyTurbulence", "spike"):
                spike, ops = _spike_rule(args), tuple(args.get("ops", ops))
        return cls(rules=Rules(nonfinite=True, spike=spike, threshold=threshold, ops=ops))


def _get(obj: object, key: str, default):
    if obj is None:
        return default
    return obj.get(key, default) if isinstance(obj, Mapping) else getattr(obj, key, default)


def _rule_parts(rule: object) -> tuple[str, Mapping[str, Any]]:
    return str(_get(rule, "rule_name", "")), dict(_get(rule, "args", {}) or {})


def _spike_rule(args: Mapping[str, Any]) -> SpikeRule:
    default = SpikeRule()
    factor = args.get("factor")
    if factor is None and args.get("threshold") is not None:
        factor = 1.0 + float(args["threshold"])
    return SpikeRule(
        factor=float(factor if factor is not None else default.factor),
        floor=float(args.get("floor", default.floor)),
        warmup=int(args.get("warmup", default.warmup)),
        window=int(args.get("window", default.window)),
    )


def _is_tensor_row(row: StatRow) -> bool:
    # Mirrors the offline scan: rows without a dtype and with only NaN stats describe no tensor,
    # and a tensor with no elements (NaN mean/min/max by definition) is never a finding.
    if row.shape and math.prod(row.shape) == 0:
        return False
    if row.dtype and row.dtype != "None":
        return True
    return not all(isinstance(v, float) and math.isnan(v) for v in row.stats.values())


class AlertSink(Sink):
    """See the module docstring.  ``count`` is the number of alerts so far."""

    def __init__(
        self, options: SinkOptions, settings: AlertSettings | None = None, *, latch: AlertListener | None = None
    ):
        super().__init__(options)
        self.settings = settings or AlertSettings()
        rules = self.settings.rules
        self._tracker = SpikeTracker(rules.spike) if rules.spike is not None else None
        self._designs = NonfiniteDesigns()  # series non-finite by design (rules docstring)
        self.latch = latch
        if latch is not None:
            latch.attached = True
        self.path = options.rank_dir / ALERTS_FILE
        self.count = 0
        self._fd: int | None = None
        self._seen: Counter[tuple[str, str]] = Counter()
        self._io_failed = 0
        self._prev_skipped = False  # the previous recorded step was skipped by the loss scaler

    # ------------------------------------------------------------------ rules

    def check(self, rows: Sequence[StatRow], step: int) -> list[Anomaly]:
        """The anomalies of one step's rows, in training-flow order (updates the baselines)."""
        rules = self.settings.rules
        tracker, threshold, ops = self._tracker, rules.threshold, rules.ops
        positions: dict[tuple, int] = {}
        occurrences: dict[tuple, int] = {}
        found: list[Anomaly] = []
        skipped = _skipped(rows)
        for row in paced(rows):
            # Per-row work is kept small: this runs on the writer thread, which shares the GIL.
            pos_key = (row.family, row.micro_step)
            occ_key = (row.family, row.micro_step, row.vpp_stage, row.name)
            position = positions.get(pos_key, 0)
            occurrence = occurrences.get(occ_key, 0)
            positions[pos_key] = position + 1
            occurrences[occ_key] = occurrence + 1
            if not _is_tensor_row(row):
                continue
            hits: list[tuple[str, float, str, float | None]] = []
            stats = row.stats
            if row.family == STEPS_FAMILY and skipped:
                rule = SKIPPED_RUN if self._prev_skipped else SKIPPED
                hits.append(("skipped", float(stats.get("loss_scale", math.nan)), rule, None))
            elif rules.nonfinite and row.family not in RATIO_FAMILIES and not (skipped and row.family in SKIP_EXPECTED):
                op = nonfinite_op(stats)
                design_key = (*occ_key, occurrence)
                if op is not None or design_key not in self._designs.decided:
                    judged = self._designs.judge(design_key, stats, op)
                    if judged is not None:
                        base = self._designs.first_value(design_key, judged)
                        hits.append((judged, float(stats[judged]), "nonfinite", base))
            for op in ops:
                value = stats.get(op)
                if value is None:
                    continue
                value = float(value)
                if tracker is not None:
                    base = tracker.observe((*occ_key, occurrence, op), value, down=judges_drops(row.family))
                    if base is not None:
                        hits.append((op, value, "spike", base))
                if threshold is not None and over_threshold(value, threshold):
                    hits.append((op, value, "threshold", None))
            found += [self._anomaly(row, op, value, rule, base, position, occurrence) for op, value, rule, base in hits]
        if skipped is not None:
            self._prev_skipped = skipped
        if self._designs.new:
            self._note_designs()
        return sorted(found, key=Anomaly.sort_key)

    def _anomaly(self, row: StatRow, op: str, value: float, rule: str, base, position: int, occurrence: int) -> Anomaly:
        return Anomaly(
            step=row.step,
            kind=row.family,
            name=row.name,
            rank=self.options.rank,
            op=op,
            value=value,
            rule=rule,
            micro_step=row.micro_step,
            vpp_stage=row.vpp_stage,
            baseline=base,
            position=position,
            occurrence=occurrence,
            source="runtime",
        )

    def _note_designs(self) -> None:
        """One WARNING per series found non-finite by design (``rules.NonfiniteDesigns``)."""
        shown = self.settings.max_log_lines
        for key, evidence in self._designs.new[:shown]:
            family, _micro, _vpp, name, _occ = cast(tuple, key)
            what = ", ".join(f"{op}={v:g}" for op, v in evidence.items())
            log.warning(
                "trainmon: rank %d: %s %s is non-finite at its first two steps (%s): taken as by design "
                "(a mask?); only a rise is alerted",
                self.options.rank,
                family,
                name,
                what,
            )
        if len(self._designs.new) > shown:
            log.warning(
                "trainmon: rank %d: %d more series taken as non-finite by design",
                self.options.rank,
                len(self._designs.new) - shown,
            )
        self._designs.new.clear()

    # ------------------------------------------------------------------ sink

    def write(self, rows: StepRows, step: int) -> None:
        try:
            found = self.check(rows, step)
            findings = [a for a in found if a.rule != SKIPPED]  # a lone skip is expected: no escalation
            if findings and self.latch is not None:
                a = findings[0]
                self.latch.fire(step=a.step, rank=a.rank, rule=a.rule, kind=str(a.kind), name=a.name, op=a.op)
        finally:  # judged (or failed): the boundary waiting for this step must not wait longer
            if self.latch is not None:
                self.latch.checked(step)
        if not found:
            return
        self.count += len(found)
        self._append(found)
        self._log(found, step)

    def _append(self, found: list[Anomaly]) -> None:
        now = round(time.time(), 3)
        lines = "".join(json.dumps({**a.to_json(position=True), "time": now}, allow_nan=False) + "\n" for a in found)
        data = lines.encode("utf-8")
        try:
            if self._fd is None:
                self.options.rank_dir.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, _FLAGS, 0o644)
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            self._io_failed += len(found)
            if self._io_failed == len(found):
                log.warning("trainmon: cannot write alerts to %s: %s (alerts still logged)", self.path, exc)

    def _log(self, found: list[Anomaly], step: int) -> None:
        first_time = 0
        for a in found:
            key = (a.name, a.rule)
            self._seen[key] += 1
            n = self._seen[key]
            if n == 1:
                first_time += 1
                if first_time <= self.settings.max_log_lines:
                    log.warning(
                        "trainmon alert: rank %d step %d %s %s %s: %s=%s%s",
                        a.rank,
                        a.step,
                        a.phase,
                        a.kind,
                        a.name,
                        a.op,
                        a.to_json()["value"],
                        _why(a),
                    )
            elif math.log10(n).is_integer():
                log.warning("trainmon alert: %s %s: %d alerts so far (latest at step %d)", a.name, a.rule, n, a.step)
        hidden = first_time - self.settings.max_log_lines
        if hidden > 0:
            log.warning(
                "trainmon alert: rank %d step %d: %d more tensors alerted (see %s)",
                self.options.rank,
                step,
                hidden,
                self.path,
            )

    def flush(self) -> None:
        if self._fd is not None:
            try:
                os.fsync(self._fd)
            except OSError:
                pass

    def close(self) -> None:
        self.flush()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.count:
            log.warning(
                "trainmon: rank %d: %d alerts on %d (name, rule) pairs; details in %s%s",
                self.options.rank,
                self.count,
                len(self._seen),
                self.path,
                f" ({self._io_failed} could not be written)" if self._io_failed else "",
            )


def _skipped(rows: Sequence[StatRow]) -> bool | None:
    """Whether the loss scaler skipped this step (its ``steps`` row); None when there is none."""
    for row in reversed(rows):  # the steps row is captured last
        if row.family == STEPS_FAMILY:
            return bool(row.stats.get("skipped", 0))
    return None


def _why(a: Anomaly) -> str:
    if a.rule in (SKIPPED, SKIPPED_RUN):
        return (
            " (the loss scaler skipped the optimizer step: Inf/NaN grads; expected now and then)"
            if a.rule == SKIPPED
            else " (the loss scaler skipped this step AND the one before: a run of skips)"
        )
    if a.rule == "spike":
        return f" (spike: running baseline {a.baseline:.6g})"
    if a.rule == "threshold":
        return " (above the configured threshold)"
    return " (non-finite)"
