"""The anomaly rules, written once: the run-time alert sink (one row at a time) and the offline
``anomalies`` scan (numpy arrays of one bucket of series) both call this module.

Rules (the ``rule`` field of an anomaly):

``nonfinite``
    A recorded tensor holds NaN or Inf: its ``nans``/``infs`` count is > 0 or one of its stats
    is NaN/Inf.  ``op`` names the count (preferred) or the stat, ``value`` its value.  Not
    applied to ratio families (``update_ratio``), where inf/nan mean a zero denominator.
    A series non-finite at every row from its first on, with two rows or more (a causal
    attention mask holding -inf, a padding sentinel), is non-finite by design: it is reported
    once, as a :class:`ByDesign` note, and only its rows that got worse than its first row are
    findings (a ``nans``/``infs`` count above the first row's, or a stat non-finite that was
    finite there; ``baseline`` is the first row's value).  A series that is finite at some row,
    or has one row only, is judged row by row as before.
``spike``
    A stat in ``Rules.ops`` (``norm`` by default) left its robust running baseline: the median of
    the series' last ``window`` finite values.  With ``r = (|v| + floor) / (|baseline| + floor)``
    it fires when ``r >= factor`` (up), and, for the families in ``DROP_FAMILIES`` only,
    ``r <= 1 / factor`` (down).  Every other family records a signed tensor (params, grads,
    ``exp_avg``, activations): the norm of a small one falls towards zero whenever its values
    cross zero (an output bias settling), so a drop there says nothing; a jump up does.  A series
    is only judged once it has ``warmup`` earlier finite values (the steps left unjudged are
    reported: :class:`Unjudged`).  The floor keeps near-zero quantities from firing on noise; the
    median keeps one spike from moving the baseline, so a single bad step is reported once.
``threshold``
    ``|v| > threshold`` for a stat in ``Rules.ops`` (msprobe's ``AnomalyNan`` threshold).
``param_changed``
    A parameter changed between the end of one step and the start of the next: its
    ``param_updated`` row of step ``s`` and its ``param_origin`` row of step ``s + 1`` (the same
    tensor, read with nothing in between, so bit-equal on a healthy run) differ in some stat by
    more than ``PARAM_CHANGE_RTOL`` relative.  A bad checkpoint load, memory corruption, code
    writing weights outside the optimizer.  Reported at step ``s + 1`` on ``param_origin``;
    ``baseline`` is the ``param_updated`` value.  Offline only (``anomalies``).

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

import numpy as np
import pandas as pd

from trainmon.analysis.flow import flow_key, phase_of
from trainmon.families import FAMILIES
from trainmon.output.layout import ALERTS_FILE

__all__ = [
    "SpikeRule",
    "Rules",
    "ByDesign",
    "Unjudged",
    "Findings",
    "DROP_FAMILIES",
    "PARAM_CHANGED",
    "PARAM_CHANGE_RTOL",
    "judges_drops",
    "nonfinite_evidence",
    "worse_op",
    "NonfiniteDesigns",
    "Anomaly",
    "SpikeTracker",
    "COUNT_OPS",
    "ALERTS_FILE",
    "RATIO_FAMILIES",
    "nonfinite_op",
    "json_number",
    "from_json_number",
    "spike_baselines",
    "spike_hits",
    "over_threshold",
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
# Families whose tensor is >= 0 by definition (Adam's second moment, ratios of norms): a value
# there only nears zero when the quantity itself collapses, so a drop is judged.  Every other
# family is signed and judged upward only (module docstring, ``spike``).
DROP_FAMILIES: frozenset[str] = frozenset({"exp_avg_sq"}) | RATIO_FAMILIES

# ``param_changed``: param_updated of step s vs param_origin of step s + 1 (module docstring).
PARAM_CHANGED = "param_changed"
PARAM_BEFORE, PARAM_AFTER = "param_updated", "param_origin"
PARAM_CHANGE_RTOL = 1e-6


def judges_drops(family: str) -> bool:
    """Whether the spike rule judges a drop of ``family``'s values (else only jumps up)."""
    return family in DROP_FAMILIES


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

    def ratio(self, value, baseline):
        """``(|v| + floor) / (|baseline| + floor)``, of floats (the alert sink) or of numpy arrays
        (the scan) alike: the one place the ratio is written.  A zero denominator: ``inf`` for a
        value that is not zero, else 1 (arrays: numpy's inf and NaN, which never fire either)."""
        den = abs(baseline) + self.floor
        if not isinstance(den, np.ndarray) and den == 0:  # a number's zero division raises
            return math.inf if value else 1.0
        return (abs(value) + self.floor) / den

    def fires(self, value, baseline, *, down: bool = True):
        """Whether ``value`` spiked against ``baseline``, of floats or arrays alike (the one test);
        ``down``: judge drops too (``judges_drops`` of the value's family)."""
        r = self.ratio(value, baseline)
        return (r >= self.factor) | (down & (r <= 1.0 / self.factor))


