"""``compare`` of two staged runs: DuckDB stages and groups the rows, ``compare`` pairs and judges them.

Both runs are staged (``engine_buckets.StagedRun``); each family's rows are read one group of
ranks/steps at a time (``_align_groups``), so memory follows the group, not the run.  A group's
rows of both runs are paired by the one alignment rule, ``compare.align`` (the target's names
mapped onto the base's through the wrapper-prefix matching of ``compare.plan_families``, as name
codes), and judged by the one comparison rule, ``compare.judge`` (relative differences,
tolerances, worst op, NaN/Inf): no rule is written here.  Between groups only each family's
largest differences and each rank's first diverged row are kept.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from trainmon.analysis.flow import phase_of, phase_rank
from trainmon.diagnosis import engine, sql
from trainmon.diagnosis.cluster import map_buckets
from trainmon.diagnosis.compare import (
    ALIGN_KEYS,
    Comparison,
    FamilyPlan,
    SliceResult,
    align,
    family_part,
    finish_comparison,
    first_per_rank,
    judge,
    largest_rows,
    plan_families,
)
from trainmon.diagnosis.engine import Engine, RunFiles
from trainmon.diagnosis.engine_buckets import Span, StagedRun, consecutive_runs
from trainmon.diagnosis.reader import GROUP_COLUMN, numel_column
from trainmon.families import NOT_SCALAR

__all__ = ["engine_compare"]


def engine_compare(
    base: RunFiles,
    target: RunFiles,
    *,
    rtol: float = 1e-3,
    atol: float = 0.0,
    ops: Sequence[str] | None = None,
    top: int = 5,
    threads: int | None = None,
    progress=None,
    duplicates: tuple | None = None,
    cluster: str | None = None,
) -> Comparison:
    """Two runs' files compared (stages and first divergence: ``compare``); ``duplicates``: the
    ``reader.DuplicateKeys`` of base and of target, to add each run's repeated keys to;
    ``cluster``: the Dask scheduler the groups are aligned and judged on (``cluster.map_buckets``)."""
    dup_b, dup_t = duplicates if duplicates is not None else (None, None)
    with Engine(threads, files_only=cluster is not None) as eng:
        con = eng.con
        b, t = (
            StagedRun(
                eng,
                run,
                prefix,
                families=[f for f in run.family_stats if f not in NOT_SCALAR],
                progress=progress,
                duplicates=dups,
            )
            for run, prefix, dups in ((base, "b", dup_b), (target, "t", dup_t))
        )

        b_names, t_names = b.names(), t.names()
        plans = plan_families(b.family_stats, t.family_stats, ops, lambda f: (b_names[f], t_names[f]), b.grouped)
        _numels(con, "b", b.texts["shape"])
        groups = {f: _align_groups(con, b.source(f)) for f in b.families if f in t.families and f in plans}
        if progress is not None:
            progress.phase("compare: aligning", sum(len(g) for g in groups.values()), "groups")
        total = SliceResult()
        for family in b.families:
            if family not in t.families:
                total.only_in_base += _count(con, b.source(family))
            elif family in plans:
                tasks = _tasks(con, b, t, family, plans[family], groups[family], (rtol, atol, top), cluster is not None)
                judge_here = functools.partial(judge_group, con=con)  # the tables ``_tasks`` filled
                parts = map_buckets(judge_group if cluster else judge_here, tasks, cluster=cluster, progress=progress)
                total.add(_family_total(con, b, t, family, parts, top))
        for family in t.families:
            if family not in b.families:
                total.only_in_target += _count(con, t.source(family))
    return finish_comparison(total, plans, base.path, target.path, rtol=rtol, atol=atol, top=top)


def _count(con, source: str) -> int:
    return int(con.execute(f"SELECT count(*) FROM {source}").fetchone()[0])


def _numels(con, prefix: str, shapes: list[str]) -> None:
    numel = numel_column(pd.Series(shapes, dtype=object)).to_numpy(dtype=float)
    sql.fill_table(con, f"{prefix}_numel", {"shape": "INTEGER", "numel": "DOUBLE"}, list(enumerate(numel.tolist())))


@dataclass(frozen=True)
class AlignGroup:
    """One family's rows of one group of ranks/steps in both staged runs: what aligning and
    judging them needs, as plain values (a Dask worker gets it pickled)."""

    family: str
    base_rows: str  # SQL reading base's staged rows of the group
    target_rows: str
    plan: FamilyPlan
    flow: int  # the family's place in training-flow order (``FLOW_KEYS``)
    order: int
    limits: tuple[float, float, int]  # rtol, atol, top
    names: dict[int, int] = field(default_factory=dict, hash=False)  # target -> base name codes
    numels: tuple[float, ...] = ()  # base numels by shape code, for a connection of the task's own


def _tasks(
    con, b: StagedRun, t: StagedRun, family: str, plan: FamilyPlan, groups: list[Span], limits, remote: bool
) -> list[AlignGroup]:
    """The family's groups as tasks; base's numels are the table ``b_numel`` of ``con`` (filled by
    ``engine_compare``) for tasks run here, values of each task for a worker."""
    code_b = {name: i for i, name in enumerate(b.texts["name"])}
    code_t = {name: i for i, name in enumerate(t.texts["name"])}
    names = {code_t[tn]: code_b[bn] for tn, bn in plan.names.items() if tn in code_t and bn in code_b}
    numels = tuple(r[0] for r in con.execute("SELECT numel FROM b_numel ORDER BY shape").fetchall()) if remote else ()
    flow, order = phase_rank(family), b.families.index(family)
    return [
        AlignGroup(
            family,
            f"(SELECT * FROM {b.source(family, span)} WHERE {span.sql()})",
            f"(SELECT * FROM {t.source(family, span)} WHERE {span.sql()})",
            plan,
            flow,
            order,
            limits,
            names,
            numels,
        )
        for span in groups
    ]


def judge_group(group: AlignGroup, con=None) -> SliceResult:
    """Align one group in DuckDB and judge it with ``compare.judge``: the group's part of the
    comparison (names still as codes).  Without ``con`` (on a Dask worker), in a connection of
    its own, reading the staged files from the shared work directory."""
    own = con is None
    if own:
        con = _task_connection(group)
    try:
        aligned = _aligned(con, group)
    finally:
        if own:
            con.close()
    aligned["flow"], aligned["family_order"], aligned["phase"] = group.flow, group.order, phase_of(group.family)
    rtol, atol, top = group.limits
    return family_part(group.family, judge(aligned, group.family, group.plan.ops, rtol, atol), int(top))


def _task_connection(group: AlignGroup):
    import duckdb

    con = duckdb.connect(":memory:", config={"memory_limit": engine.memory_limit()})
    con.execute("SET enable_progress_bar = false")
    sql.fill_table(con, "b_numel", {"shape": "INTEGER", "numel": "DOUBLE"}, list(enumerate(group.numels)))
    return con


def _family_total(con, b: StagedRun, t: StagedRun, family: str, parts: list[SliceResult], top: int) -> SliceResult:
    """The family's groups' parts added up, in group order, keeping only the top rows and each
    rank's first diverged row; their names as text."""
    out = SliceResult()
    for part in parts:
        _carry(out, part, family, top)
    names_b, names_t = np.asarray(b.texts["name"], dtype=object), np.asarray(t.texts["name"], dtype=object)
    for frame in [*out.largest.get(family, []), *out.firsts]:  # the few rows reported: names as text
        frame["name"] = names_b[frame["name"].to_numpy(dtype=np.int64)]
        frame["target_name"] = names_t[frame["target_name"].to_numpy(dtype=np.int64)]
    # Every target row that found no base row, whether its name has a counterpart or not.
    out.only_in_base = _count(con, b.source(family)) - out.aligned_rows
    out.only_in_target = _count(con, t.source(family)) - out.aligned_rows
    return out


