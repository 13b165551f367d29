"""``compare`` in the engine: the two runs' rows aligned and compared inside DuckDB.

Both runs are staged (``engine_buckets.StagedRun``); each family's rows are joined on
``compare``'s alignment key (the target's names mapped onto the base's through the wrapper-prefix
matching, ``compare.plan_families``), and every relative difference, tolerance test and worst op
is computed in SQL with ``compare.rel_diff``'s rules (NaN/Inf included).  Only what the result
needs comes back to Python: row counts per rank, each family's largest differences and each
rank's first diverged row.  The result equals ``compare.compare_runs`` on the same runs (tested on
the diagnosis fault runs, CSV and Parquet).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from trainmon.analysis.flow import FLOW_KEYS, PHASES, phase_of
from trainmon.diagnosis import engine
from trainmon.diagnosis.compare import (
    ALIGN_KEYS,
    Comparison,
    FamilyPlan,
    SliceResult,
    finish_comparison,
    plan_families,
    stage_of,
)
from trainmon.diagnosis.engine import Engine, RunFiles, _q
from trainmon.diagnosis.engine_buckets import GROUP, Span, StagedRun, consecutive_runs
from trainmon.diagnosis.reader import numel_column
from trainmon.families import NOT_SCALAR

__all__ = ["engine_compare"]

# FLOW_KEYS within one family (``flow`` and ``family_order`` are the same on every row)
_ORDER = ", ".join(k for k in FLOW_KEYS if k not in ("flow", "family_order"))


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
) -> Comparison:
    """``compare.compare_runs`` of two runs' files, aligned in the engine; ``duplicates``: the
    ``reader.DuplicateKeys`` of base and of target, to add each run's repeated keys to."""
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
                part = _family(
                    con, b, t, family, plans[family], groups[family], rtol=rtol, atol=atol, top=top, progress=progress
                )
                total.add(part)
        for family in t.families:
            if family not in b.families:
                total.only_in_target += _count(con, t.source(family))
    return finish_comparison(total, plans, base.path, target.path, rtol=rtol, atol=atol, top=top)


def _count(con, source: str) -> int:
    return int(con.execute(f"SELECT count(*) FROM {source}").fetchone()[0])


def _numels(con, prefix: str, shapes: list[str]) -> None:
    numel = numel_column(pd.Series(shapes, dtype=object)).to_numpy(dtype=float)
    engine._fill(con, f"{prefix}_numel", {"shape": "INTEGER", "numel": "DOUBLE"}, list(enumerate(numel.tolist())))


def _rel(b: str, t: str, scale: str) -> str:
    """``compare.rel_diff`` in SQL (``scale`` is finite)."""
    den = f"greatest(abs({b}), abs({t}), {scale})"
    return f"""(CASE WHEN isfinite({b}) AND isfinite({t})
                     THEN (CASE WHEN {den} = 0 THEN 0.0 ELSE abs({t} - {b}) / {den} END)
                     WHEN (isnan({b}) AND isnan({t})) OR (isinf({b}) AND {b} = {t}) THEN 0.0
                     ELSE 'inf'::DOUBLE END)"""