@dataclass(frozen=True)
class Rules:
    """Which rules run, on which stats."""

    nonfinite: bool = True
    spike: SpikeRule | None = field(default_factory=SpikeRule)
    threshold: float | None = None
    ops: tuple[str, ...] = ("norm",)
    param_changed: bool = True


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


def _ordered_ops(stats: Mapping[str, float | int]) -> list[str]:
    # The nonfinite rule's order: counts first, then the other stats as recorded.
    return [op for op in COUNT_OPS if op in stats] + [op for op in stats if op not in COUNT_OPS]


def nonfinite_evidence(stats: Mapping[str, float | int]) -> dict[str, float]:
    """What makes a row non-finite: its counts above 0 and its non-finite stats, in rule order."""
    out: dict[str, float] = {}
    for op in _ordered_ops(stats):
        v = float(stats[op])
        if (v > 0 if op in COUNT_OPS else not math.isfinite(v)) and not (op in COUNT_OPS and math.isnan(v)):
            out[op] = v
    return out


def worse_op(stats: Mapping[str, float | int], design: Mapping[str, float | int]) -> str | None:
    """The first stat in which a row of a non-finite-by-design series is worse than the series'
    first row ``design``: a count above the first row's, or a stat non-finite that was finite."""
    for op in _ordered_ops(stats):
        v, d = float(stats[op]), float(design.get(op, math.nan))
        if op in COUNT_OPS:
            if not math.isnan(v) and not math.isnan(d) and v > d:
                return op
        elif not math.isfinite(v) and math.isfinite(d):
            return op
    return None


@dataclass(frozen=True)
class ByDesign:
    """A series non-finite from its first row on (``rules`` docstring, ``nonfinite``): one note.

    ``evidence``: the first row's counts above 0 and non-finite stats; ``constant``: every row
    of the series was non-finite exactly so (equal counts, the same stats non-finite)."""

    kind: str
    name: str
    rank: int
    first_step: int
    last_step: int
    evidence: tuple[tuple[str, float], ...]
    constant: bool
    micro_step: int | None = None
    vpp_stage: int = 0
    occurrence: int = 0

    def sort_key(self) -> tuple:
        return flow_key(self.first_step, self.kind, self.micro_step, 0) + (
            self.rank,
            self.name,
            self.vpp_stage,
            self.occurrence,
        )

    def what(self) -> str:
        """``infs=120``: the counts when there are any (the stats follow from them), else the stats."""
        shown = [(op, v) for op, v in self.evidence if op in COUNT_OPS] or list(self.evidence)
        return ", ".join(f"{op}={_json_value(op, v)}" for op, v in shown)

    def text(self, name: str | None = None) -> str:
        """The note's line; ``name``: the name as the report prints it (escaped)."""
        where = f"{self.kind} {self.name if name is None else name}, rank {self.rank}"
        if self.micro_step is not None:
            where += f", micro {self.micro_step}"
        how = "at every step" if self.constant else "first, changing later"
        return f"non-finite by design: {where} ({self.what()} {how} since step {self.first_step})"

    def to_json(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "name": self.name,
            "rank": self.rank,
            "micro_step": self.micro_step,
            "vpp_stage": self.vpp_stage,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "values": {op: _json_value(op, v) for op, v in self.evidence},
            "same_at_every_step": self.constant,
        }


@dataclass(frozen=True)
class Unjudged:
    """What the spike rule's warm-up left unjudged: ``values`` (one stat of one series at one
    step) in all, at ``steps`` (sorted, distinct)."""

    warmup: int
    values: int = 0
    steps: tuple[int, ...] = ()

    def ranges(self) -> list[tuple[int, int]]:
        """``steps`` as runs of consecutive steps: [(0, 4), (9, 9)]."""
        out: list[tuple[int, int]] = []
        for s in self.steps:
            if out and s == out[-1][1] + 1:
                out[-1] = (out[-1][0], s)
            else:
                out.append((s, s))
        return out

    def to_json(self) -> dict[str, object]:
        return {"warmup": self.warmup, "values": self.values, "steps": [list(r) for r in self.ranges()]}

    def text(self) -> str:
        steps = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in self.ranges())
        return (
            f"spike rule: {self.values} values unjudged (warm-up: each series' first {self.warmup} "
            f"finite values), at steps {steps}"
        )

    @staticmethod
    def merge(warmup: int, parts: list[tuple[int, set[int]]]) -> Unjudged:
        return Unjudged(warmup, sum(n for n, _ in parts), tuple(sorted(set().union(*(s for _, s in parts)))))


