"""``compare`` of two staged runs: DuckDB aligns the rows, ``compare.judge`` judges them.

Both runs are staged (``engine_buckets.StagedRun``); each family's rows are joined on
``compare``'s alignment key (the target's names mapped onto the base's through the wrapper-prefix
matching, ``compare.plan_families``) one group of ranks/steps at a time, so memory follows the
group, not the run.  Each aligned group comes back as one frame and goes through the one
comparison rule, ``compare.judge`` (relative differences, tolerances, worst op, NaN/Inf): no rule
is written here.  Between groups only each family's largest differences and each rank's first
diverged row are kept.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from trainmon.analysis.flow import PHASES, phase_of
from trainmon.diagnosis import engine, sql
from trainmon.diagnosis.cluster import map_buckets
from trainmon.diagnosis.compare import (
    ALIGN_KEYS,
    Comparison,
    FamilyPlan,
    SliceResult,
    family_part,
    finish_comparison,
    first_per_rank,
    judge,
    largest_rows,
    plan_families,
)
from trainmon.diagnosis.engine import Engine, RunFiles
from trainmon.diagnosis.engine_buckets import GROUP, Span, StagedRun, consecutive_runs
from trainmon.diagnosis.reader import numel_column
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
    """``compare.compare_runs`` of two runs' files, aligned in the engine; ``duplicates``: the
    ``reader.DuplicateKeys`` of base and of target, to add each run's repeated keys to;
    ``cluster``: the Dask scheduler the groups are aligned and judged on (``cluster.map_buckets``)."""
    dup_b, dup_t = duplicates if duplicates is not None else (None, None)
    with Engine(threads) as eng:
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
    # For a connection of the task's own (a worker's): the target -> base name codes, base numels
    name_map: tuple[tuple[int, int], ...] = ()
    numels: tuple[float, ...] = ()


def _tasks(
    con, b: StagedRun, t: StagedRun, family: str, plan: FamilyPlan, groups: list[Span], limits, remote: bool
) -> list[AlignGroup]:
    """The family's groups as tasks; ``name_map`` (and ``b_numel``, filled by ``engine_compare``)
    are tables of ``con`` for tasks run here, values of each task for a worker."""
    code_b = {name: i for i, name in enumerate(b.texts["name"])}
    code_t = {name: i for i, name in enumerate(t.texts["name"])}
    pairs = [(code_t[tn], code_b[bn]) for tn, bn in plan.names.items() if tn in code_t and bn in code_b]
    sql.fill_table(con, "name_map", {"tname": "INTEGER", "name": "INTEGER"}, pairs)
    numels = tuple(r[0] for r in con.execute("SELECT numel FROM b_numel ORDER BY shape").fetchall()) if remote else ()
    flow, order = PHASES.index(phase_of(family)), b.families.index(family)
    return [
        AlignGroup(
            family,
            f"(SELECT * FROM {b.source(family, span)} WHERE {span.sql()})",
            f"(SELECT * FROM {t.source(family, span)} WHERE {span.sql()})",
            plan,
            flow,
            order,
            limits,
            tuple(pairs) if remote else (),
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
    sql.fill_table(con, "name_map", {"tname": "INTEGER", "name": "INTEGER"}, list(group.name_map))
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
    """The group's rows in both runs, joined on the alignment key: base's keys, ``numel`` and ops
    (empty cells NaN), target's ops as ``op@t``, names as codes (``name``: base's,
    ``target_name``: target's)."""
    ops = list(group.plan.ops)
    num = lambda run, op, alias: f"COALESCE({run}.{sql.quote(op)}, 'NaN'::DOUBLE) AS {sql.quote(alias)}"  # noqa: E731
    grp = f"COALESCE(CAST(bb.{sql.quote(GROUP)} AS BIGINT), -1)" if group.plan.grouped else "-2"
    cols = ", ".join(f"{num('bb', op, op)}, {num('tt', op, op + '@t')}" for op in ops)
    return con.execute(f"""
        SELECT bb.step, bb.micro_step, bb.position, bb.rank, bb.occurrence, bb.vpp_stage, bb.name,
               tt.tname AS target_name, {grp} AS "group", n.numel, {cols}
        FROM {group.base_rows} bb
        LEFT JOIN b_numel n ON n.shape = bb.shape
        JOIN (SELECT s.* EXCLUDE (name), m.name, s.name AS tname FROM {group.target_rows} s
              JOIN name_map m ON m.tname = s.name) tt USING ({", ".join(ALIGN_KEYS)})""").fetchdf()
