"""``stats.table``'s derive for a whole block of rows at once, with numpy.

The engine derives each capture's statistics as one matrix operation instead of one Python call
per row and statistic: at a few hundred rows per step that Python work ran on the writer thread
while the training thread waited for the GIL.  The functions are the table's own (each ``Stat``
row's ``vector``); counts come back as ints.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from trainmon.stats.rows import values_of
from trainmon.stats.table import STATS, derive_columns

__all__ = ["derive_block", "derive_matrix", "integer_columns"]


def integer_columns(ops: Sequence[str]) -> tuple[int, ...]:
    """The columns of ``ops`` that are counts (written as ints)."""
    return tuple([j for j, op in enumerate(ops) if STATS[op].integer])


def derive_matrix(ops: Sequence[str], columns: Sequence[str], partials: np.ndarray) -> np.ndarray:
    """Statistics ``ops`` of rows of ``partials`` as one float64 C-contiguous ``[rows, len(ops)]``
    matrix (counts as floats: ``integer_columns`` says which); no Python object per row."""
    if len(partials) == 0:
        return np.empty((0, len(ops)), dtype=np.float64)
    return derive_columns(ops, columns, np.asarray(partials, dtype=np.float64))


def derive_block(ops: Sequence[str], columns: Sequence[str], partials: list[list[float]] | np.ndarray) -> list[list]:
    """Rows of statistics ``ops`` (Python floats, ints for counts) from rows of ``partials``."""
    if len(partials) == 0:
        return []
    return values_of(derive_matrix(ops, columns, np.asarray(partials, dtype=np.float64)), integer_columns(ops))
