"""The run table the checks read, and how a run directory is found.

A *run table* (built by ``engine_buckets.load_table`` for a whole run, ``read_bucket`` for one
bucket of names: the files are read and ordered in one place, the engine's staging) has one row
per recorded row of every rank and family, with the stats as columns
(``norm``, ``mean``, ... -- the union over families, NaN where a family lacks one) and these
identity and ordering columns:

============== ==================================================================
column         meaning
============== ==================================================================
rank           from the ``rank<R>`` directory name
family         CSV family (``grad_reduced``, ``actv``, ...)
vpp_stage      model chunk
name           tensor name as written
step           optimizer step
micro_step     micro-batch index; -1 for families recorded once per step
occurrence     n-th row with this name in its (rank, family, step, micro_step); >0 only
               for repeated names such as comm calls
position       row index inside its (rank, family, step, micro_step): order in the phase
phase / flow   ``flow.phase_of(family)`` and its index in ``flow.PHASES``
family_order   ``flow.family_rank(family)``, made unique (unknown families by name)
shape, dtype   as written; ``numel`` is the product of the shape (NaN if unreadable)
extra:group    a ``hyperparams`` row's optimizer param group (NaN elsewhere)
============== ==================================================================

Sorting by ``flow.FLOW_KEYS`` gives training-flow order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import pandas as pd

from trainmon.analysis.flow import family_rank
from trainmon.errors import TrainmonError
from trainmon.output import runs

__all__ = [
    "RunDirError",
    "DuplicateKeys",
    "FamilyStatsView",
    "RunTable",
    "resolve_run_dir",
    "ranked_dirs",
    "GROUP_COLUMN",
    "numel_column",
]

GROUP_COLUMN = "extra:group"  # a hyperparams row's optimizer param group (an extra column)


class RunDirError(TrainmonError):
    """A path that is not (or holds not exactly one) trainmon run directory."""


class FamilyStatsView:
    """``families`` and ``stats`` of anything with a ``family_stats`` mapping (family -> its stat
    columns): the run table and the engine's file listing answer them alike."""

    family_stats: dict[str, tuple[str, ...]]

    @property
    def families(self) -> tuple[str, ...]:
        return tuple(self.family_stats)

    @property
    def stats(self) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for cols in self.family_stats.values():
            seen.update(dict.fromkeys(cols))
        return tuple(seen)


@dataclass
class RunTable(FamilyStatsView):
    """Every recorded row of a run (see the module docstring for the columns)."""

    path: Path
    frame: pd.DataFrame
    family_stats: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Everything the run holds, whatever was asked to be read: what a command names
    # when an asked-for family or rank is not there.
    families_on_disk: tuple[str, ...] = ()
    ranks_on_disk: tuple[int, ...] = ()
    _split: tuple[pd.DataFrame, dict[str, pd.DataFrame]] | None = field(default=None, repr=False, compare=False)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(int(r) for r in self.frame["rank"].unique()))

    def family(self, family: str) -> pd.DataFrame:
        """The rows of ``family``, in table order (``frame[frame.family == family]``).  The table
        is split by family once (commands ask for each family many times; comparing the text
        column each time was ~11% of ``ranks`` on a large run); a new ``frame`` splits again."""
        if self._split is None or self._split[0] is not self.frame:
            groups = self.frame.groupby("family", sort=False, observed=True).indices
            self._split = (self.frame, {f: self.frame.iloc[rows] for f, rows in groups.items()})
        part = self._split[1].get(family)
        return part if part is not None else self.frame.iloc[0:0]


