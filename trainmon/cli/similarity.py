"""``trainmon similarity BASE_RUN TARGET_RUN -o DIR``: per step and param, how alike two runs'
gradient directions are (msprobe grad_probe's ``GradComparator``; needs grad_probe L2)."""

from __future__ import annotations

import argparse
import math
import sys

from trainmon.cli import CommandError

HELP = "gradient-direction similarity of two runs per step and param (needs grad_probe L2)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("base", metavar="BASE_RUN", help="reference run directory")
    parser.add_argument("target", metavar="TARGET_RUN", help="run directory to check against it")
    parser.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="DIR",
        help="directory for similarities.csv, <param>.png and summary_similarities.png",
    )
    parser.add_argument(
        "--threshold",
        type=float,
        default=1.0,
        help="report the first step/param whose similarity is below this (default 1.0: any sign that differs)",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable summary (docs/grad_probe.md)")


class _Progress:
    """A one-line bar on stderr, only when stderr is a terminal."""

    def __init__(self) -> None:
        self.enabled = sys.stderr.isatty()

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        width = 30
        fill = int(width * done / max(total, 1))
        sys.stderr.write(f"\rcharts [{'#' * fill}{'.' * (width - fill)}] {done}/{total}")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def run(args: argparse.Namespace) -> int:
    if not math.isfinite(args.threshold) or not 0 <= args.threshold <= 1:
        raise CommandError(f"--threshold must be a number in 0..1, got {args.threshold:g}")
    from trainmon.diagnosis.reader import RunDirError
    from trainmon.diagnosis.report import dump_json
    from trainmon.diagnosis.similarity import similarities, write_similarities

    try:
        result = similarities(args.base, args.target)
    except RunDirError as exc:
        raise CommandError(str(exc)) from None
    if result.frame.empty:
        raise CommandError("the runs share no grad_direction rows (same rank, param and step)")
    try:
        written = write_similarities(result, args.output, progress=_Progress())
    except OSError as exc:
        raise CommandError(f"cannot write to {args.output}: {exc.strerror or exc}") from None
    first = result.first_below(args.threshold)
    f = result.frame
    if args.json:
        dump_json(
            {
                "base": args.base,
                "target": args.target,
                "output": str(args.output),
                "threshold": args.threshold,
                "first_below": first,
                "rows": len(f),
                "params": int(f[["vpp_stage", "name"]].drop_duplicates().shape[0]),
                "steps": int(f["step"].nunique()),
                "min_similarity": _num(f["similarity"].min()),
                "only_in_base": result.only_in_base,
                "only_in_target": result.only_in_target,
                "files": [str(p) for p in written],
            }
        )
        return 0
    print(f"{len(f)} rows ({f['step'].nunique()} steps) compared; wrote {len(written)} files to {args.output}")
    if first is None:
        print(f"similarity >= {args.threshold:g} everywhere")
    else:
        sim = "NaN (different shapes)" if first["similarity"] is None else f"{first['similarity']:.6g}"
        print(
            f"first below {args.threshold:g}: step {first['step']}, rank {first['rank']}, "
            f"{first['name']}: similarity {sim}"
        )
    return 0


def _num(v: float) -> float | None:
    return float(v) if math.isfinite(v) else None
