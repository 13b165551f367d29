"""Columnar output: the CSV sink's families and columns as Parquet files (``"format": ["parquet"]``).

One file per (family, step window, header variant), named like the CSV files with the
``.parquet`` extension (``trainmon.output.layout``).  Columns, order and values are the CSV
sink's: ``vpp_stage, name, step, [micro_step], <extra...>, <stats...>, shape, dtype``; integers
(keys, counts, integer extras) are int64, floats float64 (rounded to ``ndigits`` significant
digits when set, as in the CSV), ``name``/``shape``/``dtype`` and text extras strings, ``shape``
spelled ``[64, 32]`` as in the CSV.

Crash safety.  A Parquet file is only readable once its footer is written, so a file cannot
grow row by row like a CSV.  Each *open* window (``step_count_per_record`` steps) is written to
a hidden temp file in the rank dir (``layout.partial_file_name``: ``.<name>.<pid>-<writer>.tmp``),
one row group per ``ROW_GROUP_ROWS`` buffered rows (so the sink's memory stays bounded however long
a window is); when the window ends its footer is written and the file is renamed to its final name
with ``os.replace``.  A rename is atomic, so a killed run leaves every file that has its final name
complete and readable, no file half-written under a family name (a stale ``.tmp`` is ignored by
every reader), and loses at most the rows of the windows still open -- with
``step_count_per_record: 1`` a window is one step, closed as soon as the step's rows arrive.
``flush`` closes the open windows' files too; a window's later rows then go to its next ``.{k}``
file, which readers concatenate in order.  Final names are claimed process-wide
(``sinks.base.claim_file``): two sinks of one process writing one rank dir (an escalation's
recorder and window) never pick the same file.  Failures never reach
the training loop: logged once, counted, reported at ``close`` like the CSV sink.
"""

from __future__ import annotations

import logging
import numbers
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa  # type: ignore[import-untyped]  # pyarrow ships no stubs
import pyarrow.parquet as pq  # type: ignore[import-untyped]  # pyarrow ships no stubs

from trainmon.output.layout import family_file_name, partial_file_name, window_bounds
from trainmon.sinks.base import LostRows, Sink, SinkOptions, claim_file, register_sink, sync_dir, writer_token
from trainmon.sinks.step_times import StepTimes
from trainmon.stats.rows import RowBlock, StepRows, paced

__all__ = ["ParquetSink", "COMPRESSION"]

logger = logging.getLogger(__name__)

COMPRESSION = "zstd"
# Rows buffered per open file before they go to its temp file as one row group: bounds the sink's
# memory however many steps a window (``step_count_per_record``) holds.
ROW_GROUP_ROWS = 65_536
_FileKey = tuple[str, int, tuple[str, ...]]  # (family, window start, columns)


def _shape_text(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


@dataclass
class _Window:
    """One open file: rows buffered per column, and the temp file its full row groups went to."""

    family: str
    a: int
    b: int
    columns: tuple[str, ...]
    cells: dict[str, list] = field(default_factory=dict)
    path: Path | None = None  # final name, chosen when the first row group is written
    writer: pq.ParquetWriter | None = None
    written: int = 0  # rows already in the temp file
    token: int = 0  # the sink's writer token: its temp files' names differ from other sinks' here

    def __post_init__(self):
        self.clear()

    def clear(self) -> None:
        self.cells = {c: [] for c in self.columns}

    @property
    def rows(self) -> int:
        return len(self.cells["name"])

    @property
    def tmp(self) -> Path:
        assert self.path is not None
        return self.path.with_name(partial_file_name(self.path.name, os.getpid(), self.token))


class _Values:
    """Python values -> Arrow arrays typed as the CSV reader would parse the same cells."""

    def __init__(self, ndigits: int | None):
        if ndigits is not None and (isinstance(ndigits, bool) or int(ndigits) < 1):
            raise ValueError(f"ndigits must be a positive number of significant digits, got {ndigits!r}")
        self._spec = None if ndigits is None else f".{int(ndigits)}g"

    def array(self, values: list) -> pa.Array:
        if all(type(v) is int for v in values):
            return pa.array(values, type=pa.int64())
        if all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in values):
            if all(isinstance(v, numbers.Integral) for v in values):
                return pa.array([int(v) for v in values], type=pa.int64())
            return pa.array([self._float(v) for v in values], type=pa.float64())
        return pa.array([str(v) for v in values], type=pa.string())  # as the CSV's text cells

    def _float(self, value) -> float:
        value = float(value)
        return value if self._spec is None else float(format(value, self._spec))


