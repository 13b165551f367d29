"""The anomaly rules, shared by the run-time alert sink and the offline ``anomalies`` scan.

Rules (the ``rule`` field of an anomaly):

``nonfinite``
    A recorded tensor holds NaN or Inf: its ``nans``/``infs`` count is > 0 or one of its stats
    is NaN/Inf.  ``op`` names the count (preferred) or the stat, ``value`` its value.  Not
    applied to ratio families (``update_ratio``), where inf/nan mean a zero denominator.
``spike``
    A stat in ``Rules.ops`` (``norm`` by default) left its robust running baseline: the median of
    the series' last ``window`` finite values.  With ``r = (|v| + floor) / (|baseline| + floor)``
    it fires when ``r >= factor`` (up) or ``r <= 1 / factor`` (down).  A series is only judged once
    it has ``warmup`` earlier finite values.  The floor keeps near-zero quantities (means of
    symmetric tensors, biases at init) from firing on noise; the median keeps one spike from
    moving the baseline, so a single bad step is reported once.
``threshold``
    ``|v| > threshold`` for a stat in ``Rules.ops`` (msprobe's ``AnomalyNan`` threshold).

A *series* is one tensor's stat over steps: (rank, family, vpp_stage, name, micro_step,
occurrence, op).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from trainmon.diagnosis.flow import flow_key, phase_of
from trainmon.families import FAMILIES
from trainmon.output.layout import ALERTS_FILE

__all__ = [
    "SpikeRule",
    "Rules",
    "Anomaly",
    "SpikeTracker",
    "COUNT_OPS",
    "ALERTS_FILE",
    "RATIO_FAMILIES",
    "nonfinite_op",
    "json_number",
    "from_json_number",
]

COUNT_OPS: tuple[str, ...] = ("nans", "infs")
# Families whose value is a ratio of two norms: inf (x/0) and nan (0/0) are its definition for
# params at zero or not updated, not a sign of NaN in a tensor (those show in the param and
# grad families), so the nonfinite rule skips them.
RATIO_FAMILIES: frozenset[str] = frozenset(str(f) for f, info in FAMILIES.items() if info.ratio)

# A step the AMP loss scaler skipped had Inf/NaN grads by definition: on such a step the
# non-finite values of these families (everything from the backward pass to the reduced grads)
# are what the skip reports, not separate findings.  The skip itself is reported once, on the
# ``steps`` row: rule SKIPPED for a lone skip (expected: the scaler lowers the loss scale and goes
# on), SKIPPED_RUN for each skip that follows another recorded skip (the scale did not recover:
# a finding).
SKIPPED, SKIPPED_RUN = "skipped", "skipped_run"
STEPS_FAMILY = "steps"
SKIP_EXPECTED: frozenset[str] = frozenset(
    str(f) for f, info in FAMILIES.items() if info.phase in ("backward", "pre_reduce", "comm", "post_reduce")
)


@dataclass(frozen=True)
class SpikeRule:
    factor: float = 10.0
    floor: float = 1e-6
    warmup: int = 5
    window: int = 16

    def __post_init__(self) -> None:
        if not (self.factor > 1 and math.isfinite(self.factor)):
            raise ValueError(f"spike factor must be a finite number > 1, got {self.factor!r}")
        if not (self.floor >= 0 and math.isfinite(self.floor)):
            raise ValueError(f"spike floor must be a finite number >= 0, got {self.floor!r}")
        if self.warmup < 1 or self.window < 1:
            raise ValueError(f"spike warmup and window must be >= 1, got {self.warmup}, {self.window}")

    def ratio(self, value: float, baseline: float) -> float:
        den = abs(baseline) + self.floor
        return (abs(value) + self.floor) / den if den > 0 else (math.inf if value else 1.0)

    def fires(self, value: float, baseline: float) -> bool:
        r = self.ratio(value, baseline)
        return r >= self.factor or r <= 1.0 / self.factor


@dataclass(frozen=True)
class Rules:
    """Which rules run, on which stats."""

    nonfinite: bool = True
    spike: SpikeRule | None = field(default_factory=SpikeRule)
    threshold: float | None = None
    ops: tuple[str, ...] = ("norm",)


@dataclass(frozen=True)
class Anomaly:
    """One finding.  ``kind`` is the CSV family; ``micro_step`` is None outside actv/actv_grad."""

    step: int
    kind: str
    name: str
    rank: int
    op: str
    value: float
    rule: str
    micro_step: int | None = None
    vpp_stage: int = 0
    baseline: float | None = None
    position: int = 0
    occurrence: int = 0
    source: str = "scan"

    @property
    def phase(self) -> str:
        return phase_of(self.kind)

    def sort_key(self) -> tuple:
        return flow_key(self.step, self.kind, self.micro_step, self.position) + (self.rank, self.occurrence)

    def to_json(self, *, position: bool = False) -> dict[str, object]:
        out: dict[str, object] = {
            "step": self.step,
            "phase": self.phase,
            "kind": self.kind,
            "name": self.name,
            "rank": self.rank,
            "op": self.op,
            "value": _json_value(self.op, self.value),
            "rule": self.rule,
            "micro_step": self.micro_step,
            "vpp_stage": self.vpp_stage,
            "baseline": None if self.baseline is None else json_number(self.baseline),
            "source": self.source,
        }
        if position:
            out["position"] = self.position
            out["occurrence"] = self.occurrence
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, source: str | None = None) -> Anomaly:
        baseline = data.get("baseline")
        micro = data.get("micro_step")
        return cls(
            step=int(data["step"]),
            kind=str(data["kind"]),
            name=str(data["name"]),
            rank=int(data["rank"]),
            op=str(data["op"]),
            value=from_json_number(data["value"]),
            rule=str(data["rule"]),
            micro_step=None if micro is None else int(micro),
            vpp_stage=int(data.get("vpp_stage", 0)),
            baseline=None if baseline is None else from_json_number(baseline),
            position=int(data.get("position", 0)),
            occurrence=int(data.get("occurrence", 0)),
            source=source or str(data.get("source", "runtime")),
        )


def json_number(value: float | int) -> float | int | str:
    """JSON has no NaN/Inf: they are written as the strings "nan", "inf", "-inf"."""
    if isinstance(value, int) or (isinstance(value, float) and math.isfinite(value)):
        return value
    value = float(value)
    if math.isfinite(value):
        return int(value) if value.is_integer() and abs(value) < 2**53 else value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def _json_value(op: str, value: float) -> float | int | str:
    # Counts travel as floats through pandas; they are integers to readers.
    if op in COUNT_OPS and math.isfinite(value) and float(value).is_integer():
        return int(value)
    return json_number(value)


def from_json_number(value: object) -> float:
    return float(cast("str | float", value))  # float("nan"), float("-inf") parse the spelled-out forms


def nonfinite_op(stats: Mapping[str, float | int]) -> str | None:
    """The stat that shows a tensor holds NaN/Inf: a count > 0 first, else a non-finite stat."""
    try:
        # Fast path for the common case (runs per recorded row): the sum is finite only if every
        # stat is; an overflowing sum just takes the slow path below.
        if not (stats.get("nans") or stats.get("infs")) and math.isfinite(sum(stats.values())):
            return None
    except TypeError:
        pass
    for op in COUNT_OPS:
        v = stats.get(op)
        if v is not None and not (isinstance(v, float) and math.isnan(v)) and v > 0:
            return op
    for op, v in stats.items():
        if op not in COUNT_OPS and v is not None and not math.isfinite(float(v)):
            return op
    return None


class SpikeTracker:
    """Running baselines for the online spike rule: one bounded window per series.

    Same arithmetic as the offline scan (``scan.spikes``): median of the last ``window`` finite
    values, judged only after ``warmup`` of them.
    """

    def __init__(self, rule: SpikeRule):
        self.rule = rule
        # Per series: the last ``window`` values in arrival order, and the same values sorted
        # (kept with bisect, so the median is an index away instead of a sort per value).
        self._windows: dict[Hashable, tuple[deque[float], list[float]]] = {}

    def __len__(self) -> int:
        return len(self._windows)

    def observe(self, key: Hashable, value: float) -> float | None:
        """Record ``value``; return the baseline it spiked against, or None."""
        if not math.isfinite(value):
            return None  # the nonfinite rule reports it; it must not poison the baseline
        rule = self.rule
        state = self._windows.get(key)
        if state is None:
            state = self._windows[key] = (deque(), [])
        recent, ordered = state
        fired = None
        n = len(ordered)
        if n >= rule.warmup:
            # The median as statistics.median computes it (the offline scan's pandas median agrees).
            baseline = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
            if rule.fires(value, baseline):
                fired = baseline
        value = float(value)
        if n == rule.window:
            del ordered[bisect.bisect_left(ordered, recent.popleft())]
        recent.append(value)
        bisect.insort(ordered, value)
        return fired
