"""Numbers to CSV text a block of rows at a time, byte for byte what ``repr`` writes.

The CSV sink's cells are Python's ``repr`` of each float (the shortest text that reads back as
the same float) and ``str`` of each count.  ``repr`` costs 0.1-0.6 µs a value (David Gay's
``dtoa``), on the writer thread that shares the GIL with training: most of the writer's time.

When ``orjson`` is installed, a block's values are turned into text in one C call: it writes the
same shortest round-trip digits (Ryu), only laid out differently for very small and very large
numbers (``0.00001`` and ``1e-7``/``1e16`` where ``repr`` writes ``1e-05``, ``1e-07`` and ``1e+16``),
which four byte-level substitutions over the whole block turn into ``repr``'s layout.  A version
of ``orjson`` whose text differs from ``repr`` on a probe set is not used, and a block holding
anything the fast path cannot vouch for (NaN, infinities, other types) is left to the caller's
exact per-value path: the output is identical either way, only its cost differs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from itertools import chain, repeat

import numpy as np

__all__ = ["row_cells", "matrix_cells", "fast_available"]

# orjson writes 1e-5 <= |x| < 1e-4 positionally ("0.0000123"); repr writes "1.23e-05".  The
# literal comes first so that re scans for it quickly; the look-behind after it keeps "10.00001".
# Split on it, the two groups (first digit, the rest) land in the list and are laid out again
# with C-level slicing and joins: a replacement template with groups costs a Python call a match.
_TINY = b"0.0000"
_TINY_NUMBER = re.compile(rb"0\.0000(?<!\d0\.0000)([1-9])(\d*)")
# orjson writes exponents bare ("e-7", "e16"); repr pads them to two digits and signs them.
# Literal replacements (no groups): re substitutes them without calling back into Python.
_EXPONENT_ONE_DIGIT = re.compile(rb"e-(?=\d(?!\d))")
_EXPONENT_POSITIVE = re.compile(rb"e(?=\d)")
# Anything but a finite float or an int: NaN/inf (orjson writes null), bools (true, false).  No
# number's text holds an "l" or a "u", so two byte scans find any of them.
_NOT_A_PLAIN_NUMBER = (b"l", b"u")

# Values whose text tells a differing orjson layout apart from repr's (checked once, at import).
_PROBES = [
    0.0, -0.0, 1.0, -2.5, 3, -7, 0.1, 1 / 3, 2.0**-1074, 2.2250738585072014e-308, 1.7976931348623157e308,
    1e-4, 9.999999999999999e-05, 1e-5, 1.2345e-5, -1.5e-5, 1e-7, 1.5e-9, 1e-10, 1.25e-100,
    1e15, 9999999999999998.0, 1e16, 1.5e16, 1e22, 1.5e300, 123456789012345680.0, 2**53 + 1, -(2**62),
]  # fmt: skip


def _layout_as_repr(text: bytes) -> bytes:
    if _TINY in text:
        text = _tiny_as_exponent(text)
    if b"e" in text:
        text = _EXPONENT_ONE_DIGIT.sub(b"e-0", text)
        text = _EXPONENT_POSITIVE.sub(b"e+", text)
    return text


def _tiny_as_exponent(text: bytes) -> bytes:
    """``0.0000dXYZ`` -> ``d.XYZe-05`` and ``0.0000d`` -> ``de-05``, for every such number."""
    parts = _TINY_NUMBER.split(text)  # [between, digit, rest, between, digit, rest, ..., between]
    between, digits, rests = parts[0::3], parts[1::3], parts[2::3]
    n = len(digits)
    pieces = zip(between, digits, repeat(b".", n), rests, repeat(b"e-05", n))
    # "d." + "" + "e-05" for a one-digit number: orjson never writes ".e" itself
    return (b"".join(chain.from_iterable(pieces)) + between[-1]).replace(b".e-05", b"e-05")


def _load_dumps() -> tuple[Callable[..., bytes], int] | None:
    """orjson's ``dumps`` and its numpy option, if its text is ``repr``'s once laid out again."""
    try:
        import numpy as np
        import orjson
    except ImportError:
        return None
    rows = [_PROBES[i : i + 4] for i in range(0, len(_PROBES), 4)]
    want = [",".join(map(repr, row)).encode() for row in rows]
    floats = [float(x) for x in _PROBES]
    try:
        got = _split_rows(_layout_as_repr(orjson.dumps(rows)))
        got_numpy = _split_rows(_layout_as_repr(orjson.dumps(np.array([floats]), option=orjson.OPT_SERIALIZE_NUMPY)))
    except Exception:  # an orjson that cannot write these at all
        return None
    if got != want or got_numpy != [",".join(map(repr, floats)).encode()]:
        return None
    return orjson.dumps, orjson.OPT_SERIALIZE_NUMPY


def _split_rows(text: bytes) -> list[bytes]:
    # b"[[1.0,2],[3.5,4]]" -> [b"1.0,2", b"3.5,4"]
    return text[2:-2].split(b"],[")


_fast = _load_dumps()
_dumps, _NUMPY = _fast if _fast is not None else (None, 0)
_INT_LIMIT = 2.0**53  # counts beyond this are not exact in float64 anyway; the exact path copes


def fast_available() -> bool:
    """Whether blocks are formatted in one C call (``orjson`` installed and writing ``repr``'s digits)."""
    return _dumps is not None


def row_cells(values: Sequence[Sequence[float | int]]) -> list[bytes] | None:
    """Each row's values as ``",".join(map(repr, row))``, encoded; None where only the exact
    per-value path can say (no usable ``orjson``, an empty block or row, NaN, infinities, a
    value that is not a Python float or int)."""
    if _dumps is None or not values or not values[0]:
        return None
    try:
        text = _dumps(values)
    except Exception:  # an int beyond 64 bits, a numpy scalar: the exact path copes
        return None
    if any([word in text for word in _NOT_A_PLAIN_NUMBER]):
        return None
    rows = _split_rows(_layout_as_repr(text))
    return rows if len(rows) == len(values) else None


def matrix_cells(matrix: np.ndarray, integer_columns: Sequence[int] = ()) -> list[list[bytes]] | None:
    """The cells of a float64 ``[rows, columns]`` matrix whose ``integer_columns`` hold counts
    (written as ints, like ``str(int(x))``), as one list per run of adjacent float or int columns:
    each row's cells of that run joined by commas.  Rows joined run by run give what
    ``row_cells`` gives for ``matrix.tolist()`` with the counts made ints.  No Python object per
    row is made on the way (one orjson call per run).  None where only the exact path can say."""
    if _dumps is None or matrix.dtype != np.float64 or matrix.ndim != 2 or not matrix.shape[0] or not matrix.shape[1]:
        return None  # float32 would print float32's own shortest digits, not those of the float64
    runs = []
    for start, stop, counts in _column_runs(matrix.shape[1], frozenset(integer_columns)):
        part = matrix[:, start:stop]
        if counts:
            if not (np.isfinite(part).all() and np.abs(part).max() < _INT_LIMIT):
                return None  # a NaN count (a values row) or a huge one
            part = part.astype(np.int64)
        try:
            text = _dumps(np.ascontiguousarray(part), option=_NUMPY)
        except Exception:
            return None
        if any([word in text for word in _NOT_A_PLAIN_NUMBER]):
            return None
        runs.append(_split_rows(_layout_as_repr(text)))
    return runs


def _column_runs(width: int, counts: frozenset[int]) -> list[tuple[int, int, bool]]:
    runs: list[tuple[int, int, bool]] = []
    for j in range(width):
        is_count = j in counts
        if runs and runs[-1][2] == is_count:
            runs[-1] = (runs[-1][0], j + 1, is_count)
        else:
            runs.append((j, j + 1, is_count))
    return runs
