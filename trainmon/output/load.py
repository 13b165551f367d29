"""``trainmon.load_run``: a whole run (windows x ranks x families, CSV or Parquet) as one long DataFrame.

For notebooks (docs/notebooks.md).  The files are found and parsed by :mod:`trainmon.output.runs`
(``family_files``, its header checks and typed CSV parser) and :mod:`trainmon.output.parquet`:
this module only chooses the files, filters and joins.  Filters are applied while reading:

* by file name first: a rank folder, a family or a step window (``<family>_<a>-<b>``) that the
  filters exclude is never opened;
* then by row: for a selection of at least ``DUCKDB_FROM_BYTES`` on disk, the step and name
  filters are pushed into DuckDB's read of the remaining files, so only the matching rows reach
  pandas; otherwise pandas reads each file and filters it.  Both give the same frame (tests compare them).

Imports neither torch nor (at import time) pandas.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainmon.errors import DamagedFileError, TrainmonError
from trainmon.families import FAMILIES
from trainmon.output import runs
from trainmon.output.layout import FamilyFile, parse_rank_dir
from trainmon.output.sql_text import FILES_PER_READ, literal, quote
from trainmon.output.validate import INT_COLUMNS, TAIL_COLUMNS
from trainmon.stats.table import STAT_NAMES

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["load_run", "LoadRunError", "ENGINES", "DUCKDB_FROM_BYTES"]

ENGINES = ("auto", "duckdb", "pandas")
# ``engine="auto"`` uses DuckDB from this many bytes of selected files on: below it, starting
# DuckDB costs more than pandas' read of the files.
DUCKDB_FROM_BYTES = 8 << 20
_LEAD = ("rank", "family", "name", "step", "micro_step", "vpp_stage")
_TEXT = ("name", *TAIL_COLUMNS)
# Value columns of the contract: read as float64 (a count such as ``nans`` too, so that families
# joined into one frame have one dtype per column).
_VALUE_COLUMNS = frozenset(STAT_NAMES) | {c for info in FAMILIES.values() for c in info.own_stats}
# Columns DuckDB is given types for; a file with any other column (a family's ``extra`` columns,
# whose types pandas infers) is read by pandas.
_TYPED = frozenset(INT_COLUMNS) | _VALUE_COLUMNS | frozenset(_TEXT)


class LoadRunError(TrainmonError, ValueError):
    """A ``load_run`` argument or path that cannot be used: one line saying what is allowed."""


@dataclass(frozen=True)
class _Steps:
    """The steps asked for: ``lo <= step < hi``, and when ``only`` is set, one of those."""

    lo: int | None = None
    hi: int | None = None
    only: frozenset[int] | None = None

    def window(self, f: FamilyFile) -> bool:
        """Whether the file's window ``start..end`` can hold an asked step."""
        if self.only is not None:
            return any(f.start <= s <= f.end for s in self.only)
        return (self.lo is None or f.end >= self.lo) and (self.hi is None or f.start < self.hi)

    def sql(self) -> str | None:
        if self.only is not None:
            return f"step IN ({', '.join(str(s) for s in sorted(self.only))})" if self.only else "false"
        parts = ([f"step >= {self.lo}"] if self.lo is not None else []) + (
            [f"step < {self.hi}"] if self.hi is not None else []
        )
        return " AND ".join(parts) or None

    def mask(self, step: pd.Series) -> pd.Series:
        if self.only is not None:
            return step.isin(sorted(self.only))
        keep = step == step
        if self.lo is not None:
            keep &= step >= self.lo
        if self.hi is not None:
            keep &= step < self.hi
        return keep


def _as_steps(steps: Any) -> _Steps:
    allowed = "steps must be an int, a range, a slice (start/stop, step 1) or an iterable of ints"
    if steps is None:
        return _Steps()
    if isinstance(steps, bool):
        raise LoadRunError(f"load_run: steps={steps!r}: {allowed}")
    if _is_int(steps):  # numpy integers too (a step taken from a frame)
        return _Steps(only=frozenset({int(steps)}))
    if isinstance(steps, range) and steps.step == 1:
        return _Steps(steps.start, steps.stop)
    if isinstance(steps, slice):
        if steps.step not in (None, 1) or not all(v is None or _is_int(v) for v in (steps.start, steps.stop)):
            raise LoadRunError(f"load_run: steps={steps!r}: {allowed}")
        return _Steps(steps.start, steps.stop)
    if isinstance(steps, str | bytes) or not isinstance(steps, Iterable):
        raise LoadRunError(f"load_run: steps={steps!r}: {allowed}")
    values = list(steps)
    if not all(_is_int(v) for v in values):
        raise LoadRunError(f"load_run: steps={_shown(values)}: {allowed}")
    return _Steps(only=frozenset(int(v) for v in values))


