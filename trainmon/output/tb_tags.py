"""TensorBoard naming: where event files go and what each scalar is called.

The native sink (``trainmon.sinks.tensorboard``) and ``trainmon csv2tb`` both name
everything through this module, so a run's events are the same whichever wrote them.

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

import math
import numbers
from collections.abc import Iterable
from pathlib import Path

from trainmon.output.layout import TB_DIRNAME

__all__ = ["TB_DIRNAME", "event_dir", "series_name", "scalar_tag", "split_tag", "extra_text"]


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


def split_tag(tag: str) -> tuple[str, str, str]:
    """``(family, op, series)`` of a tag written by trainmon."""
    group, _, series = tag.partition("/")
    family, _, op = group.rpartition(".")
    if not family or not series:
        raise ValueError(f"not a trainmon tag: {tag!r}")
    return family, op, series
