"""The vectorized derive against the scalar one (the table's definition), edge cases included."""
from __future__ import annotations

import math
import random

import pytest

from trainmon.stats.derive import derive_block
from trainmon.stats.table import PARTIALS, STAT_NAMES, derive, partials_for

EDGES = [0.0, -0.0, 1.0, -3.5, 1e-300, 1e300, math.inf, -math.inf, math.nan]


def _partials(rng: random.Random) -> dict[str, float]:
    count = rng.choice([0.0, 1.0, 2.0, 7.0, 1e6])
    pick = lambda: rng.choice(EDGES) if rng.random() < 0.3 else rng.uniform(-1e3, 1e3)  # noqa: E731
    return {"count": count, "sum": pick(), "sumsq": abs(pick()) if rng.random() < 0.8 else pick(),
            "min": pick(), "max": pick(), "nans": float(rng.randrange(3)), "infs": float(rng.randrange(3)),
            "zeros": float(rng.randrange(5)), "m2": pick()}


def _same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    return (math.isnan(a) and math.isnan(b)) if isinstance(a, float) and math.isnan(a) else a == b


@pytest.mark.parametrize("ops", [list(STAT_NAMES), ["norm", "mean", "min", "max"], ["nans", "std"], ["zeros"]])
def test_block_derive_equals_the_scalar_definition(ops):
    rng = random.Random(len(ops))
    columns = ("count", *[c for c in partials_for(ops) if c != "count"])
    assert set(columns) <= set(PARTIALS)
    rows = [_partials(rng) for _ in range(400)]
    got = derive_block(ops, columns, [[r[c] for c in columns] for r in rows])
    for row, vals in zip(rows, got):
        want = derive(ops, {c: row[c] for c in columns})
        assert all(_same(v, want[op]) for op, v in zip(ops, vals)), (row, vals, want)


def test_no_rows_gives_no_rows():
    assert derive_block(["norm"], ("count", "sumsq"), []) == []