def _family(
    con,
    b: StagedRun,
    t: StagedRun,
    family: str,
    plan: FamilyPlan,
    groups: list[Span],
    *,
    rtol: float,
    atol: float,
    top: int,
    progress=None,
) -> SliceResult:
    """One family's part of the comparison, aligned one group of rows at a time (``groups``, from
    ``_align_groups``)."""
    code_b = {name: i for i, name in enumerate(b.texts["name"])}
    code_t = {name: i for i, name in enumerate(t.texts["name"])}
    engine._fill(
        con,
        "name_map",
        {"tname": "INTEGER", "name": "INTEGER"},
        [(code_t[tn], code_b[bn]) for tn, bn in plan.names.items() if tn in code_t and bn in code_b],
    )
    out = SliceResult()
    for k, group in enumerate(groups):
        out.add(_group_part(con, b, t, family, plan, group, rtol=rtol, atol=atol, top=top, first=k == 0))
        if progress is not None:
            progress.advance()
    if out.aligned_rows:
        # The family's top rows and each rank's first diverged row, from the groups' candidates:
        # one frame each, not one per group (a run of billions of rows has tens of thousands of groups).
        frame = lambda sql: _frame(con.execute(sql).fetchdf(), b, t, family, list(plan.ops))  # noqa: E731
        out.largest[family] = [frame(f"SELECT * FROM top_rows ORDER BY rel_diff DESC, {_ORDER} LIMIT {int(top)}")]
        if out.diverged_rows:
            out.firsts.append(
                frame(f"""SELECT * FROM first_rows
                QUALIFY row_number() OVER (PARTITION BY rank ORDER BY {_ORDER}) = 1 ORDER BY {_ORDER}""")
            )
    con.execute("DROP TABLE IF EXISTS top_rows")
    con.execute("DROP TABLE IF EXISTS first_rows")
    # Every target row that found no base row, whether its name has a counterpart or not.
    out.only_in_base = _count(con, b.source(family)) - out.aligned_rows
    out.only_in_target = _count(con, t.source(family)) - out.aligned_rows
    return out


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


def _group_part(
    con,
    b: StagedRun,
    t: StagedRun,
    family: str,
    plan: FamilyPlan,
    span: Span,
    *,
    rtol: float,
    atol: float,
    top: int,
    first: bool,
) -> SliceResult:
    """The family's rows of ``span`` (some ranks, maybe some of their steps) aligned in the table
    ``cmp``, then their counts; its largest differences and each rank's first diverged row go into
    the tables ``top_rows`` and ``first_rows`` (made by the ``first`` group of the family)."""
    ops = list(plan.ops)
    num = lambda run, op: f"COALESCE({run}.{_q(op)}, 'NaN'::DOUBLE)"  # noqa: E731 - empty cells are NaN
    rms = (
        "(CASE WHEN isfinite(bb.norm / sqrt(n.numel)) THEN bb.norm / sqrt(n.numel) ELSE 0.0 END)"
        if "norm" in ops
        else "0.0"
    )
    group = f"COALESCE(CAST(bb.{_q(GROUP)} AS BIGINT), -1)" if plan.grouped else "-2"
    cols = ", ".join(f"{num('bb', op)} AS b{i}, {num('tt', op)} AS t{i}" for i, op in enumerate(ops))
    rel = [_rel(f"b{i}", f"t{i}", "0.0" if op == "norm" else "scale") for i, op in enumerate(ops)]
    over = [f"(r{i} > {float(rtol)!r} AND NOT (abs(t{i} - b{i}) <= {float(atol)!r}))" for i in range(len(ops))]
    score = [
        f"((CASE WHEN o{i} THEN 2.0 ELSE 0.0 END) + (CASE WHEN isinf(r{i}) THEN 1.0 ELSE r{i} / (1 + r{i}) END))"
        for i in range(len(ops))
    ]
    n = len(ops)
    best = "s0" if n == 1 else f"greatest({', '.join(f's{i}' for i in range(n))})"
    pick = "CASE " + " ".join(f"WHEN s{i} = m THEN {i}" for i in range(n)) + " END"  # the first worst op

    def chosen(prefix: str) -> str:
        return "CASE k " + " ".join(f"WHEN {i} THEN {prefix}{i}" for i in range(n)) + " END"

    joined = f"""
        SELECT bb.step, bb.micro_step, bb.position, bb.rank, bb.occurrence, bb.vpp_stage, bb.name,
               tt.tname, {group} AS grp, {rms} AS scale, {cols}
        FROM (SELECT * FROM {b.source(family, span)} WHERE {span.sql()}) bb
        LEFT JOIN b_numel n ON n.shape = bb.shape
        JOIN (SELECT s.* EXCLUDE (name), m.name, s.name AS tname FROM {t.source(family, span)} s
              JOIN name_map m ON m.tname = s.name WHERE {span.sql()}) tt USING ({", ".join(ALIGN_KEYS)})"""
    # One statement: the aligned rows are never a table of their own (a group's copy less in memory).
    con.execute(f"""CREATE OR REPLACE TEMP TABLE cmp AS WITH aligned AS ({joined})
        SELECT step, micro_step, position, rank, occurrence, vpp_stage, name, tname, grp, k,
               {chosen("b")} AS base, {chosen("t")} AS target, {chosen("r")} AS rel_diff, diverged
        FROM (SELECT *, {pick} AS k FROM (
            SELECT *, {best} AS m, {" OR ".join(f"o{i}" for i in range(n))} AS diverged
            FROM (SELECT *, {", ".join(f"{x} AS s{i}" for i, x in enumerate(score))} FROM (
                SELECT *, {", ".join(f"{x} AS o{i}" for i, x in enumerate(over))} FROM (
                    SELECT *, {", ".join(f"{x} AS r{i}" for i, x in enumerate(rel))} FROM aligned)))))""")
    out = SliceResult()
    per_rank = con.execute("SELECT rank, count(*), count(*) FILTER (WHERE diverged) FROM cmp GROUP BY rank").fetchall()
    aligned = sum(int(n) for _, n, _ in per_rank)
    out.aligned_rows = aligned
    out.diverged_rows = sum(int(d) for _, _, d in per_rank)
    for rank, n, _ in per_rank:
        out.aligned[(stage_of(family), int(rank))] = int(n)
    # This group's candidates for the family's top rows and each rank's first diverged row.
    make = "CREATE OR REPLACE TEMP TABLE {} AS" if first else "INSERT INTO {}"
    con.execute(f"{make.format('top_rows')} SELECT * FROM cmp ORDER BY rel_diff DESC, {_ORDER} LIMIT {int(top)}")
    con.execute(f"""{make.format("first_rows")} SELECT * FROM cmp WHERE diverged
        QUALIFY row_number() OVER (PARTITION BY rank ORDER BY {_ORDER}) = 1""")
    con.execute("DROP TABLE cmp")
    return out


