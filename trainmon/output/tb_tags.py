"""TensorBoard naming: where event files go and what each scalar is called.

The native sink (``trainmon.sinks.tensorboard``) and ``trainmon csv2tb`` both name
everything through this module, so a run's events are the same whichever wrote them.

Two tag layouts (``TensorBoardSettings.tags``; docs/tensorboard.md):

* ``"summary"`` (the default): per family and statistic a few series, whatever the model's size
  (``summary_tag``: ``<family>.<op>/global`` for the norm over the whole family,
  ``/max`` and ``/min`` over its tensors, ``/nonfinite`` the number of tensors whose value is NaN
  or +-inf, ``/sum`` for the ``nans``/``infs`` counts), a histogram of the per-tensor values
  (``histogram_tag``), and per-tensor series only for the tensors ``names`` selects.  A
  400-tensor run lists ~100 tags instead of ~12,000, which TensorBoard loads in well under a second.
* ``"per_tensor"``: one series per (recorded tensor, statistic), below.

Families with a handful of rows (``PER_ROW_FAMILIES``: loss, hyperparams, steps) always get one
series per row; the loss also gets the step-level ``STEP_LOSS_TAG``, the mean of its micro-batches.

Directories: ``<run_dir>/tensorboard/rank<R>/``.  ``tensorboard --logdir <run_dir>`` then
lists one TensorBoard *run* per rank (``tensorboard/rank0``, ``tensorboard/rank1``, ...).

Tags: ``<family>.<op>/<series>`` where the series names one recorded tensor::

    <series> = vp<vpp_stage>:<name>[:<key>=<value> ...][:micro<micro_step>]

TensorBoard groups charts by the text before the first ``/``, so one group holds one
quantity (say ``grad_reduced.norm``) for every layer, sorted in natural order
(``layers.2`` before ``layers.10``): scrolling a group compares layers, and the tag
filter (a regex such as ``layers\\.3\\.``) selects one layer across every group.

Examples (CSV row -> tag, for op ``norm``)::

    grad_reduced, vpp 0, layers.0.attn.qkv.weight      -> grad_reduced.norm/vp0:layers.0.attn.qkv.weight
    actv, vpp 0, layers.0.mlp.output, micro_step 1     -> actv.norm/vp0:layers.0.mlp.output:micro1
    comm, vpp 0, all_reduce, op=all_reduce, call=0     -> comm.norm/vp0:all_reduce:op=all_reduce:call=0

``extra`` columns (comm's op, call index, phase, argument position, ...) are appended
in column order as ``:<key>=<value>``; values are written as the CSV writes them, except
that a float holding an integer is written as that integer (``3.0`` -> ``3``: an int
column with an empty cell reads back from CSV as floats) and NaN as the empty string.
"""

from __future__ import annotations

import fnmatch
import math
import numbers
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from trainmon.output.layout import TB_DIRNAME

__all__ = [
    "TB_DIRNAME",
    "TAG_LAYOUTS",
    "PER_ROW_FAMILIES",
    "COUNT_OPS",
    "STEP_LOSS_TAG",
    "PROBE_HISTOGRAM_TAG",
    "TensorBoardSettings",
    "event_dir",
    "series_name",
    "scalar_tag",
    "extra_text",
    "summary_aggregates",
    "summary_tag",
    "histogram_tag",
    "chart_regex",
    "NameFilter",
]

TAG_LAYOUTS = ("summary", "per_tensor")
# Families of a few rows per step (no per-tensor explosion): one series per row in every layout.
PER_ROW_FAMILIES = frozenset({"loss", "hyperparams", "steps"})
COUNT_OPS = frozenset({"nans", "infs"})  # integer counts: summed over tensors, not min/max'ed
STEP_LOSS_TAG = "loss.loss/step"  # the mean of a step's micro-batch losses
PROBE_HISTOGRAM_TAG = "grad_probe/intervals"  # grad elements per interval of grad_probe.bounds
_HISTOGRAM_SERIES = "layers"