def _is_int(value: object) -> bool:
    import numbers

    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _shown(values: Sequence[object]) -> str:
    return repr(values if len(values) <= 6 else [*values[:6], "..."])


def _as_set(value: Any, what: str, kind: type) -> frozenset | None:
    """``families``/``ranks``/``names``: one value or an iterable of them (None: all)."""
    if value is None:
        return None
    ok = _is_int if kind is int else (lambda v: isinstance(v, kind))
    allowed = f"must be {'an int' if kind is int else 'a str'} or an iterable of them"
    items = [value] if ok(value) or isinstance(value, str | bytes) else value
    if not isinstance(items, Iterable):
        raise LoadRunError(f"load_run: {what}={value!r}: {allowed}")
    items = list(items)
    if not all(ok(v) for v in items):
        raise LoadRunError(f"load_run: {what}={_shown(items)}: {allowed}")
    return frozenset(int(v) if kind is int else v for v in items)


def _rank_dirs(path: str | Path) -> tuple[Path, list[tuple[int, Path]]]:
    """The run's directory and its ``(rank, rank dir)``; ``path`` may be a rank dir (that rank only)."""
    path = Path(path).expanduser()
    rank = parse_rank_dir(path.name)
    if rank is not None and path.is_dir() and not runs.rank_dirs(path):
        return path.parent, [(rank, path)]
    try:
        found = runs.find_runs(path)
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise LoadRunError(f"load_run: {exc}") from None
    if not found:
        raise LoadRunError(f"load_run: {path}: no trainmon run here (a run is a folder holding rank<R>/ folders)")
    if len(found) > 1:
        listed = ", ".join(str(p) for p in found[:10]) + (f", ... ({len(found)} runs)" if len(found) > 10 else "")
        raise LoadRunError(f"load_run: {path} holds {len(found)} runs, pass one of them: {listed}")
    run = found[0]
    return run, [(int(runs.rank_of(p) or 0), p) for p in runs.rank_dirs(run)]


def load_run(
    path: str | Path,
    families: str | Iterable[str] | None = None,
    ranks: int | Iterable[int] | None = None,
    steps: int | range | slice | Iterable[int] | None = None,
    names: str | Iterable[str] | None = None,
    *,
    engine: str = "auto",
) -> pd.DataFrame:
    """A whole run as one long DataFrame: one row per recorded (rank, family, tensor, step[, micro-step]).

    Columns: ``rank, family, name, step, micro_step, vpp_stage``, then the op/stat columns of
    every family read (their union, in the order the files hold them; float64, NaN where a family
    or file lacks one; a family's ``extra`` columns, e.g. ``comm``'s, as pandas reads them), then
    ``shape, dtype``.  ``micro_step`` is a nullable integer: ``<NA>`` for families recorded once
    per step.  Rows come by rank, then family (by name), then step, in the order the files hold them.

    ``path``: a run directory (holding ``rank<R>/``), one rank directory (that rank only), or an
    output root holding exactly one run (more than one: an error listing them).

    Filters (``None``: all): ``families``, ``ranks`` and ``names`` take one value or an iterable;
    ``steps`` an int, a ``range`` / ``slice`` (step 1; ``slice(100, None)`` = from step 100 on)
    or an iterable of ints.  Files the filters exclude by their name (rank folder, family, step
    window) are never opened.  A family or rank the run does not hold is an error naming what it
    holds; a step or name no row has gives an empty frame (when no file is left to read, it has
    the key columns and ``shape, dtype`` only).

    Formats: CSV and Parquet files read alike, to the same values and dtypes.  A run written in
    both (``"format": ["csv", "parquet"]``) is read once, from one format per family and rank:
    Parquet whenever it holds every window the CSV files hold (the same rule as the commands';
    after a crash the CSV also holds the window that was open, and is read instead).

    ``engine``: ``"pandas"`` reads each file with pandas and filters it; ``"duckdb"`` pushes the
    step and name filters into DuckDB's read; ``"auto"`` (default) uses DuckDB when the selected
    files hold at least ``DUCKDB_FROM_BYTES``.  Both give equal frames.

    A damaged file (cut short, not CSV/Parquet, a cell that is not a number...) raises
    ``trainmon.errors.DamagedFileError``, one line naming the file and where; a CSV file whose
    last line has no end of line (a run killed while writing, or still running) is read without
    that line, with one warning naming it.  A bad argument or path raises ``LoadRunError``.
    """
    import pandas as pd

    if engine not in ENGINES:
        raise LoadRunError(f"load_run: engine={engine!r}: must be one of {', '.join(ENGINES)}")
    want_families = _as_set(families, "families", str)
    want_ranks = _as_set(ranks, "ranks", int)
    want_names = _as_set(names, "names", str)
    want_steps = _as_steps(steps)
    run, every = _rank_dirs(path)
    chosen = _choose_files(run, every, want_families, want_ranks, want_steps)
    with _Reader(engine, chosen) as con:
        frames = [_family_frame(rank, family, files, want_steps, want_names, con) for rank, family, files in chosen]
    frames = [f for f in frames if f is not None]
    if not frames:
        return pd.DataFrame({c: pd.Series(dtype=_dtype(c)) for c in (*_LEAD, *TAIL_COLUMNS)})
    return _arrange(pd.concat(frames, ignore_index=True, sort=False))


