"""Finding and reading trainmon output: output dir -> run dirs -> rank dirs -> CSV / Parquet families.

Layout (see README.md, "Output files")::

    <output_dir>/<run_id>/rank<R>/<family>_<a>-<b>[.<k>].csv   (names: ``trainmon.output.layout``)

Everything here is read-only and imports no torch, so commands start fast.  Values are
parsed exactly: the CSV sink writes floats with ``repr`` and :func:`read_csv` parses them
back to the same float64.
"""
from __future__ import annotations

import csv
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from trainmon.families import FAMILIES
from trainmon.output.layout import NOT_RUNS, FamilyFile, parse_family_file, parse_rank_dir
from trainmon.stats.table import STAT_NAMES

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["FamilyFile", "ColumnRoles", "find_runs", "is_run_dir", "rank_dirs", "rank_of",
           "family_files", "read_csv", "read_family", "column_roles", "KEY_COLUMNS", "FAMILY_STATS"]

KEY_COLUMNS = ("vpp_stage", "name", "step", "micro_step")
# Statistics some families have besides ``STAT_NAMES`` (their own value columns).
FAMILY_STATS = tuple(dict.fromkeys(c for info in FAMILIES.values() for c in info.own_stats))
_TEXT_COLUMNS = ("name", "shape", "dtype")
_TRAILING = ("shape", "dtype")
# Spellings of NaN the CSV sink (repr) and pandas/numpy writers produce.  Only these are NaN:
# a tensor called "NA" or "null" must stay a name.
_NAN_TEXT = ["nan", "NaN", "-nan", ""]


@dataclass(frozen=True)
class ColumnRoles:
    """What each column of a family file is: row keys, ``extra`` columns, statistics."""

    keys: tuple[str, ...]
    extras: tuple[str, ...]
    stats: tuple[str, ...]


def rank_of(rank_dir: str | Path) -> int | None:
    """``R`` of a ``rank<R>`` directory, else None."""
    return parse_rank_dir(Path(rank_dir).name)