@dataclass
class Findings:
    """A scan's whole answer: the anomalies, the non-finite-by-design notes, the spike warm-up."""

    anomalies: list[Anomaly]
    by_design: list[ByDesign] = field(default_factory=list)
    unjudged: Unjudged | None = None


class NonfiniteDesigns:
    """The online side of the nonfinite rule's by-design test (``rules`` docstring).

    Online, a series cannot wait for its last row: a non-finite first row is alerted (the offline
    scan, which sees every row, drops that alert when the series turns out by design:
    ``scan.merge_runtime``); if the second row is non-finite too, the series is taken as by
    design and from then on only rows worse than the first are alerted.  One dict entry per
    series."""

    def __init__(self) -> None:
        self._state: dict[Hashable, object] = {}  # None: judged row by row; a dict: the design
        self._first: dict[Hashable, dict[str, float]] = {}  # non-finite first rows, until the second
        self.new: list[tuple[Hashable, dict[str, float]]] = []  # series found by design since the last look

    def judge(self, key: Hashable, stats: Mapping[str, float | int], op: str | None) -> str | None:
        """``op``: ``nonfinite_op(stats)`` of this row (None: finite).  Returns the op to alert, or None."""
        if key in self._first:
            design = self._first.pop(key)
            if op is None:  # finite second row: the first was an event, not a design
                self._state[key] = None
                return None
            self._state[key] = design
            self.new.append((key, nonfinite_evidence(design)))
            return worse_op(stats, design)
        if key not in self._state:
            if op is None:
                self._state[key] = None
            else:
                self._first[key] = {k: float(v) for k, v in stats.items()}
            return op
        known = self._state[key]
        if known is None or op is None:
            return op
        return worse_op(stats, cast("Mapping[str, float]", known))

    @property
    def decided(self) -> Mapping[Hashable, object]:
        """The series whose way is known (by design or not): their finite rows need no look."""
        return self._state

    def first_value(self, key: Hashable, op: str) -> float | None:
        """The first row's ``op`` of a series non-finite by design (a finding's baseline), else None."""
        design = self._state.get(key)
        return None if not isinstance(design, dict) else design.get(op)


class SpikeTracker:
    """Running baselines for the online spike rule: one bounded window per series.

    Same arithmetic as the offline scan (``spike_baselines`` and ``spike_hits``): median of the last ``window`` finite
    values, judged only after ``warmup`` of them.
    """

    def __init__(self, rule: SpikeRule):
        self.rule = rule
        # Per series: the last ``window`` values in arrival order, and the same values sorted
        # (kept with bisect, so the median is an index away instead of a sort per value).
        self._windows: dict[Hashable, tuple[deque[float], list[float]]] = {}

    def __len__(self) -> int:
        return len(self._windows)

    def observe(self, key: Hashable, value: float, *, down: bool = True) -> float | None:
        """Record ``value``; return the baseline it spiked against, or None.  ``down``: drops
        count too (``judges_drops`` of the series' family)."""
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
            if rule.fires(value, baseline, down=down):
                fired = baseline
        value = float(value)
        if n == rule.window:
            del ordered[bisect.bisect_left(ordered, recent.popleft())]
        recent.append(value)
        bisect.insort(ordered, value)
        return fired


# Series per block of the offline spike matrix: bounds memory at block x longest series floats.
_BLOCK = 4096


def spike_baselines(keys: np.ndarray, values: np.ndarray, rule: SpikeRule) -> np.ndarray:
    """The offline spike baseline: the median of each value's previous ``window`` values of the
    same series, NaN while the series has fewer than ``warmup`` of them (``SpikeTracker``'s
    arithmetic on whole arrays).

    ``keys`` are series ids; ``values`` finite, in step order within a series.  To judge a bucket
    that continues earlier steps, prepend the carried tail (each series' last ``window`` values)
    and drop its rows from the answer.
    """
    order = np.argsort(keys, kind="stable")
    k_sorted, v_sorted = keys[order], values[order]
    starts = np.r_[0, np.flatnonzero(np.diff(k_sorted)) + 1] if len(k_sorted) else np.zeros(0, dtype=int)
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


def spike_hits(values: np.ndarray, baselines: np.ndarray, rule: SpikeRule, *, down: bool) -> np.ndarray:
    """``SpikeRule.fires`` on arrays: which values spiked against their baselines (NaN baseline:
    warm-up, never a hit).  ``down``: judge drops too (``judges_drops`` of the family)."""
    with np.errstate(invalid="ignore", divide="ignore"):  # a zero/NaN baseline: judged below
        return rule.fires(values, baselines, down=down) & ~np.isnan(baselines)


def over_threshold(value, threshold: float):
    """The threshold rule, of a float (the alert sink) or a numpy array (the scan) alike: a finite
    value with ``|v| > threshold`` (NaN compares false; the bound excludes +-inf)."""
    magnitude = abs(value)
    return (magnitude > threshold) & (magnitude < math.inf)
