"""What a family file must hold, checked in one place for every on-disk format.

:func:`check_header` and :func:`validate_family_frame` raise :class:`~trainmon.errors.DamagedFileError`
naming the file, the line (or row) and the column of the first problem, so a damaged run gives
one clear line instead of a traceback, and a damaged cell is never read as NaN.  The CSV reader
(``trainmon.output.runs``) calls both; a reader of another format calls
``validate_family_frame(frame, path, line_of=..., unit="row")`` on the frame it parsed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from trainmon.errors import DamagedFileError
from trainmon.families import FAMILIES
from trainmon.stats.table import STAT_NAMES

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["HEAD_COLUMNS", "TAIL_COLUMNS", "INT_COLUMNS", "EXTRA_FIELD", "check_header", "validate_family_frame"]

HEAD_COLUMNS = ("vpp_stage", "name", "step")
TAIL_COLUMNS = ("shape", "dtype")
INT_COLUMNS = ("vpp_stage", "step", "micro_step")
# The name given to a field beyond the header's last column (a row with one field too many).
EXTRA_FIELD = "__trainmon_field_beyond_the_header__"
_NUMBER_COLUMNS = frozenset(STAT_NAMES) | {c for info in FAMILIES.values() for c in info.own_stats}


def _shown(value: object) -> str:
    text = str(value)
    return repr(text[:40] + ("..." if len(text) > 40 else ""))


def check_header(header: Sequence[str], path: object) -> None:
    """The header of a family file: ``vpp_stage,name,step,...,shape,dtype``, names unique."""
    expected = ",".join(HEAD_COLUMNS) + ",...," + ",".join(TAIL_COLUMNS)
    if tuple(header[:3]) != HEAD_COLUMNS or tuple(header[-2:]) != TAIL_COLUMNS or len(header) < 5:
        found = ",".join(header)
        raise DamagedFileError(path, f"not a trainmon header (expected {expected}, found {_shown(found)})", 1)
    seen: set[str] = set()
    for i, name in enumerate(header, 1):
        if not name or name in seen:
            raise DamagedFileError(
                path, f"{'empty' if not name else 'repeated'} column name {_shown(name)} in the header", 1, i
            )
        seen.add(name)


def validate_family_frame(
    frame: pd.DataFrame, path: object, line_of: Callable[[int], int] | None = None, unit: str = "line"
) -> None:
    """Raise for the first cell that is not what the writer puts there: an integer in
    ``vpp_stage``/``step``/``micro_step``, a number (or nan/inf) in every statistic column,
    nothing beyond the last column (a row with fields missing shifts a text cell into a number
    column, which is caught there; a last row cut short is the reader's to leave out).  ``line_of(i)`` gives
    the line (or
    row) of the frame's ``i``-th row (default: CSV lines, ``i + 2``)."""
    import numpy as np
    import pandas as pd

    where = line_of or (lambda i: i + 2)
    columns = list(frame.columns)

    def fail(i: int, col: str, message: str) -> None:
        raise DamagedFileError(
            path,
            message,
            where(int(i)),
            f"{columns.index(col) + 1} ({col})" if col != EXTRA_FIELD else len(columns),
            unit,
        )

    for col in (c for c in INT_COLUMNS if c in frame):
        values = frame[col]
        if pd.api.types.is_integer_dtype(values.dtype):
            continue
        numbers = pd.to_numeric(values, errors="coerce")
        with np.errstate(invalid="ignore"):
            bad = numbers.isna() | ~np.isfinite(numbers) | (numbers != np.round(numbers))
        if bad.any():
            i = int(np.flatnonzero(bad.to_numpy())[0])
            fail(
                i,
                col,
                f"{_shown(values.iloc[i]) if values.iloc[i] == values.iloc[i] else 'an empty cell'} is not an integer",
            )
    for col in (c for c in columns if c in _NUMBER_COLUMNS):
        values = frame[col]
        if pd.api.types.is_numeric_dtype(values.dtype) and not pd.api.types.is_bool_dtype(values.dtype):
            continue
        bad = pd.to_numeric(values, errors="coerce").isna() & values.notna()
        if bad.any():
            i = int(np.flatnonzero(bad.to_numpy())[0])
            fail(i, col, f"{_shown(values.iloc[i])} is not a number")
    if EXTRA_FIELD in frame:
        extra = frame[EXTRA_FIELD].notna() & (frame[EXTRA_FIELD] != "")
        if extra.any():
            fail(
                int(np.flatnonzero(extra.to_numpy())[0]),
                EXTRA_FIELD,
                f"more fields than the header's {len(columns) - 1} columns",
            )