@dataclass(frozen=True)
class TensorBoardSettings:
    """The ``"tensorboard"`` config block (the native sink's ``settings_schema``) and ``csv2tb``'s
    options: ``tags`` is ``"summary"`` or ``"per_tensor"``; ``names`` are glob patterns
    (``fnmatch``, e.g. ``"layers.0.*"``) of tensors that also get per-tensor series in the summary
    layout; ``histograms`` writes the per-tensor distributions."""

    tags: str = "summary"
    names: tuple[str, ...] = ()
    histograms: bool = True

    def __post_init__(self) -> None:
        if self.tags not in TAG_LAYOUTS:
            close = [t for t in TAG_LAYOUTS if t[:3] == str(self.tags)[:3]]
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(
                f"tensorboard.tags: {self.tags!r} is not a tag layout ({hint}allowed: summary, per_tensor)"
            )
        names = (self.names,) if isinstance(self.names, str) else self.names
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"tensorboard.names: {self.names!r} is not a list of non-empty name patterns")
        if not isinstance(self.histograms, bool):
            raise ValueError(f"tensorboard.histograms: {self.histograms!r} is not true or false")
        object.__setattr__(self, "names", tuple(names))

    @property
    def per_tensor(self) -> bool:
        return self.tags == "per_tensor"


class NameFilter:
    """Which tensor names get per-tensor series besides the summary (cached: names repeat every step)."""

    def __init__(self, patterns: Iterable[str]):
        self.patterns = tuple(patterns)
        self._regex = re.compile("|".join(fnmatch.translate(p) for p in self.patterns)) if self.patterns else None
        self._seen: dict[str, bool] = {}

    def __bool__(self) -> bool:
        return self._regex is not None

    def __call__(self, name: str) -> bool:
        hit = self._seen.get(name)
        if hit is None:
            hit = self._seen[name] = self._regex is not None and self._regex.match(str(name)) is not None
        return hit


def event_dir(run_dir: str | Path, rank_dir_name: str) -> Path:
    """The event directory of one rank: ``<run_dir>/tensorboard/<rank_dir_name>``."""
    return Path(run_dir) / TB_DIRNAME / rank_dir_name


def extra_text(value: object) -> str:
    """An ``extra`` value as it appears in a tag (identical for a live value and its CSV cell)."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        v = float(value)
        if math.isnan(v):
            return ""  # an empty CSV cell reads back as NaN
        return str(int(v)) if v.is_integer() else repr(v)
    return str(value)


def series_name(
    vpp_stage: int, name: str, extra: Iterable[tuple[str, object]] = (), micro_step: int | None = None
) -> str:
    """The part of a tag after ``<family>.<op>/`` naming one recorded tensor."""
    parts = [f"vp{int(vpp_stage)}:{name}"]
    parts.extend(f":{k}={extra_text(v)}" for k, v in extra)
    if micro_step is not None:
        parts.append(f":micro{int(micro_step)}")
    return "".join(parts)


def scalar_tag(family: str, op: str, series: str) -> str:
    return f"{family}.{op}/{series}"


def summary_aggregates(op: str) -> tuple[str, ...]:
    """The summary series of one statistic, in the order they are written."""
    if op in COUNT_OPS:
        return ("sum", "max")
    if op == "norm":
        return ("global", "max", "min", "nonfinite")
    return ("max", "min", "nonfinite")


def summary_tag(family: str, op: str, aggregate: str) -> str:
    """``<family>.<op>/<aggregate>``: in the chart group of the per-tensor series of that statistic."""
    return f"{family}.{op}/{aggregate}"


def histogram_tag(family: str, op: str) -> str:
    """The distribution of a statistic over a family's tensors, one histogram per step."""
    return f"{family}.{op}/{_HISTOGRAM_SERIES}"


def chart_regex(family: str, op: str) -> str:
    """The custom-scalars chart of one family and statistic: every series of ``<family>.<op>``."""
    return "^" + re.escape(f"{family}.{op}/")