def _frame(rows: pd.DataFrame, b: StagedRun, t: StagedRun, family: str, ops: list[str]) -> pd.DataFrame:
    """Rows of ``cmp`` in the columns ``compare.finish_comparison`` reads (``_difference``, FLOW_KEYS)."""
    names_b, names_t = np.asarray(b.texts["name"], dtype=object), np.asarray(t.texts["name"], dtype=object)
    phase = phase_of(family)
    return pd.DataFrame(
        {
            "step": rows["step"].to_numpy(dtype=np.int64),
            "flow": PHASES.index(phase),
            "micro_step": rows["micro_step"].to_numpy(dtype=np.int64),
            "family_order": b.families.index(family),
            "position": rows["position"].to_numpy(dtype=np.int64),
            "rank": rows["rank"].to_numpy(dtype=np.int64),
            "occurrence": rows["occurrence"].to_numpy(dtype=np.int64),
            "phase": phase,
            "kind": family,
            "name": names_b[rows["name"].to_numpy(dtype=np.int64)],
            "target_name": names_t[rows["tname"].to_numpy(dtype=np.int64)],
            "vpp_stage": rows["vpp_stage"].to_numpy(dtype=np.int64),
            "op": np.asarray(ops, dtype=object)[rows["k"].to_numpy(dtype=np.int64)],
            "base": rows["base"].to_numpy(dtype=float),
            "target": rows["target"].to_numpy(dtype=float),
            "rel_diff": rows["rel_diff"].to_numpy(dtype=float),
            "group": rows["grp"].to_numpy(dtype=np.int64),
        }
    )[[*FLOW_KEYS, "phase", "kind", "name", "target_name", "vpp_stage", "op", "base", "target", "rel_diff", "group"]]
