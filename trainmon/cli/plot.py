"""``trainmon plot RUN_DIR --kind K --op O``: layers x steps heatmap plus a per-layer profile."""

from __future__ import annotations

import argparse
from pathlib import Path

from trainmon.cli import CommandError
from trainmon.cli._engine import engine_errors, engine_required
from trainmon.cli._progress import Progress
from trainmon.families import Family

HELP = "plot one stat of one family as a layers x steps heatmap (PNG)"

# What --kind may name: every family trainmon writes ('steps' holds times, not tensors).
KINDS: tuple[str, ...] = tuple(f.value for f in Family if f is not Family.STEPS)
# How heatmap_figure picks the colour scale when neither --log nor --linear is given.
AUTO_SCALE = (
    "default: automatic -- log when every value is > 0 and they span more than 100x, "
    "a diverging scale centred on 0 when values have both signs, else linear"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory (or its output dir)")
    parser.add_argument(
        "--kind",
        required=True,
        metavar="KIND",
        help=f"the family to plot, one recorded in the run: {', '.join(KINDS)}",
    )
    parser.add_argument("--op", default="norm", help="stat column, e.g. norm, mean, max, min (default norm)")
    parser.add_argument("--rank", type=int, default=None, help="rank to plot (default: the lowest)")
    parser.add_argument("--step", type=int, default=None, help="step of the profile panel (default: last)")
    parser.add_argument(
        "--micro-step", type=int, default=None, help="micro-batch of actv/actv_grad (default: the first)"
    )
    scale = parser.add_mutually_exclusive_group()
    scale.add_argument("--log", dest="log", action="store_true", default=None, help=f"log colour scale ({AUTO_SCALE})")
    scale.add_argument("--linear", dest="log", action="store_false", help="linear colour scale")
    parser.add_argument(
        "-o",
        "--output",
        default=None,
        help="PNG path, or a folder to put <kind>_<op>_rank<R>.png in (default: that name in ./)",
    )
    parser.add_argument("--json", action="store_true", help="print what was written as JSON")


def output_path(option: str | None, default_name: str) -> Path:
    """Where ``-o`` says the PNG goes: a folder (existing, or written with a trailing slash) gets
    the default name inside it; a name without a suffix gets ``.png``.  The path reported is the
    path written."""
    if option is None:
        return Path(default_name)
    out = Path(option)
    if out.is_dir() or option.endswith(("/", "\\")):
        return out / default_name
    return out if out.suffix else out.with_name(out.name + ".png")


def run(args: argparse.Namespace) -> int:
    # matplotlib costs ~1 s to import: only this command pays for it, not ``trainmon --help``.
    from trainmon.diagnosis.engine_buckets import load_table
    from trainmon.diagnosis.plot import heatmap_figure, layer_grid, save_figure
    from trainmon.diagnosis.reader import RunDirError
    from trainmon.diagnosis.report import dump_json

    engine_required(None)
    progress = Progress("reading", 0, quiet=args.json)  # a large run takes seconds to read
    try:
        with engine_errors(args.run_dir):
            table = load_table(args.run_dir, families=[args.kind], progress=progress)
    except (RunDirError, ValueError) as exc:
        raise CommandError(str(exc)) from None
    finally:
        progress.done()
    try:
        grid = layer_grid(table, args.kind, args.op, rank=args.rank, micro_step=args.micro_step)
        fig = heatmap_figure(grid, step=args.step, log=args.log)
    except (RunDirError, ValueError) as exc:
        raise CommandError(str(exc)) from None
    out = output_path(args.output, f"{args.kind}_{args.op}_rank{grid.rank}.png")
    try:
        save_figure(fig, out)
    except (OSError, ValueError) as exc:  # ValueError: a suffix matplotlib cannot write
        raise CommandError(f"cannot write {out}: {getattr(exc, 'strerror', None) or exc}") from None
    step = int(grid.steps[-1]) if args.step is None else args.step
    if args.json:
        dump_json(
            {
                "output": str(out),
                "kind": grid.kind,
                "op": grid.op,
                "rank": grid.rank,
                "micro_step": grid.micro_step,
                "layers": len(grid.layers),
                "steps": len(grid.steps),
                "profile_step": step,
                "bytes": out.stat().st_size,
            }
        )
    else:
        print(f"wrote {out} ({len(grid.layers)} layers x {len(grid.steps)} steps, profile at step {step})")
    return 0