def _choose_files(
    run: Path,
    every: list[tuple[int, Path]],
    families: frozenset[str] | None,
    ranks: frozenset[int] | None,
    steps: _Steps,
) -> list[tuple[int, str, list[FamilyFile]]]:
    """``(rank, family, files)`` to read: the filters applied to the file names."""
    if ranks is not None and not ranks <= {r for r, _ in every}:
        absent = sorted(ranks - {r for r, _ in every})
        held_ranks = ", ".join(str(r) for r, _ in every) or "none"
        raise LoadRunError(f"load_run: ranks: {run} has no rank {absent[0]} (ranks held: {held_ranks})")
    by_rank = [(rank, runs.family_files(rdir)) for rank, rdir in every if ranks is None or rank in ranks]
    if families is not None:
        held = sorted({f for _, fams in by_rank for f in fams})
        missing = sorted(families - set(held))
        if missing:
            raise LoadRunError(
                f"load_run: families: {run} holds no family {missing[0]!r} (families held: {', '.join(held) or 'none'})"
            )
    out = []
    for rank, fams in by_rank:
        for family, files in fams.items():
            if families is not None and family not in families:
                continue
            kept = [f for f in files if steps.window(f)]
            if kept:
                out.append((rank, family, kept))
    return out


class _Reader:
    """The DuckDB connection the files are read through, or None (pandas reads them)."""

    def __init__(self, engine: str, chosen: list[tuple[int, str, list[FamilyFile]]]):
        self.engine, self.chosen = engine, chosen
        self.con: Any = None

    def __enter__(self):
        if self.engine == "pandas" or (self.engine == "auto" and not self._big()):
            return None
        import duckdb

        self.con = duckdb.connect(":memory:", config={"preserve_insertion_order": True})
        self.con.execute("SET enable_progress_bar = false")
        return self.con

    def _big(self) -> bool:
        total = 0
        for _, _, files in self.chosen:
            for f in files:
                try:
                    total += Path(f.path).stat().st_size
                except OSError:
                    continue  # read (and reported) with the rest
                if total >= DUCKDB_FROM_BYTES:
                    return True
        return False

    def __exit__(self, *exc) -> None:
        if self.con is not None:
            self.con.close()


def _family_frame(
    rank: int, family: str, files: list[FamilyFile], steps: _Steps, names: frozenset[str] | None, con
) -> pd.DataFrame | None:
    """One family of one rank, filtered, in ``runs.read_family``'s row order (files grouped by
    header in order of first appearance, then a stable sort on step)."""
    import pandas as pd

    pieces = list(_pieces(files, steps, names, con))
    if not pieces:
        return None
    df = pd.concat(pieces, ignore_index=True, sort=False).sort_values("step", kind="stable", ignore_index=True)
    df.insert(0, "family", family)
    df.insert(0, "rank", rank)
    return df


def _pieces(files: list[FamilyFile], steps: _Steps, names: frozenset[str] | None, con) -> Iterator[pd.DataFrame]:
    parquet = files[0].ext == "parquet"
    if con is None:
        frames = runs.family_frames(files)
        yield from (_filtered(f, steps, names) for f in frames)
        return
    for header, group in _by_header(files, parquet):
        if not set(header) <= _TYPED:  # extra columns: types as pandas infers them
            frames = runs.family_frames(group)
            yield from (_filtered(f, steps, names) for f in frames)
            continue
        # A CSV file whose last line has no end of line is read by pandas, which leaves that
        # cut-short line out with a warning; DuckDB would read "0.12" of "0.1234" as a number.
        whole = (lambda f: True) if parquet else _ends_with_newline
        for ok, same in itertools.groupby(group, key=whole):
            run = list(same)
            if not ok:
                yield from (_filtered(f, steps, names) for f in runs.family_frames(run))
                continue
            for k in range(0, len(run), FILES_PER_READ):
                yield _duckdb_read(con, run[k : k + FILES_PER_READ], header, parquet, steps, names)