@dataclass
class DuplicateKeys:
    """Rows whose key -- (rank, family, vpp_stage, name, step, micro_step) and a family's
    ``extra`` columns (a comm call, an optimizer param group) -- an earlier row of the run already
    has.  The sinks write each key once, so a repeated one is two runs in one folder: typically a
    resumed job that reused ``TRAINMON_RUN_ID`` without ``start_iteration`` and wrote its steps
    again.  ``anomalies``, ``ranks`` and ``compare`` report it as a finding of its own;
    the engine's staging fills it (``sql.Family``)."""

    count: int = 0  # rows beyond the first of their key
    first: dict[str, object] | None = None  # the first repeated key (step, family flow, micro_step, rank, ...)
    _order: tuple = field(default=(), repr=False, compare=False)

    def add(self, family: str, count: int, rank, vpp_stage, name, step, micro_step, copies) -> None:
        """``count`` more repeated rows of ``family``; the key given is its first repeated one."""
        if count <= 0:
            return
        self.count += int(count)
        order = (int(step), family_rank(family), family, int(micro_step), int(rank), int(vpp_stage), str(name))
        if self.first is None or order < self._order:
            self._order = order
            self.first = {
                "rank": int(rank),
                "family": family,
                "vpp_stage": int(vpp_stage),
                "name": str(name),
                "step": int(step),
                "micro_step": None if int(micro_step) < 0 else int(micro_step),
                "copies": int(copies),
            }

    def extend(self, other: DuplicateKeys) -> None:
        """Add ``other``'s repeated keys (another part of the same run)."""
        if other.count and other.first is not None:
            f = other.first
            micro = -1 if f["micro_step"] is None else f["micro_step"]
            self.add(str(f["family"]), other.count, f["rank"], f["vpp_stage"], f["name"], f["step"], micro, f["copies"])

    def to_json(self) -> dict[str, object]:
        return {"count": self.count, "first": self.first}

    def describe(self) -> str:
        """One line for the text reports ('' when no key repeats)."""
        if not self.count or self.first is None:
            return ""
        f = self.first
        micro = "" if f["micro_step"] is None else f" micro_step {f['micro_step']}"
        return (
            f"duplicate keys: {self.count} rows repeat a (rank, family, name, step, micro_step) recorded before; "
            f"first: step {f['step']}{micro}, {f['family']} {f['name']!r}, rank {f['rank']} ({f['copies']} copies) "
            "-- two runs wrote into one run folder (a resumed job that reused TRAINMON_RUN_ID without "
            "start_iteration?)"
        )


# ----------------------------------------------------------------------------- discovery


def ranked_dirs(run_dir: str | Path) -> list[tuple[int, Path]]:
    """``(rank, dir)`` of every rank directory, by rank; ``run_dir`` may be one rank dir."""
    path = Path(run_dir)
    own = runs.rank_of(path)
    if own is not None and runs.family_files(path):
        return [(own, path)]
    return [(cast(int, runs.rank_of(d)), d) for d in runs.rank_dirs(path)]  # rank_dirs: rank<R> dirs only


def resolve_run_dir(path: str | Path) -> Path:
    """The run directory ``path`` names: itself, a rank dir, or the only run below an output dir."""
    p = Path(path)
    try:
        found = runs.find_runs(p)
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise RunDirError(str(exc)) from None
    if len(found) == 1:
        return found[0]
    if runs.rank_of(p) is not None and runs.family_files(p):
        return p
    if len(found) > 1:
        names = ", ".join(str(r.relative_to(p)) for r in found[:5]) + (", ..." if len(found) > 5 else "")
        raise RunDirError(f"{p} holds {len(found)} runs ({names}); pass one of them")
    raise RunDirError(f"{p}: no trainmon run here (expected rank<R>/ directories with <family>_<a>-<b>.csv files)")


def _numel(shape: str) -> float:
    try:
        dims = [int(d) for d in shape.strip().strip("[]").split(",") if d.strip()]
    except (AttributeError, ValueError):
        return math.nan
    return float(math.prod(dims))


def numel_column(shapes: pd.Series) -> pd.Series:
    """The run table's ``numel`` of each ``shape`` text (NaN where unreadable)."""
    # Few distinct shapes, many rows: parse each shape once.
    return shapes.map({s: _numel(s) for s in shapes.unique()})
