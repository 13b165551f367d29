"""Reading the Parquet sink's family files into the same frame :func:`trainmon.output.runs.read_csv` gives.

Same columns in file order, same dtypes: ``name``/``shape``/``dtype`` text (object), keys and
counts int64, statistics float64 with the exact values written (Parquet stores the float64 bits,
so no parsing is involved).  Imports pyarrow only when a file is read.

Every file is checked before its rows are used, by both engines (:func:`parquet_layout`): a file
that is not Parquet (cut short, overwritten), columns that are not trainmon's, a key column that
is not integers or a statistic column that is not numbers is a
:class:`~trainmon.errors.DamagedFileError` naming the file (one line, exit code 2 in the commands),
never a traceback and never a file skipped without a word.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from trainmon.errors import DamagedFileError
from trainmon.families import FAMILIES
from trainmon.output.validate import INT_COLUMNS, TAIL_COLUMNS, check_header, validate_family_frame
from trainmon.stats.table import STAT_NAMES

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["read_parquet", "read_parquet_files", "parquet_columns", "parquet_layout"]

_TEXT_COLUMNS = ("name", *TAIL_COLUMNS)
# Columns that hold numbers (the statistics and families' own values), as ``validate`` checks them.
_STAT_COLUMNS = frozenset(STAT_NAMES) | {c for info in FAMILIES.values() for c in info.own_stats}


def _pyarrow():
    try:
        import pyarrow.parquet as pq  # type: ignore[import-untyped]  # pyarrow ships no stubs
    except ImportError as exc:  # a Parquet run read where pyarrow is missing
        raise ImportError(f"reading Parquet output needs pyarrow (pip install 'trainmon[parquet]'): {exc}") from None
    return pq


def _unreadable(path: str | Path, exc: BaseException) -> DamagedFileError:
    # pyarrow's first sentence ("Parquet magic bytes not found in footer"), not its advice
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0].split(". ")[0].rstrip(".")
    return DamagedFileError(path, f"not a readable Parquet file (cut short, overwritten or not Parquet: {first})")


def _arrow_errors() -> tuple[type[BaseException], ...]:
    import pyarrow as pa

    return (pa.ArrowException, OSError, ValueError)


def parquet_layout(path: str | Path) -> tuple[int, list[str]]:
    """A family file's row count and column names, from its footer (no data read), checked:
    readable Parquet, trainmon's columns (``vpp_stage,name,step,...,shape,dtype``), integer key
    columns, numeric statistic columns.  Raises :class:`DamagedFileError` naming the file."""
    pq = _pyarrow()
    try:
        meta = pq.read_metadata(path)
        schema = meta.schema.to_arrow_schema()
    except _arrow_errors() as exc:
        raise _unreadable(path, exc) from None
    columns = list(schema.names)
    try:
        check_header(columns, path)
    except DamagedFileError as exc:  # the CSV wording ("header", "line 1") does not fit a footer
        raise DamagedFileError(
            path, exc.message.replace("a trainmon header", "trainmon's columns"), column=exc.column
        ) from None
    _check_types(path, schema)
    _check_keys_filled(path, meta, columns)
    return meta.num_rows, columns


def _check_keys_filled(path: str | Path, meta, columns: list[str]) -> None:
    """No empty key cell (the row-group statistics count them; DuckDB would read NULL steps)."""
    for i, name in enumerate(columns):
        if name not in INT_COLUMNS:
            continue
        empty = 0
        for g in range(meta.num_row_groups):
            stats = meta.row_group(g).column(i).statistics
            empty += stats.null_count if stats is not None and stats.null_count else 0
        if empty:
            raise DamagedFileError(path, f"{empty} empty cell(s), not integers", column=f"{i + 1} ({name})")


def _check_types(path: str | Path, schema) -> None:
    """Keys are integers, statistics numbers, as the Parquet sink writes them: a column of another
    type is damage, named with its first cell that is not what it should hold."""
    import pyarrow as pa

    names = list(schema.names)
    for i, field in enumerate(schema):
        t = field.type
        if pa.types.is_null(t) or field.name in _TEXT_COLUMNS:
            continue
        where = f"{i + 1} ({field.name})"
        if field.name in INT_COLUMNS:
            if not pa.types.is_integer(t):
                raise DamagedFileError(path, f"holds {t}, not integers (the Parquet sink writes int64)", column=where)
        elif field.name in _STAT_COLUMNS and not (pa.types.is_integer(t) or pa.types.is_floating(t)):
            raise _first_non_number(path, field.name, names.index(field.name), t)


def _first_non_number(path: str | Path, column: str, index: int, arrow_type) -> DamagedFileError:
    """The error for a statistic column stored as ``arrow_type``: its first cell that is not a
    number (``row`` counted from 1), else the column's type."""
    import pandas as pd

    where = f"{index + 1} ({column})"
    try:
        values = _pyarrow().read_table(path, columns=[column]).column(0).to_pandas()
    except _arrow_errors() as exc:
        return _unreadable(path, exc)
    bad = pd.to_numeric(values.astype(object), errors="coerce").isna() & values.notna()
    if bad.any():
        i = int(bad.to_numpy().argmax())
        text = str(values.iloc[i])
        shown = repr(text[:40] + ("..." if len(text) > 40 else ""))
        return DamagedFileError(path, f"{shown} is not a number", i + 1, where, unit="row")
    return DamagedFileError(path, f"holds {arrow_type}, not numbers (the Parquet sink writes float64)", column=where)


def parquet_columns(path: str | Path) -> list[str]:
    """The column names of one file, from its footer (no data read), checked (:func:`parquet_layout`)."""
    return parquet_layout(path)[1]


def read_parquet(path: str | Path) -> pd.DataFrame:
    """One family file, checked; an empty one gives an empty frame with its columns."""
    return read_parquet_files([Path(path)])


def read_parquet_files(paths: Sequence[Path], *, checked: bool = False) -> pd.DataFrame:
    """Files of one schema, concatenated in the order given, each checked (:func:`parquet_layout`
    unless ``checked``: the caller did) and its cells validated like a CSV file's (rows numbered
    from 1 in each file)."""
    import pandas as pd
    import pyarrow as pa

    pq = _pyarrow()
    tables = []
    for p in paths:
        if not checked:
            parquet_layout(p)
        try:
            tables.append(pq.read_table(p))
        except _arrow_errors() as exc:
            raise _unreadable(p, exc) from None
    if not tables:
        return pd.DataFrame()
    try:
        table = pa.concat_tables(tables, promote_options="default") if len(tables) > 1 else tables[0]
    except _arrow_errors() as exc:  # the same columns, types that cannot be joined
        raise DamagedFileError(paths[0], f"its column types differ from the other files' ({exc})") from None
    # numpy dtypes and pandas' own text dtype, as its CSV parser makes them (not ArrowDtype).
    frame = table.to_pandas()
    text = [f.name for f in table.schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)]
    for c in text:
        frame[c] = frame[c].astype(str)
    _validate(frame, paths, [t.num_rows for t in tables])
    return frame


def _validate(frame: pd.DataFrame, paths: Sequence[Path], rows: Sequence[int]) -> None:
    """The CSV checks on the joined frame; a problem is named in the file (and row) it is in."""
    try:
        validate_family_frame(frame, paths[0], line_of=lambda i: i + 1, unit="row")
    except DamagedFileError:
        start = 0
        for path, n in zip(paths, rows, strict=True):
            part = frame.iloc[start : start + n].reset_index(drop=True)
            validate_family_frame(part, path, line_of=lambda i: i + 1, unit="row")  # raises in its file
            start += n
        raise
