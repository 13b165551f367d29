"""Finding and reading trainmon output: output dir -> run dirs -> rank dirs -> CSV / Parquet families.

Layout (see docs/output_files.md)::

    <output_dir>/<run_id>/rank<R>/<family>_<a>-<b>[.<k>].csv   (names: ``trainmon.output.layout``)

Everything here is read-only and imports no torch, so commands start fast.  Values are
parsed exactly: the CSV sink writes floats with ``repr`` and :func:`read_csv` parses them
back to the same float64.
"""

from __future__ import annotations

import csv
import functools
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trainmon.errors import DamagedFileError
from trainmon.families import FAMILIES
from trainmon.output.layout import (
    NOT_RUNS,
    RUN_ESCALATIONS,
    RUN_META,
    STEP_TIMES_FILE,
    FamilyFile,
    parse_family_file,
    parse_rank_dir,
    parse_step_times,
)
from trainmon.output.validate import EXTRA_FIELD, check_header, validate_family_frame
from trainmon.stats.table import STAT_NAMES

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "whole_rows",
    "FamilyFile",
    "ColumnRoles",
    "escalations",
    "step_times",
    "find_runs",
    "is_run_dir",
    "rank_dirs",
    "rank_of",
    "family_files",
    "read_csv",
    "read_family",
    "family_frames",
    "file_header",
    "read_family_file",
    "column_roles",
    "KEY_COLUMNS",
    "FAMILY_STATS",
    "DamagedFileError",
]

KEY_COLUMNS = ("vpp_stage", "name", "step", "micro_step")
# Statistics some families have besides ``STAT_NAMES`` (their own value columns).
FAMILY_STATS = tuple(dict.fromkeys(c for info in FAMILIES.values() for c in info.own_stats))
_TEXT_COLUMNS = ("name", "shape", "dtype")
_TRAILING = ("shape", "dtype")
# Spellings of NaN the CSV sink (repr) and pandas/numpy writers produce.  Only these are NaN:
# a tensor called "NA" or "null" must stay a name.
_NAN_TEXT = ["nan", "NaN", "-nan", ""]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ColumnRoles:
    """What each column of a family file is: row keys, ``extra`` columns, statistics."""

    keys: tuple[str, ...]
    extras: tuple[str, ...]
    stats: tuple[str, ...]


