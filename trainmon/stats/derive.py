"""``stats.table``'s derive for a whole block of rows at once, with numpy.

The engine derives each capture's statistics as one matrix operation instead of one Python call
per row and statistic: at a few hundred rows per step that Python work ran on the writer thread
while the training thread waited for the GIL.  The functions are the table's own (each ``Stat``
row's ``vector``); counts come back as ints.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from trainmon.stats.table import STATS, derive_columns

__all__ = ["derive_block"]


def derive_block(ops: Sequence[str], columns: Sequence[str], partials: list[list[float]] | np.ndarray) -> list[list]:
    """Rows of statistics ``ops`` (Python floats, ints for counts) from rows of ``partials``."""
    if len(partials) == 0:
        return []
    rows = derive_columns(ops, columns, np.asarray(partials, dtype=np.float64)).tolist()
    counts = [j for j, op in enumerate(ops) if STATS[op].integer]
    if counts:
        for row in rows:
            for j in counts:
                row[j] = int(row[j])
    return rows
