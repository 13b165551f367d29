"""``trainmon ranks RUN_DIR``: what must agree across data-parallel ranks, step by step."""

from __future__ import annotations

import argparse
from collections import Counter

from trainmon.cli import CommandError
from trainmon.cli._engine import add_engine_argument, engine_errors, engine_required
from trainmon.cli._options import add_cluster_option, check_recorded, cluster_address, non_negative, rank_list
from trainmon.cli._progress import Progress
from trainmon.diagnosis import engine
from trainmon.diagnosis.engine_buckets import engine_ranks
from trainmon.diagnosis.ranks import CHECKS
from trainmon.diagnosis.reader import DuplicateKeys, RunDirError
from trainmon.diagnosis.report import dump_json, escape, parse_name_list, table

HELP = "check cross-rank consistency (reduced grads, averaging, partial NaN, outlier ranks)"
_TEXT_LIMIT = 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory (or its output dir)")
    parser.add_argument("--json", action="store_true", help="machine-readable output (fields: docs/diagnosis.md)")
    parser.add_argument(
        "--rtol",
        type=float,
        default=1e-5,
        help="relative tolerance of 'identical' and 'average' (default 1e-5, raised to 4 eps of the dtype)",
    )
    parser.add_argument(
        "--outlier-factor",
        type=float,
        default=10.0,
        help="pre-reduce norm this many times off the other ranks is an outlier (default 10)",
    )
    parser.add_argument(
        "--reduce",
        choices=("mean", "sum"),
        default="mean",
        help="what the data-parallel reduce computes (default mean)",
    )
    parser.add_argument("--checks", default=None, help=f"comma list of {', '.join(CHECKS)} (default: all)")
    parser.add_argument(
        "--ranks", default=None, help="comma list of ranks forming one data-parallel group (default: all)"
    )
    add_engine_argument(parser)
    add_cluster_option(parser)
    parser.add_argument(
        "--limit",
        type=int,
        default=None,
        help=f"show at most N issues (text default {_TEXT_LIMIT}, JSON default all; 0 = all)",
    )


def _run_files(path: str, ranks) -> engine.RunFiles:
    try:
        files = engine.run_files(path, ranks=ranks)
    except RunDirError as exc:
        raise CommandError(str(exc)) from None
    check_recorded(ranks, files.ranks_on_disk, "rank", files.path)
    return files


def run(args: argparse.Namespace) -> int:
    checks = parse_name_list(args.checks) or list(CHECKS)
    unknown = [c for c in checks if c not in CHECKS]
    if unknown:
        raise CommandError(f"unknown check '{unknown[0]}' (allowed: {', '.join(CHECKS)})")
    if not args.outlier_factor > 1:
        raise CommandError("--outlier-factor must be > 1")
    non_negative(args.limit, "--limit")
    ranks = rank_list(args.ranks)
    options = {"rtol": args.rtol, "outlier_factor": args.outlier_factor, "reduce": args.reduce, "checks": checks}
    repeated = DuplicateKeys()  # keys written twice: a finding of their own (two runs in one folder)
    engine_required(args.engine)
    cluster = cluster_address(args)  # the buckets run on a Dask cluster, else in this process
    run_table = _run_files(args.run_dir, ranks)
    progress = Progress("ranks", sum(len(v) for v in run_table.files.values()), quiet=args.json)
    try:
        with engine_errors(run_table.path):
            issues = engine_ranks(run_table, progress=progress, duplicates=repeated, cluster=cluster, **options)
    finally:
        progress.done()
    limit = args.limit if args.limit is not None else (0 if args.json else _TEXT_LIMIT)
    shown = issues if limit == 0 else issues[:limit]
    by_check = dict(Counter(i.check for i in issues))
    if args.json:
        dump_json(
            {
                "run_dir": str(run_table.path),
                "ranks": list(run_table.ranks),
                "checks": checks,
                "count": len(issues),
                "by_check": by_check,
                "issues": [i.to_json() for i in shown],
                "duplicate_keys": repeated.to_json(),
            }
        )
        return 0
    counts = ", ".join(f"{k} {v}" for k, v in by_check.items())
    print(
        f"run: {run_table.path}  ranks: {','.join(map(str, run_table.ranks)) or '-'}  "
        f"issues: {len(issues)}" + (f" ({counts})" if issues else "")
    )
    if repeated.count:
        print(repeated.describe())

    if len(run_table.ranks) < 2:
        print("only one rank: nothing to compare across ranks")
        return 0
    if not issues:
        print("ranks consistent")
        return 0
    i = issues[0]
    where = f"step {i.step}, {i.phase}, {i.kind} {escape(i.name)}, rank {i.rank}"
    print(f"first: {where}: {i.check} ({escape(str(i.detail))})")
    table(
        ["step", "phase", "kind", "name", "rank", "check", "op", "value", "expected"],
        [(x.step, x.phase, x.kind, x.name, x.rank, x.check, x.op, x.value, x.expected) for x in shown],
    )
    if len(shown) < len(issues):
        print(f"... {len(issues) - len(shown)} more (--limit 0 shows all; --json for machines)")
    return 0
