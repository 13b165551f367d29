"""The one value type that flows from the stats engine to the sinks: :class:`StepRows`.

A step's rows are columnar :class:`RowBlock` s (what the engine produces and the CSV sink
formats); :class:`StatRow` is the per-row view of them that row-wise sinks iterate.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, overload

if TYPE_CHECKING:
    import numpy as np

__all__ = ["StatRow", "RowBlock", "StepRows", "paced", "paced_rows", "values_of"]

T = TypeVar("T")
PACE = 32


def paced(items: Iterable[T], every: int = PACE) -> Iterator[T]:
    """``items``, letting other threads take the GIL every ``every`` items.

    Rows are built and formatted on the writer thread while the training thread runs; CPython
    hands the GIL to a waiting thread only after 5 ms otherwise, and the training thread needs it
    for every Python-level op and hook.  Measured: this removes most of the writer's cost to the
    training step (benchmarks/overhead.py).
    """
    for i, item in enumerate(items, 1):
        yield item
        if i % every == 0:
            time.sleep(0)


def paced_rows(items: Iterable[T], len_of: Callable[[T], int], every: int = PACE) -> Iterator[T]:
    """``paced`` for items that each hold ``len_of(item)`` rows: the GIL is offered every
    ``every`` rows, however they are grouped."""
    rows = 0
    for item in items:
        yield item
        rows += len_of(item)
        if rows >= every:
            rows = 0
            time.sleep(0)


@dataclass(frozen=True, slots=True)
class StatRow:
    """One CSV row: the statistics of one tensor at one (step, micro_step).

    ``stats`` is ordered (the config's ``ops`` order, or a family's own columns such as
    ``update_ratio``); counts (``nans``, ``infs``) are ints, everything else floats.
    ``micro_step`` is set only for families recorded per micro-batch (activations).
    """

    family: str
    name: str
    step: int
    stats: dict[str, float | int]
    shape: tuple[int, ...] = ()
    dtype: str = ""
    vpp_stage: int = 0
    micro_step: int | None = None
    extra: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RowBlock:
    """The rows of one capture in columnar form (one entry per tensor in each list): what the
    CSV sink formats directly, without building a ``StatRow`` per row.

    The engine hands ``matrix`` (float64, C-contiguous ``[rows, len(stats)]``; ``integer_columns``
    hold counts) and no ``values``: a Python list per row alive while a step is written is what
    made a monitored step collect young garbage every ~700 rows.  ``values`` is then built from
    the matrix the first time a sink reads it (the CSV sink never does), exactly as the engine
    used to build it: Python floats, ints in the count columns (a NaN there stays a float NaN).
    The layout lists (``names`` ...) may be the same objects step after step: never mutate them.
    """

    family: str
    step: int
    micro_step: int | None
    extra: dict[str, object] | None
    stats: tuple[str, ...]  # names of the values, in order
    names: list[str]
    vpp_stages: list[int]
    shapes: list[tuple[int, ...]]
    dtypes: list[str]
    # None with a ``matrix``: built on first read (``__getattr__``)
    values: list[list[float | int]] = None  # type: ignore[assignment]
    # True when every value is a Python float or int (the engine's blocks): sinks may format
    # them with repr; hand-built rows (``StepRows.of``) may hold other scalars or text.
    plain: bool = True
    matrix: np.ndarray | None = field(default=None, compare=False, repr=False)
    integer_columns: tuple[int, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.values is None:
            if self.matrix is None:
                raise ValueError("trainmon: a RowBlock needs values or a matrix")
            # An empty slot: the first read of ``values`` lands in ``__getattr__``, every later
            # read is a plain slot read (no property frame on the sinks' per-block loops).
            object.__delattr__(self, "values")

    def __getattr__(self, name: str) -> Any:
        # Only reached for an empty slot: ``values`` of a matrix block not read yet.
        if name != "values":
            raise AttributeError(f"'RowBlock' object has no attribute {name!r}")
        values = values_of(self.matrix, self.integer_columns)  # type: ignore[arg-type]
        object.__setattr__(self, "values", values)
        return values

    def rows(self) -> list[StatRow]:
        family, step, micro, stats, extra = self.family, self.step, self.micro_step, self.stats, self.extra
        return [
            StatRow(family, name, step, dict(zip(stats, vals)), shape, dtype, vpp, micro, dict(extra) if extra else {})
            for name, vpp, shape, dtype, vals in zip(self.names, self.vpp_stages, self.shapes, self.dtypes, self.values)
        ]


def values_of(matrix: np.ndarray, integer_columns: Sequence[int] = ()) -> list[list[float | int]]:
    """``matrix`` as rows of Python floats, ints in ``integer_columns`` (a NaN or an infinity
    there stays a float): what ``RowBlock.values`` holds for an engine block."""
    import numpy as np  # only where a matrix exists (this module is imported without numpy)

    if not integer_columns or not len(matrix):
        return matrix.tolist()
    cells = matrix.astype(object)  # Python floats
    for j in integer_columns:
        col = matrix[:, j]
        finite = np.isfinite(col)
        if finite.all() and np.abs(col).max() < 2.0**62:
            cells[:, j] = col.astype(np.int64).astype(object)  # truncation, as int() does
        else:
            cells[:, j] = [int(v) if ok else v for v, ok in zip(col.tolist(), finite.tolist())]
    return cells.tolist()


class StepRows(Sequence[StatRow]):
    """One step's rows, built on first use: what every sink's ``write`` receives.

    The engine hands these to the sink so that turning partials into rows happens on the sink's
    writer thread, not in the training step; a sink that formats ``blocks()`` never builds the
    per-row objects at all.  ``StepRows.of(rows)`` wraps rows built by hand (tests, converters).
    """

    __slots__ = ("_blocks", "_build", "_rows", "wall_time")

    def __init__(self, build: Callable[[], list[RowBlock]], wall_time: float | None = None):
        self._build: Callable[[], list[RowBlock]] | None = build
        self._blocks: list[RowBlock] | None = None
        self._rows: list[StatRow] | None = None
        # When the step was recorded (Unix seconds), stamped where the rows are made (the training
        # thread): every sink writes this one time (step_times.tsv, TensorBoard events), not the
        # later moment its writer thread gets to the step.
        self.wall_time: float = time.time() if wall_time is None else wall_time

    @classmethod
    def of(cls, rows: Iterable[StatRow], wall_time: float | None = None) -> StepRows:
        """Rows built by hand, as blocks (consecutive rows with one layout share a block)."""
        rows = list(rows)
        return cls(lambda: _blocks_of(rows), wall_time)

    def blocks(self) -> list[RowBlock]:
        if self._blocks is None:
            self._blocks = self._build()  # type: ignore[misc]
            self._build = None
        return self._blocks

    def _all(self) -> list[StatRow]:
        if self._rows is None:
            self._rows = [row for block in paced(self.blocks(), 1) for row in block.rows()]
        return self._rows

    def __len__(self) -> int:
        return sum(len(b.names) for b in self.blocks()) if self._rows is None else len(self._rows)

    def __iter__(self) -> Iterator[StatRow]:
        return iter(self._all())

    @overload
    def __getitem__(self, i: int) -> StatRow: ...
    @overload
    def __getitem__(self, i: slice) -> list[StatRow]: ...

    def __getitem__(self, i):
        return self._all()[i]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, tuple, StepRows)):
            return self._all() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"StepRows({'unbuilt' if self._blocks is None else len(self)})"


def _blocks_of(rows: Sequence[StatRow]) -> list[RowBlock]:
    blocks: list[RowBlock] = []
    key = None
    for r in rows:
        k = (r.family, r.step, r.micro_step, tuple(r.extra.items()) if r.extra else (), tuple(r.stats))
        if k != key:
            blocks.append(
                RowBlock(
                    r.family,
                    r.step,
                    r.micro_step,
                    dict(r.extra) if r.extra else None,
                    tuple(r.stats),
                    [],
                    [],
                    [],
                    [],
                    [],
                    plain=True,
                )
            )
            key = k
        b = blocks[-1]
        b.names.append(r.name)
        b.vpp_stages.append(r.vpp_stage)
        b.shapes.append(tuple(r.shape))
        b.dtypes.append(r.dtype)
        vals = list(r.stats.values())
        if b.plain and not all(type(v) in (float, int) for v in vals):
            blocks[-1] = b = dataclasses.replace(b, plain=False)
        b.values.append(vals)
    return blocks
