"""Reading a run directory's CSVs into one table that knows the training flow.

A *run table* has one row per CSV row of every rank and family, with the stats as columns
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
extra:<col>    columns a family adds between step/micro_step and its stats (comm)
============== ==================================================================

Sorting by ``flow.FLOW_KEYS`` gives training-flow order.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import pandas as pd

from trainmon.analysis.flow import FLOW_KEYS, PHASES, family_rank, phase_of
from trainmon.errors import TrainmonError
from trainmon.output import runs

__all__ = [
    "RunDirError",
    "DuplicateKeys",
    "duplicate_keys",
    "FamilyStatsView",
    "RunTable",
    "resolve_run_dir",
    "ranked_dirs",
    "read_stats_family",
    "load_run",
    "EXTRA_PREFIX",
    "GROUP_COLUMN",
    "numel_column",
]

log = logging.getLogger(__name__)

EXTRA_PREFIX = "extra:"
GROUP_COLUMN = EXTRA_PREFIX + "group"  # a hyperparams row's optimizer param group (an extra)


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
    # Everything the run holds, whatever ``load_run`` was asked to read: what a command names
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
    again.  ``anomalies``, ``ranks`` and ``compare`` report it as a finding of its own; both
    engines fill it alike (``duplicate_keys``; the engine's ``_Family``)."""

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


def duplicate_keys(table: RunTable, families: Sequence[str] | None = None) -> DuplicateKeys:
    """The repeated keys of a run table (:class:`DuplicateKeys`); ``families``: only these."""
    out = DuplicateKeys()
    frame = table.frame
    if frame.empty or "occurrence" not in frame or not (frame["occurrence"] > 0).any():
        return out  # every name once per (rank, family, step, micro_step): nothing repeats
    for family in table.families:
        if families is not None and family not in families:
            continue
        part = table.family(family)
        if not (part["occurrence"] > 0).any():
            continue
        extras = [c for c in part.columns if c.startswith(EXTRA_PREFIX) and part[c].notna().any()]
        keys = ["rank", "vpp_stage", "name", "step", "micro_step", *extras]
        repeated = part.duplicated(keys)
        if not repeated.any():
            continue  # names repeat, but each with its own extra values (comm calls)
        rows = part[part.duplicated(keys, keep=False)]
        first = rows.sort_values(["step", "micro_step", "rank", "vpp_stage", "name"], kind="mergesort").iloc[0]
        same = (rows[keys] == first[keys]) | (rows[keys].isna() & first[keys].isna())
        out.add(
            family,
            int(repeated.sum()),
            first["rank"],
            first["vpp_stage"],
            first["name"],
            first["step"],
            first["micro_step"],
            int(same.all(axis=1).sum()),
        )
    return out


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


# ----------------------------------------------------------------------------- reading


def read_stats_family(rank_dir: str | Path, family: str) -> tuple[pd.DataFrame, list[str]]:
    """One family of one rank as written (``trainmon.output.runs``), plus its stat columns in order."""
    frame = runs.read_family(rank_dir, family)
    if frame.empty:
        return frame, []
    roles = runs.column_roles(frame)
    frame = frame.rename(columns={c: EXTRA_PREFIX + c for c in roles.extras})
    for c in roles.stats:
        frame[c] = pd.to_numeric(frame[c], errors="coerce").astype(float)
    return frame, list(roles.stats)


def _numel(shape: str) -> float:
    try:
        dims = [int(d) for d in shape.strip().strip("[]").split(",") if d.strip()]
    except (AttributeError, ValueError):
        return math.nan
    return float(math.prod(dims))


def _annotate(frame: pd.DataFrame, rank: int, family: str, order: int) -> pd.DataFrame:
    frame = frame.copy()
    frame["rank"] = rank
    frame["family"] = family
    frame["micro_step"] = frame["micro_step"].fillna(-1).astype(int) if "micro_step" in frame else -1
    frame["vpp_stage"] = frame["vpp_stage"].fillna(0).astype(int) if "vpp_stage" in frame else 0
    frame["step"] = frame["step"].astype(int)
    for col in ("shape", "dtype"):
        if col not in frame:
            frame[col] = ""
    frame["phase"] = phase_of(family)
    frame["flow"] = PHASES.index(phase_of(family))
    frame["family_order"] = order
    frame["position"] = frame.groupby(["step", "micro_step"], sort=False).cumcount()
    same = ["step", "micro_step", "vpp_stage", "name"]
    # Names repeat within a step only for comm calls: skip the costly string grouping otherwise.
    frame["occurrence"] = frame.groupby(same, sort=False).cumcount() if frame.duplicated(same).any() else 0
    frame["numel"] = numel_column(frame["shape"])
    return frame


def numel_column(shapes: pd.Series) -> pd.Series:
    """The run table's ``numel`` of each ``shape`` text (NaN where unreadable)."""
    # Few distinct shapes, many rows: parse each shape once.
    return shapes.map({s: _numel(s) for s in shapes.unique()})


def load_run(
    path: str | Path, *, families: Sequence[str] | None = None, ranks: Sequence[int] | None = None, progress=None
) -> RunTable:
    """Read every (or the chosen) family of every (or the chosen) rank of a run.

    ``progress`` (``trainmon.cli._progress.Progress`` or anything with ``total`` and
    ``update(files=, rows=)``) hears of each (rank, family) read.
    """
    run_dir = resolve_run_dir(path)
    parts: list[pd.DataFrame] = []
    family_stats: dict[str, list[str]] = {}
    every = ranked_dirs(run_dir)
    files = {rank: runs.family_files(rdir) for rank, rdir in every}
    if not any(files.values()):
        raise RunDirError(f"{run_dir}: nothing recorded (its rank folders hold no <family>_<a>-<b>.csv file)")
    on_disk = tuple(sorted({f for fams in files.values() for f in fams}, key=lambda f: (family_rank(f), f)))
    chosen = [(rank, rdir) for rank, rdir in every if ranks is None or rank in ranks]
    names = {f for rank, _ in chosen for f in files[rank] if families is None or f in families}
    # Known families by flow; unknown ones after them, by name: one integer sort key.
    order = {f: i for i, f in enumerate(sorted(names, key=lambda f: (family_rank(f), f)))}
    if progress is not None:
        progress.total = sum(len(fs) for rank, _ in chosen for f, fs in files[rank].items() if f in order)
    for rank, rdir in chosen:
        for family, family_paths in files[rank].items():
            if family not in order:
                continue
            frame, stats = read_stats_family(rdir, family)
            if progress is not None:
                progress.update(files=len(family_paths), rows=len(frame))
            if frame.empty:
                continue
            parts.append(_annotate(frame, rank, family, order[family]))
            known = family_stats.setdefault(family, [])
            known += [c for c in stats if c not in known]
    if not parts:
        frame = pd.DataFrame(columns=[*FLOW_KEYS, "family", "vpp_stage", "name", "phase", "shape", "dtype", "numel"])
    else:
        frame = pd.concat(parts, ignore_index=True, sort=False)
        frame = frame.sort_values(list(FLOW_KEYS), kind="mergesort", ignore_index=True)
    ordered = sorted(family_stats, key=lambda fam: (family_rank(fam), fam))
    return RunTable(
        path=run_dir,
        frame=frame,
        family_stats={f: tuple(family_stats[f]) for f in ordered},
        families_on_disk=on_disk,
        ranks_on_disk=tuple(rank for rank, _ in every),
    )
