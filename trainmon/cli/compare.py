"""``trainmon compare BASE_RUN TARGET_RUN``: where two runs first differ, in training-flow order."""

from __future__ import annotations

import argparse

from trainmon.cli import CommandError
from trainmon.cli._engine import add_engine_argument, engine_errors, engine_required
from trainmon.cli._options import add_cluster_option, check_recorded, cluster_address, non_negative, rank_list
from trainmon.cli._progress import Progress
from trainmon.diagnosis import engine
from trainmon.diagnosis.engine_compare import engine_compare
from trainmon.diagnosis.reader import DuplicateKeys, RunDirError
from trainmon.diagnosis.report import dump_json, escape, parse_name_list, table
from trainmon.families import NOT_SCALAR

HELP = "compare two runs: the first module/step/rank that differs beyond tolerance"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("base", metavar="BASE_RUN", help="reference run directory")
    parser.add_argument("target", metavar="TARGET_RUN", help="run directory to check against it")
    parser.add_argument("--rtol", type=float, default=1e-3, help="relative tolerance (default 1e-3)")
    parser.add_argument(
        "--atol", type=float, default=0.0, help="differences up to this absolute size never count (default 0)"
    )
    parser.add_argument("--ops", default=None, help="comma list of stats to compare (default: all common)")
    parser.add_argument("--kinds", default=None, help="comma list of families (default: all common)")
    parser.add_argument("--ranks", default=None, help="comma list of ranks (default: all)")
    parser.add_argument("--top", type=int, default=5, help="largest differences listed per family (default 5)")
    add_engine_argument(parser)
    add_cluster_option(parser)
    parser.add_argument("--json", action="store_true", help="machine-readable output (fields: docs/diagnosis.md)")


def _run_files(path: str, kinds, ranks) -> engine.RunFiles:
    try:
        files = engine.run_files(path, families=kinds, ranks=ranks)
    except RunDirError as exc:
        raise CommandError(str(exc)) from None
    check_recorded(kinds, files.families_on_disk, "family", files.path)
    check_recorded(ranks, files.ranks_on_disk, "rank", files.path)
    return files


def run(args: argparse.Namespace) -> int:
    if not args.rtol >= 0 or not args.atol >= 0:
        raise CommandError("--rtol and --atol must be >= 0")
    non_negative(args.top, "--top")
    kinds, ranks = parse_name_list(args.kinds), rank_list(args.ranks)
    options = {"rtol": args.rtol, "atol": args.atol, "ops": parse_name_list(args.ops), "top": args.top}
    # Keys written twice in a run (two runs in one folder): a finding of their own per run.
    repeated = {"base": DuplicateKeys(), "target": DuplicateKeys()}
    engine_required(args.engine)
    cluster = cluster_address(args)  # the alignment groups run on a Dask cluster, else in this process
    base, target = _run_files(args.base, kinds, ranks), _run_files(args.target, kinds, ranks)
    # Packed sign bits (``trainmon similarity``) are never compared, nor read.
    files = sum(len(v) for run in (base, target) for f, v in run.files.items() if f not in NOT_SCALAR)
    progress = Progress("compare", files, quiet=args.json)
    try:
        with engine_errors(f"{base.path} / {target.path}"):
            result = engine_compare(
                base,
                target,
                progress=progress,
                duplicates=(repeated["base"], repeated["target"]),
                cluster=cluster,
                **options,
            )
    finally:
        progress.done()
    if args.json:
        dump_json(
            {
                "base": str(base.path),
                "target": str(target.path),
                **result.to_json(),
                "duplicate_keys": {side: d.to_json() for side, d in repeated.items()},
            }
        )
        return 0
    print(f"base:   {base.path}\ntarget: {target.path}")
    for side, dup in repeated.items():
        if dup.count:
            print(f"{side}: {dup.describe()} (their rows align once; the others count as only in {side})")

    print(
        f"aligned rows: {result.aligned_rows} (only in base: {result.only_in_base}, only in target: "
        f"{result.only_in_target}; names matched through wrapper prefixes: {result.renamed})"
    )
    if not result.aligned_rows and result.static_divergence is None:
        print("nothing to compare: the runs share no (family, name, step, rank) rows")
        _print_stages(result)
        return 0
    d, static = result.first_divergence, result.static_divergence
    if static is not None:
        print(f"first divergence: {static.stage} (r{static.rank}): {static.describe()}")
    elif d is None:
        print(f"no divergence beyond rtol {args.rtol:g}")
    else:
        micro = "" if d.micro_step is None else f" micro_step {d.micro_step}"
        group = "" if d.group is None else f" group {d.group}"
        print(
            f"first divergence (rtol {args.rtol:g}): step {d.step}, {d.phase}, {d.kind} {escape(d.name)}{group}, "
            f"rank {d.rank}{micro}: {d.op} base {d.base:.6g} target {d.target:.6g} "
            f"(rel_diff {d.rel_diff:.3g}); {result.diverged_rows} rows diverge"
        )
    rows = [
        (f, x.step, x.name, x.rank, x.op, x.base, x.target, x.rel_diff)
        for f, xs in result.largest_by_family.items()
        for x in xs
    ]
    if rows:
        print("largest differences per family:")
        table(["kind", "step", "name", "rank", "op", "base", "target", "rel_diff"], rows)
    _print_stages(result)
    return 0


def _print_stages(result) -> None:
    """msprobe's staged summary: ``<stage> (r<R>): YES|NO [first difference]``, flow order."""
    print("stages (training-flow order; YES equal, NO differs, - not recorded in both):")
    marked = False
    for r in result.stages:
        detail = ""
        if r.match is False:
            detail = "  " + r.first.describe()
            if not marked and r.first == result.first_difference:
                detail += "  <- first divergence"
                marked = True
        elif r.note and r.match is None:
            detail = f"  ({r.note})"
        print(f"  {r.stage} (r{r.rank}): {r.label}{detail}")