def rank_dirs(run_dir: str | Path) -> list[Path]:
    """The ``rank<R>`` directories of a run, by rank number (rank2 before rank10)."""
    run_dir = Path(run_dir)
    try:
        entries = list(run_dir.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = [(rank_of(p), p) for p in entries if p.is_dir() and rank_of(p) is not None]
    return [p for _, p in sorted(found)]


def is_run_dir(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and path.name not in NOT_RUNS and bool(rank_dirs(path))


def find_runs(path: str | Path, max_depth: int = 2) -> list[Path]:
    """Run directories at ``path``: itself if it is a run, else runs up to ``max_depth`` below.

    Raises ``FileNotFoundError`` / ``NotADirectoryError`` for a bad path; an existing
    directory without runs gives ``[]``.  The search stops at runs (no runs inside runs).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such directory")
    if not path.is_dir():
        raise NotADirectoryError(f"{path}: not a directory")
    if is_run_dir(path):
        return [path]
    runs: list[Path] = []
    if max_depth > 0:
        for child in sorted(p for p in path.iterdir() if p.is_dir() and p.name not in NOT_RUNS):
            runs.extend(find_runs(child, max_depth - 1))
    return runs


def family_files(rank_dir: str | Path) -> dict[str, list[FamilyFile]]:
    """Family -> its CSV or Parquet files in step order (windows by start, header variants after).

    A family written in both formats (``"format": ["csv", "parquet"]``) is read from one: Parquet
    when it holds every window the CSV files hold (faster to read), else CSV (after a crash the
    CSV also holds the window that was open).  Other files in the rank dir (``anomalies.jsonl``,
    ``stack_info.csv``, a Parquet sink's ``.tmp`` file, ...) are ignored.
    """
    out: dict[str, dict[str, list[FamilyFile]]] = {}
    for p in Path(rank_dir).iterdir():
        f = parse_family_file(p)
        if f is not None and p.is_file():
            out.setdefault(f.family, {}).setdefault(f.ext, []).append(f)
    return {family: sorted(_one_format(by_ext)) for family, by_ext in sorted(out.items())}


def _one_format(by_ext: dict[str, list[FamilyFile]]) -> list[FamilyFile]:
    csv_files, pq_files = by_ext.get("csv", []), by_ext.get("parquet", [])
    if not csv_files or not pq_files:
        return csv_files or pq_files
    windows = {(f.start, f.end, f.part) for f in pq_files}
    return pq_files if all((f.start, f.end, f.part) in windows for f in csv_files) else csv_files


@functools.lru_cache(maxsize=1)
def _exact_float_option() -> dict:
    # pandas < 3 parses floats with a fast routine that can be off in the last bit unless asked
    # for "round_trip"; pandas 3 parses exactly by default and deprecates the option.
    import pandas as pd

    return {"float_precision": "round_trip"} if int(pd.__version__.split(".")[0]) < 3 else {}


def _header(path: Path) -> list[str]:
    with open(path, newline="", encoding="utf-8") as fh:
        return next(csv.reader(fh), [])


def read_csv(path: str | Path) -> "pd.DataFrame":
    """One family file with exact floats; ``name``/``shape``/``dtype`` always text.

    An empty file or one holding only a header gives an empty frame with its columns.
    """
    import pandas as pd

    path = Path(path)
    header = _header(path)
    if not header:
        return pd.DataFrame()
    return _parse(path, header)


def _parse(source, header: Sequence[str]) -> "pd.DataFrame":
    import pandas as pd

    na = {c: _NAN_TEXT for c in header if c not in _TEXT_COLUMNS}
    return pd.read_csv(source, dtype={c: str for c in _TEXT_COLUMNS if c in header},
                       keep_default_na=False, na_values=na, **_exact_float_option())


def _read_same_header(paths: Sequence[Path], header: Sequence[str]) -> "pd.DataFrame":
    """Files sharing one header parsed in one go: one parse per file costs ~28x more on runs
    with one file per step (msprobe's default layout)."""
    import io

    if len(paths) == 1:
        return _parse(paths[0], header)
    parts = []
    for path in paths:
        body = path.read_text(encoding="utf-8").split("\n", 1)
        if len(body) == 2 and body[1]:
            parts.append(body[1] if body[1].endswith("\n") else body[1] + "\n")
    return _parse(io.StringIO(",".join(header) + "\n" + "".join(parts)), header)


def read_family(rank_dir: str | Path, family: str) -> "pd.DataFrame":
    """Every file of one family of a rank, concatenated in step order; CSV or Parquet alike.

    Files written under different headers (``ops`` changed mid-run) are aligned by
    column name; a column a file lacks is NaN in its rows.
    """
    import pandas as pd

    files = family_files(rank_dir).get(family, [])
    if files and files[0].ext == "parquet":
        frames = _parquet_frames(files)
    else:
        by_header: dict[tuple[str, ...], list[Path]] = {}
        for f in files:
            header = tuple(_header(Path(f.path)) or ())
            if header:
                by_header.setdefault(header, []).append(Path(f.path))
        frames = [_read_same_header(paths, header) for header, paths in by_header.items()]
    if not frames:
        return pd.DataFrame()
    df = pd.concat(frames, ignore_index=True, sort=False)
    # Header variants come out grouped, not in step order; a stable sort on step alone keeps the
    # write order (= training-flow order) of the rows within each step.
    return df.sort_values("step", kind="stable", ignore_index=True)


def _parquet_frames(files: Sequence[FamilyFile]) -> list["pd.DataFrame"]:
    """Parquet files grouped by schema, like CSV files by header (the reader is its own module)."""
    from trainmon.output.parquet import parquet_columns, read_parquet_files

    by_schema: dict[tuple[str, ...], list[Path]] = {}
    for f in files:
        by_schema.setdefault(tuple(parquet_columns(f.path)), []).append(Path(f.path))
    return [read_parquet_files(paths) for paths in by_schema.values()]


def column_roles(df: "pd.DataFrame", extra_stats: Sequence[str] = ()) -> ColumnRoles:
    """Split a family file's columns into keys, ``extra`` columns and statistics.

    The CSV layout is ``vpp_stage,name,step,[micro_step],<extra...>,<stats...>,shape,dtype``.
    The statistics start at the first column that is a known statistic (``STAT_NAMES``,
    ``FAMILY_STATS`` or ``extra_stats``) or holds floats; ``extra`` columns are the ones before it, so they
    must hold text or integers (the comm family's op, call index, phase, argument).
    """
    import pandas as pd

    cols = [c for c in df.columns if c not in _TRAILING]
    keys = tuple(c for c in cols if c in KEY_COLUMNS)
    rest = [c for c in cols if c not in KEY_COLUMNS]
    known = set(STAT_NAMES) | set(FAMILY_STATS) | set(extra_stats)
    first = next((i for i, c in enumerate(rest)
                  if c in known or pd.api.types.is_float_dtype(df[c].dtype)), len(rest))
    return ColumnRoles(keys, tuple(rest[:first]), tuple(rest[first:]))
