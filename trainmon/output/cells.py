"""Stat cells that are not numbers: one clear error naming the file, line and column.

A stat column must hold numbers (or a NaN spelling).  Text such as ``np.float64(1.5)`` -- written
by a user's own script -- would otherwise read as NaN without a word and turn every row into a
``nonfinite`` finding.  Used where a run is read for analysis or conversion.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from trainmon.errors import TrainmonError

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["BadCellError", "check_numeric", "NAN_SPELLINGS"]

# What the CSV reader accepts as NaN in a numeric column (``runs._NAN_TEXT``).
NAN_SPELLINGS = frozenset({"nan", "NaN", "-nan", ""})


class BadCellError(TrainmonError):
    """A cell that cannot be the value its column holds; the message names file, line, column."""

    def __init__(self, path: str | Path, line: int, column: str, text: str):
        self.path, self.line, self.column, self.text = Path(path), line, column, text
        shown = text if len(text) <= 40 else text[:37] + "..."
        super().__init__(
            f"{path}:{line}: column '{column}' holds {shown!r}, not a number "
            "(stat columns hold numbers, nan, inf or -inf)"
        )


def _is_number(text: object) -> bool:
    if isinstance(text, float) and math.isnan(text):
        return True
    s = str(text).strip()
    if s in NAN_SPELLINGS:
        return True
    try:
        float(s)
    except ValueError:
        return False
    return True


def check_numeric(frame: pd.DataFrame, columns: Iterable[str], path: str | Path, first_line: int = 2) -> None:
    """Raise :class:`BadCellError` for the first non-numeric cell of ``columns``.

    ``frame`` holds one file's rows in file order; row ``i`` is on line ``first_line + i`` (the
    header is line 1 of a CSV file; for a Parquet file the "line" is the row number, from 1).
    """
    import pandas as pd

    for col in columns:
        values = frame[col]
        if pd.api.types.is_numeric_dtype(values.dtype):
            continue
        bad = ~values.map(_is_number).astype(bool)
        if bad.any():
            i = int(bad.to_numpy().argmax())
            raise BadCellError(path, first_line + i, col, str(values.iloc[i]))
