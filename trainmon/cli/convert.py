"""``trainmon convert RUN --to parquet [-o DIR]``: a CSV run as a Parquet run, exactly.

Every family CSV file becomes the Parquet file of the same name (``.parquet``) with the same
columns and the exact same values (floats are parsed exactly, then stored as float64 bits); every
other file of the run (``run.json``, ``anomalies.jsonl``, TensorBoard events, ...) is copied, so
the new run answers every command like the old one.  Files are written to a temp name and
renamed, so an interrupted convert leaves no half file under a family name.  A family Parquet
file already in the run (``"format": ["csv", "parquet"]``) is checked like every file a command
reads (a damaged one: one line, exit code 2) and copied, unless a CSV file of the same window is
converted in its place (the CSV also holds a window a crash left open).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from trainmon.cli import CommandError
from trainmon.cli._progress import Progress
from trainmon.diagnosis.reader import RunDirError, resolve_run_dir
from trainmon.diagnosis.report import dump_json
from trainmon.errors import DamagedFileError
from trainmon.output.cells import BadCellError, check_numeric
from trainmon.output.layout import TMP_SUFFIX, family_file_name, parse_family_file, parse_rank_dir

HELP = "convert a CSV run to Parquet (same families, columns and exact values)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory to convert (its output dir works too)")
    parser.add_argument("--to", required=True, choices=["parquet"], help="target format")
    parser.add_argument(
        "-o",
        "--output",
        default=None,
        metavar="DIR",
        help="new run directory (default: RUN_DIR-parquet beside it); must not exist or be empty",
    )
    # ``-o`` means --output in every command; --out was this command's spelling until 0.x: still read
    parser.add_argument("--out", dest="out_deprecated", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="machine-readable summary")


def _target(run_dir: Path, out: str | None) -> Path:
    target = Path(out) if out else run_dir.with_name(run_dir.name + "-parquet")
    if target.resolve() == run_dir.resolve():
        raise CommandError(f"{target}: is the run being converted; pass another -o")
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise CommandError(f"{target}: already exists and is not empty; pass another -o")
    return target


def _csv_to_parquet(src: Path, dst: Path) -> int:
    import pyarrow as pa  # type: ignore[import-untyped]  # pyarrow ships no stubs
    import pyarrow.parquet as pq  # type: ignore[import-untyped]  # pyarrow ships no stubs

    from trainmon.output.runs import column_roles, read_csv
    from trainmon.sinks.parquet import COMPRESSION

    frame = read_csv(src)
    if len(frame.columns):
        check_numeric(frame, column_roles(frame).stats, src)
    table = pa.Table.from_pandas(frame, preserve_index=False)
    tmp = dst.with_name("." + dst.name + TMP_SUFFIX)
    pq.write_table(table.replace_schema_metadata(None), tmp, compression=COMPRESSION)
    os.replace(tmp, dst)
    return len(frame)


def convert(run_dir: Path, target: Path, progress: Progress) -> dict:
    sources = [p for p in sorted(run_dir.rglob("*")) if p.is_file()]
    progress.total = sum(1 for p in sources if _family_csv(p))
    files = rows = copied = 0
    for src in sources:
        dst = target / src.relative_to(run_dir)
        dst.parent.mkdir(parents=True, exist_ok=True)
        f = _family_csv(src)
        if f is None:
            if _family_parquet(src):
                _check_parquet(src)
                if src.with_suffix(".csv").is_file():
                    continue  # the CSV twin is converted to this name
            shutil.copy2(src, dst)
            copied += 1
            continue
        n = _csv_to_parquet(src, dst.with_name(family_file_name(f.family, f.start, f.end, f.part, ext="parquet")))
        files += 1
        rows += n
        progress.update(files=1, rows=n)
    return {"files": files, "rows": rows, "copied": copied}


def _family_csv(path: Path):
    """The family file ``path`` names if it is a CSV in a rank dir, else None (copied as is)."""
    f = parse_family_file(path)
    return f if f is not None and f.ext == "csv" and parse_rank_dir(path.parent.name) is not None else None


def _family_parquet(path: Path) -> bool:
    f = parse_family_file(path)
    return f is not None and f.ext == "parquet" and parse_rank_dir(path.parent.name) is not None


def _check_parquet(path: Path) -> None:
    """A family Parquet file of the source run, read and validated: never copied unread."""
    from trainmon.output.parquet import read_parquet

    read_parquet(path)


def _output_option(args: argparse.Namespace) -> str | None:
    """``-o/--output``, or the deprecated ``--out`` (with one warning line on stderr)."""
    old = getattr(args, "out_deprecated", None)
    if old is None:
        return args.output
    if args.output is not None and args.output != old:
        raise CommandError(f"--out {old} and --output {args.output} disagree; pass only -o/--output")
    print("trainmon convert: warning: --out is deprecated, use -o/--output", file=sys.stderr)
    return old


def run(args: argparse.Namespace) -> int:
    try:
        run_dir = resolve_run_dir(args.run_dir)
    except RunDirError as exc:
        raise CommandError(str(exc)) from None
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise CommandError("converting to Parquet needs pyarrow: pip install trainmon[parquet]") from None
    target = _target(run_dir, _output_option(args))
    progress = Progress("convert", 0, quiet=args.json)
    try:
        summary = convert(run_dir, target, progress)
    except (BadCellError, DamagedFileError) as exc:
        raise CommandError(f"{exc} (nothing more converted; {target} is incomplete)") from None
    except OSError as exc:
        raise CommandError(f"cannot write {target}: {exc}") from None
    finally:
        progress.done()
    if args.json:
        # "out" is the field's name since convert's first release; "output" matches the option
        dump_json({"run_dir": str(run_dir), "out": str(target), "output": str(target), "format": args.to, **summary})
    else:
        print(
            f"converted {summary['files']} files ({summary['rows']:,} rows) of {run_dir} to {target}"
            f" (+{summary['copied']} other files copied)"
        )
    return 0
