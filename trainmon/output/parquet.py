"""Reading the Parquet sink's family files into the same frame :func:`trainmon.output.runs.read_csv` gives.

Same columns in file order, same dtypes: ``name``/``shape``/``dtype`` text (object), keys and
counts int64, statistics float64 with the exact values written (Parquet stores the float64 bits,
so no parsing is involved).  Imports pyarrow only when a file is read.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["read_parquet", "read_parquet_files", "parquet_columns"]


def _pyarrow():
    try:
        import pyarrow.parquet as pq  # type: ignore[import-untyped]  # pyarrow ships no stubs
    except ImportError as exc:  # a Parquet run read where pyarrow is missing
        raise ImportError(f"reading Parquet output needs pyarrow (pip install 'trainmon[parquet]'): {exc}") from None
    return pq


def parquet_columns(path: str | Path) -> list[str]:
    """The column names of one file, from its footer (no data read)."""
    return list(_pyarrow().read_schema(path).names)


def read_parquet(path: str | Path) -> pd.DataFrame:
    """One family file; an empty one gives an empty frame with its columns."""
    return read_parquet_files([Path(path)])


def read_parquet_files(paths: Sequence[Path]) -> pd.DataFrame:
    """Files of one schema, concatenated in the order given."""
    import pandas as pd
    import pyarrow as pa

    pq = _pyarrow()
    tables = [pq.read_table(p) for p in paths]
    if not tables:
        return pd.DataFrame()
    table = pa.concat_tables(tables, promote_options="default") if len(tables) > 1 else tables[0]
    # numpy dtypes and pandas' own text dtype, as its CSV parser makes them (not ArrowDtype).
    frame = table.to_pandas()
    text = [f.name for f in table.schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)]
    for c in text:
        frame[c] = frame[c].astype(str)
    return frame