def escalations(run_dir: str | Path) -> list[dict]:
    """The escalations ``run.json`` records (docs/escalation.md); [] when none or no readable file.

    ``run_dir`` may also be one of its rank directories."""
    path = Path(run_dir)
    for meta in (path / RUN_META, path.parent / RUN_META):
        if meta.is_file():
            try:
                info = json.loads(meta.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                return []
            items = info.get(RUN_ESCALATIONS, []) if isinstance(info, dict) else []
            return [e for e in items if isinstance(e, dict)] if isinstance(items, list) else []
    return []


def step_times(rank_dir: str | Path) -> dict[int, float]:
    """Step -> when it was recorded (Unix seconds) of one rank (``STEP_TIMES_FILE``); {} for a run
    written before trainmon recorded times, or when the file cannot be read."""
    try:
        text = (Path(rank_dir) / STEP_TIMES_FILE).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    return parse_step_times(text)


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


def file_header(path: Path) -> list[str]:
    """The header of a CSV family file, checked whole (:func:`trainmon.output.validate.check_header`)."""
    return _load_text(path)[0]


def _position(raw: bytes, offset: int) -> tuple[int, int]:
    """1-based line and column (in characters of that line's valid prefix) of byte ``offset``."""
    start = raw.rfind(b"\n", 0, offset) + 1
    return raw.count(b"\n", 0, offset) + 1, len(raw[start:offset].decode("utf-8", "replace")) + 1


def _load_text(path: Path) -> tuple[list[str], str]:
    """``(header, body)`` of a family file, where ``body`` holds whole rows only.

    Raises :class:`DamagedFileError` for what the CSV sink never writes: an empty file, a NUL
    byte, bytes that are not UTF-8, a header that is not trainmon's.  A last line without its
    newline is a row cut short (a run killed while writing, or a file still being written): it
    is left out, with one warning naming it.
    """
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise DamagedFileError(path, f"cannot read it ({exc.strerror or exc})") from None
    if not raw:
        raise DamagedFileError(path, "empty file (0 bytes): no header and no rows")
    nul = raw.find(b"\0")
    if nul >= 0:
        line, col = _position(raw, nul)
        raise DamagedFileError(path, "NUL byte (the file is damaged)", line, col)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line, col = _position(raw, exc.start)
        raise DamagedFileError(path, f"byte 0x{raw[exc.start]:02x} is not UTF-8 text", line, col) from None
    first, _, body = text.partition("\n")
    header = next(csv.reader([first.rstrip("\r")]), [])
    check_header(header, path)
    if body and not body.endswith("\n"):
        cut = body.rfind("\n") + 1
        _warn_cut(path, 2 + body.count("\n", 0, cut))
        body = body[:cut]
    return header, body


def _warn_cut(path: str | Path, line: int) -> None:
    log.warning(
        "trainmon: %s line %d is cut short (no end of line: the run was killed while writing it, "
        "or is still writing); that line is left out",
        path,
        line,
    )


def whole_rows(path: str | Path) -> int | None:
    """For a CSV family file whose last line has no end of line (cut short, as ``_load_text``
    finds it): its number of whole rows, after the same one warning; None for a whole file (one
    byte read) or one without a whole header (the header check names that)."""
    try:
        with open(path, "rb") as f:
            if f.seek(0, os.SEEK_END) == 0:
                return None
            f.seek(-1, os.SEEK_END)
            if f.read(1) == b"\n":
                return None
            f.seek(0)
            lines = f.read().count(b"\n")  # the header's and each whole row's
    except OSError:
        return None  # the read itself names what is wrong
    if lines == 0:
        return None
    _warn_cut(path, lines + 1)
    return lines - 1


def read_csv(path: str | Path) -> pd.DataFrame:
    """One family file with exact floats; ``name``/``shape``/``dtype`` always text.

    A file holding only a header gives an empty frame with its columns; a damaged file raises
    :class:`DamagedFileError` (file, line, column).
    """
    path = Path(path)
    header, body = _load_text(path)
    return _parse_checked(path, header, body)


def _parse(source, header: Sequence[str]) -> pd.DataFrame:
    """Parse ``source`` (its first line: :func:`_header_line`); a field beyond the file's last
    column lands in ``EXTRA_FIELD``."""
    import pandas as pd

    na = {c: _NAN_TEXT for c in header if c not in _TEXT_COLUMNS}
    return pd.read_csv(
        source,
        index_col=False,
        dtype={EXTRA_FIELD: str, **{c: str for c in _TEXT_COLUMNS if c in header}},
        keep_default_na=False,
        na_values=na,
        **_exact_float_option(),
    )


def _parse_checked(path: Path, header: Sequence[str], body: str) -> pd.DataFrame:
    """The rows of one file, validated; every problem raised with this file's line numbers."""
    import io

    import pandas as pd

    text = _header_line(header) + body
    try:
        frame = _parse(io.StringIO(text), header)
    except pd.errors.ParserError as exc:
        raise _parser_error(path, header, text, exc) from None
    validate_family_frame(frame, path, line_of=lambda i: _line_of_record(text, i))
    return frame.drop(columns=[EXTRA_FIELD])


def _header_line(header: Sequence[str]) -> str:
    """The header to parse under: the file's, plus ``EXTRA_FIELD`` to catch one field too many."""
    return ",".join(_quote_name(c) for c in [*header, EXTRA_FIELD]) + "\n"


def _quote_name(name: str) -> str:
    return '"' + name.replace('"', '""') + '"' if any(ch in name for ch in ',"\r\n') else name


def _line_of_record(text: str, index: int) -> int:
    """The line where data record ``index`` (0 = the first after the header) starts; exact with
    quoted names that hold line breaks.  Runs only when a problem is reported."""
    reader = csv.reader(io_lines(text))
    next(reader, None)
    line = reader.line_num + 1
    for i, _ in enumerate(reader):
        if i == index:
            return line
        line = reader.line_num + 1
    return line


def io_lines(text: str):
    import io

    return io.StringIO(text, newline="")


def _parser_error(path: Path, header: Sequence[str], text: str, exc: Exception) -> DamagedFileError:
    """The first record whose field count is not the header's, else pandas' own words."""
    reader = csv.reader(io_lines(text))
    try:
        next(reader, None)
        start = reader.line_num + 1
        for fields in reader:
            if len(fields) != len(header):
                many = "more" if len(fields) > len(header) else "fewer"
                return DamagedFileError(
                    path,
                    f"{len(fields)} fields, {many} than the header's {len(header)} columns",
                    start,
                    min(len(fields), len(header) + 1),
                )
            start = reader.line_num + 1
    except csv.Error as err:
        return DamagedFileError(path, f"not CSV ({err})", reader.line_num)
    return DamagedFileError(path, f"not CSV ({str(exc).strip().splitlines()[-1]})")


def _read_same_header(paths: Sequence[Path], header: Sequence[str], bodies: Sequence[str]) -> pd.DataFrame:
    """Files sharing one header parsed in one go: one parse per file costs ~28x more on runs
    with one file per step (msprobe's default layout).  A problem is reported with the file and
    line it is in (the files are then parsed one by one to find it)."""
    import io

    import pandas as pd

    if len(paths) == 1:
        return _parse_checked(paths[0], header, bodies[0])
    text = _header_line(header) + "".join(bodies)
    try:
        frame = _parse(io.StringIO(text), header)
        validate_family_frame(frame, paths[0])
    except (pd.errors.ParserError, DamagedFileError) as exc:
        for path, body in zip(paths, bodies, strict=True):
            _parse_checked(path, header, body)  # raises with this file's line
        raise DamagedFileError(paths[0], f"unreadable family files ({exc})") from None
    return frame.drop(columns=[EXTRA_FIELD])


def read_family(rank_dir: str | Path, family: str) -> pd.DataFrame:
    """Every file of one family of a rank, concatenated in step order; CSV or Parquet alike.

    Files written under different headers (``ops`` changed mid-run) are aligned by
    column name; a column a file lacks is NaN in its rows.
    """
    import pandas as pd

    frames = family_frames(family_files(rank_dir).get(family, []))
    if not frames:
        return pd.DataFrame()
    df = pd.concat(frames, ignore_index=True, sort=False)
    # Header variants come out grouped, not in step order; a stable sort on step alone keeps the
    # write order (= training-flow order) of the rows within each step.
    return df.sort_values("step", kind="stable", ignore_index=True)


def family_frames(files: Sequence[FamilyFile]) -> list[pd.DataFrame]:
    """Family files of one format, read and validated: one frame per header (CSV: each group
    parsed in one go) or schema (Parquet), groups in order of first appearance, files in order."""
    if files and files[0].ext == "parquet":
        return _parquet_frames(files)
    by_header: dict[tuple[str, ...], list[tuple[Path, str]]] = {}
    for f in files:
        header, body = _load_text(Path(f.path))
        by_header.setdefault(tuple(header), []).append((Path(f.path), body))
    return [
        _read_same_header([p for p, _ in group], header, [b for _, b in group]) for header, group in by_header.items()
    ]


def _parquet_frames(files: Sequence[FamilyFile]) -> list[pd.DataFrame]:
    """Parquet files grouped by schema, like CSV files by header (the reader is its own module);
    every file checked (``parquet.parquet_layout``) and its cells validated as a CSV file's."""
    from trainmon.output.parquet import parquet_columns, read_parquet_files

    by_schema: dict[tuple[str, ...], list[Path]] = {}
    for f in files:
        by_schema.setdefault(tuple(parquet_columns(f.path)), []).append(Path(f.path))
    return [read_parquet_files(paths, checked=True) for paths in by_schema.values()]


def read_family_file(f: FamilyFile) -> pd.DataFrame:
    """One family file, CSV or Parquet by its extension, validated (:func:`read_csv`,
    ``parquet.read_parquet``): a damaged file raises :class:`DamagedFileError` naming it."""
    if f.ext == "parquet":
        from trainmon.output.parquet import read_parquet

        return read_parquet(f.path)
    return read_csv(f.path)


def column_roles(df: pd.DataFrame, extra_stats: Sequence[str] = ()) -> ColumnRoles:
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
    first = next((i for i, c in enumerate(rest) if c in known or pd.api.types.is_float_dtype(df[c].dtype)), len(rest))
    return ColumnRoles(keys, tuple(rest[:first]), tuple(rest[first:]))