def _by_header(files: list[FamilyFile], parquet: bool) -> list[tuple[tuple[str, ...], list[FamilyFile]]]:
    """Files grouped by their columns, checked (CSV: ``runs.file_header``; Parquet: its footer,
    ``parquet_layout``), groups in order of first appearance."""
    from trainmon.output.parquet import parquet_columns

    groups: dict[tuple[str, ...], list[FamilyFile]] = {}
    for f in files:
        cols = parquet_columns(f.path) if parquet else runs.file_header(Path(f.path))
        groups.setdefault(tuple(cols), []).append(f)
    return list(groups.items())


def _ends_with_newline(f: FamilyFile) -> bool:
    try:
        with open(f.path, "rb") as fh:
            fh.seek(0, 2)
            if fh.tell() == 0:
                return False
            fh.seek(-1, 2)
            return fh.read(1) == b"\n"
    except OSError:
        return False  # pandas' read reports it


def _filtered(frame: pd.DataFrame, steps: _Steps, names: frozenset[str] | None) -> pd.DataFrame:
    keep = steps.mask(frame["step"])
    if names is not None:
        keep &= frame["name"].isin(sorted(names))
    return frame if bool(keep.all()) else frame[keep.to_numpy()]


def _duckdb_read(
    con, files: list[FamilyFile], header: tuple[str, ...], parquet: bool, steps: _Steps, names: frozenset[str] | None
) -> pd.DataFrame:
    """The rows of ``files`` (one header) that pass the filters, read by DuckDB.  Anything DuckDB
    refuses, or a key cell it reads as empty, sends the files to pandas' validated read, which
    names the damaged file (or, when pandas reads them, gives the same rows)."""
    listing = "[" + ", ".join(literal(str(f.path)) for f in files) + "]"
    if parquet:
        source = f"read_parquet({listing})"
    else:
        types = {c: "BIGINT" if c in INT_COLUMNS else "DOUBLE" if c in _VALUE_COLUMNS else "VARCHAR" for c in header}
        columns = "{" + ", ".join(f"{literal(c)}: {literal(t)}" for c, t in types.items()) + "}"
        source = (
            f"read_csv({listing}, header=true, auto_detect=false, columns={columns}, delim=',', "
            "quote='\"', escape='\"', null_padding=false, strict_mode=true)"
        )
    wanted = [s for s in (steps.sql(), _names_sql(names)) if s]
    # Rows with an empty key cell come back whatever the filters, so that damage is reported
    # whether or not the damaged row was asked for (as pandas' read reports it).
    empty_key = " OR ".join(f"{quote(c)} IS NULL" for c in INT_COLUMNS if c in header)
    where = f" WHERE ({' AND '.join(wanted)}) OR {empty_key}" if wanted else ""
    try:
        frame = con.execute(f"SELECT * FROM {source}{where}").df()
    except Exception as exc:  # duckdb.Error and its kin: the validated reader says what is wrong
        if type(exc).__module__.split(".")[0] not in ("duckdb", "_duckdb"):
            raise
        return _pandas_fallback(files, parquet, steps, names)
    if any(frame[c].isna().any() for c in INT_COLUMNS if c in frame):
        return _pandas_fallback(files, parquet, steps, names)
    for c in INT_COLUMNS:
        if c in frame:
            frame[c] = frame[c].astype("int64")
    for c in _TEXT:
        if c in frame:
            frame[c] = frame[c].fillna("").astype(str)
    return frame


def _names_sql(names: frozenset[str] | None) -> str | None:
    if names is None:
        return None
    return f"name IN ({', '.join(literal(n) for n in sorted(names))})" if names else "false"


def _pandas_fallback(
    files: list[FamilyFile], parquet: bool, steps: _Steps, names: frozenset[str] | None
) -> pd.DataFrame:
    import pandas as pd

    frames = runs.family_frames(files)
    if not frames:  # pragma: no cover - files were listed, so there is a frame
        raise DamagedFileError(files[0].path, "unreadable")
    return pd.concat([_filtered(f, steps, names) for f in frames], ignore_index=True, sort=False)


def _dtype(column: str) -> str:
    return {"rank": "int64", "step": "int64", "vpp_stage": "int64", "micro_step": "Int64"}.get(column, "str")


def _arrange(df: pd.DataFrame) -> pd.DataFrame:
    """The documented column order and dtypes."""
    if "micro_step" not in df:
        df["micro_step"] = None
    df["micro_step"] = df["micro_step"].astype("Int64")
    for c in ("rank", "step", "vpp_stage"):
        df[c] = df[c].astype("int64")
    for c in df.columns:
        if c in _VALUE_COLUMNS:
            df[c] = df[c].astype("float64")
    rest = [c for c in df.columns if c not in _LEAD and c not in TAIL_COLUMNS]
    return df[[*_LEAD, *rest, *TAIL_COLUMNS]]