def _carry(out: SliceResult, part: SliceResult, family: str, top: int) -> None:
    """``out.add(part)``, keeping one frame of top rows and one of first rows: a run of billions of
    rows has tens of thousands of groups."""
    out.aligned_rows += part.aligned_rows
    out.diverged_rows += part.diverged_rows
    for key, n in part.aligned.items():
        out.aligned[key] = out.aligned.get(key, 0) + n
    if part.largest:
        out.largest[family] = [largest_rows([*out.largest.get(family, []), *part.largest[family]], top)]
    if part.firsts:
        out.firsts = [first_per_rank([*out.firsts, *part.firsts])]


def _align_groups(con, source: str) -> list[Span]:
    """The base's rows of one family (the view ``source``) in groups of about ``engine.unit_rows()``
    rows: whole ranks together while they fit, and a bigger rank in runs of its steps.  Rows
    align only on equal (rank, step), so a group's join is exact, and its hash table follows the
    group, not the run: a rank of the 100.8M-row run holds 1.05M rows of a family, which did not
    fit a 256 MB cap in one join."""
    counts = con.execute(f"SELECT rank, step, count(*) FROM {source} GROUP BY ALL ORDER BY ALL")
    per_rank: dict[int, list[tuple[int, int]]] = {}
    for rank, step, n in counts.fetchall():
        per_rank.setdefault(int(rank), []).append((int(step), int(n)))
    groups: list[Span] = []
    ranks: list[int] = []  # whole ranks waiting to be a group
    filled = 0
    for rank, steps in per_rank.items():
        rows = sum(n for _, n in steps)
        if ranks and filled + rows > engine.unit_rows():
            groups.append(Span(ranks[0], ranks[-1]))
            ranks, filled = [], 0
        if rows <= engine.unit_rows():
            ranks.append(rank)
            filled += rows
            continue
        for first, last in consecutive_runs(steps, engine.unit_rows()):
            groups.append(Span(rank, rank, first, last))
    if ranks:
        groups.append(Span(ranks[0], ranks[-1]))
    return groups


def _aligned(con, group: AlignGroup) -> pd.DataFrame:
    """The group's rows of both runs as read from the staged files (names as codes, base's with
    ``numel``), paired by the one alignment rule, ``compare.align``."""
    ops = ", ".join(sql.quote(op) for op in group.plan.ops)
    grp = f"bb.{sql.quote(GROUP_COLUMN)}, " if group.plan.grouped else ""
    base = con.execute(f"""
        SELECT bb.step, bb.micro_step, bb.position, bb.rank, bb.occurrence, bb.vpp_stage, bb.name, {grp}
               n.numel, {", ".join(f"bb.{sql.quote(op)}" for op in group.plan.ops)}
        FROM {group.base_rows} bb LEFT JOIN b_numel n ON n.shape = bb.shape""").fetchdf()
    target = con.execute(f"SELECT {', '.join(ALIGN_KEYS)}, {ops} FROM {group.target_rows}").fetchdf()
    return align(base, target, group.names, group.plan.grouped)