@register_sink("parquet")
class ParquetSink(Sink):
    """Writes each step window of each family as one Parquet file under ``options.rank_dir``."""

    def __init__(self, options: SinkOptions, row_group_rows: int = ROW_GROUP_ROWS):
        super().__init__(options)
        self._row_group_rows = max(1, int(row_group_rows))
        self._steps_per_file = int(options.step_count_per_record)
        if self._steps_per_file < 1:
            raise ValueError(f"step_count_per_record must be >= 1, got {options.step_count_per_record!r}")
        self._values = _Values(options.ndigits)
        self._dir = Path(options.rank_dir)
        self._open: dict[_FileKey, _Window] = {}
        self._token = writer_token()
        self._lock = threading.Lock()
        self._lost = LostRows(self._dir, logger)
        self._times = StepTimes(self._dir)  # step_times.tsv: when each written step was recorded

    # -- Sink interface -------------------------------------------------------------------

    def write(self, rows: StepRows, step: int) -> None:
        with self._lock:
            blocks = rows.blocks()
            for b in paced(blocks, 4):
                self._add(b)
            if blocks:
                self._times.record(int(step), rows.wall_time)  # shared with a CSV sink of this rank
            # A window is finished once a step at or past its end has been written (steps only
            # grow; a window left behind by a skipped step is finished too).
            for key, w in list(self._open.items()):
                if w.b <= int(step):
                    self._finish(w)
                    del self._open[key]

    def flush(self) -> None:
        """Every open window's rows so far become a complete file; its later rows go to the next
        ``.{k}`` file of the window (readers concatenate them in order)."""
        with self._lock:
            for w in self._open.values():
                self._finish(w)

    def close(self) -> None:
        with self._lock:
            for w in self._open.values():
                self._finish(w)
            self._open.clear()
            self._times.close()
            sync_dir(self._dir)
            self._lost.report()

    @property
    def lost_rows(self) -> int:
        """Rows dropped because their file could not be written."""
        return self._lost.count

    # -- buffering ------------------------------------------------------------------------

    def _add(self, b: RowBlock) -> None:
        a, end = window_bounds(int(b.step), self._steps_per_file)
        extra = tuple(b.extra) if b.extra else ()
        columns = (
            "vpp_stage",
            "name",
            "step",
            *(("micro_step",) if b.micro_step is not None else ()),
            *extra,
            *b.stats,
            "shape",
            "dtype",
        )
        key = (b.family, a, columns)
        w = self._open.get(key)
        if w is None:
            w = self._open[key] = _Window(b.family, a, end, columns, token=self._token)
        n = len(b.names)
        cells = w.cells
        cells["vpp_stage"].extend(int(v) for v in b.vpp_stages)
        cells["name"].extend(str(x) for x in b.names)
        cells["step"].extend([int(b.step)] * n)
        if b.micro_step is not None:
            cells["micro_step"].extend([int(b.micro_step)] * n)
        for col, v in (b.extra or {}).items():
            cells[col].extend([v] * n)
        for i, col in enumerate(b.stats):
            cells[col].extend(vals[i] for vals in b.values)
        cells["shape"].extend(_shape_text(s) for s in b.shapes)
        cells["dtype"].extend(str(d) for d in b.dtypes)
        if w.rows >= self._row_group_rows:
            self._spill(w)

    # -- files ----------------------------------------------------------------------------

    def _table(self, w: _Window) -> pa.Table:
        arrays = []
        for col in w.columns:
            if col in ("name", "shape", "dtype"):
                arrays.append(pa.array(w.cells[col], type=pa.string()))
            else:
                arrays.append(self._values.array(w.cells[col]))
        return pa.Table.from_arrays(arrays, names=list(w.columns))

    def _spill(self, w: _Window) -> None:
        """The buffered rows as one row group of the window's temp file."""
        if not w.rows:
            return
        try:
            table = self._table(w)
            if w.writer is not None and table.schema != w.writer.schema:
                try:
                    table = table.cast(w.writer.schema)  # e.g. ints in a float column
                except (pa.ArrowException, ValueError):
                    self._close_file(w)  # another type: the next .{k} file
            if w.writer is None:
                w.path = self._choose_path(w)
                w.writer = pq.ParquetWriter(w.tmp, table.schema, compression=COMPRESSION)
            w.writer.write_table(table)
            w.written += w.rows
        except (OSError, pa.ArrowException, ValueError, TypeError) as exc:
            self._failed(w, exc, w.rows)
        w.clear()

    def _finish(self, w: _Window) -> None:
        self._spill(w)
        if w.writer is not None:
            self._close_file(w)

    def _close_file(self, w: _Window) -> None:
        """Footer, then the atomic rename that makes the file visible under its family name."""
        writer, w.writer = w.writer, None
        assert writer is not None and w.path is not None  # called only for a window with an open file
        try:
            writer.close()
            os.replace(w.tmp, w.path)
        except (OSError, pa.ArrowException) as exc:
            self._failed(w, exc, 0)
        w.written = 0

    def _choose_path(self, w: _Window) -> Path:
        """The first free ``{family}_{a}-{b}[.{k}].parquet``: a file already there (another header
        of this window, a resumed run) is never overwritten."""
        self._dir.mkdir(parents=True, exist_ok=True)
        k = 0
        while True:
            path = self._dir / family_file_name(w.family, w.a, w.b, k, ext="parquet")
            k += 1
            if not path.exists() and claim_file(path):  # a file of another sink here appears only when done
                return path

    def _failed(self, w: _Window, exc: Exception, rows: int) -> None:
        """``rows`` buffered rows are lost; an unfinished temp file loses what it holds too."""
        if w.writer is not None:
            try:
                w.writer.close()
            except (OSError, pa.ArrowException):
                pass
            w.writer = None
        if w.path is not None:
            try:
                w.tmp.unlink()
            except OSError:
                pass
        self._lost.lose(rows + w.written, w.path or self._dir, exc)
        w.written = 0
