"""The default sink: msprobe-compatible CSV files, one per (family, step window).

Layout and format are described for users in docs/output_files.md.  The implementation
choices that matter:

* Each ``write()`` renders, per target file, the complete text of that step (plus the
  header when the file is new) and appends it with ``os.write`` on an ``O_APPEND`` fd.
  Nothing is buffered in user space, so a process killed after ``write()`` returned has
  lost nothing (the page cache survives the process), and a file only ever grows by whole
  steps' worth of whole rows.
* A file's header is fixed when it is created.  Rows whose columns differ from an
  existing file's header (``ops`` changed by a config reload) go to a sibling file
  ``{family}_{a}-{b}.{k}.csv`` instead of being appended under the wrong header.
* Failures (unwritable directory, full disk) never reach the training loop: the first is
  logged as one warning, the rest are counted and reported at ``close()``.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any, SupportsFloat, cast

import numpy as np

from trainmon.output.layout import family_file_name, partial_file_name, window_bounds
from trainmon.sinks.base import LostRows, Sink, SinkOptions, register_sink, sync_dir, writer_token
from trainmon.sinks.csv_text import matrix_cells, row_cells
from trainmon.sinks.step_times import StepTimes
from trainmon.stats.rows import RowBlock, StepRows, paced

__all__ = ["CsvSink"]

logger = logging.getLogger(__name__)

_OPEN_FLAGS = os.O_RDWR | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)
_CACHE_LIMIT = 100_000  # distinct names/shapes remembered; tensor names repeat every step

_PIECE_ROWS = 2048  # rows formatted in one C call (csv_text, the %-template)
_TEMPLATE_LIMIT = 1024  # block layouts remembered (a family's weights, an activation block per module run)
_LEAD = b"\x00"  # where a row template takes the block's shared cells (step, micro_step, extra)

# (family, window start, columns): the identity of one header-compatible file.
_FileKey = tuple[str, int, tuple[str, ...]]


def _pieces(b: RowBlock) -> Iterator[RowBlock]:
    """``b`` in pieces of at most ``_PIECE_ROWS`` rows, the GIL offered between them: a block is
    formatted in one C call, which holds the GIL throughout (a few ms per 2,048 rows)."""
    n = len(b.names)
    if n <= _PIECE_ROWS:
        yield b
        return
    matrix = getattr(b, "matrix", None)
    for i in range(0, n, _PIECE_ROWS):
        j = i + _PIECE_ROWS
        rows = slice(i, j)
        fields: dict[str, Any] = {"names": b.names[rows], "vpp_stages": b.vpp_stages[rows], "shapes": b.shapes[rows]}
        if matrix is not None:  # its values are built from the piece's matrix only if read
            fields.update(dtypes=b.dtypes[rows], values=None, matrix=matrix[rows])
        else:
            fields.update(dtypes=b.dtypes[rows], values=b.values[rows])
        yield dataclasses.replace(b, **fields)
        time.sleep(0)


@dataclass(slots=True)
class _FileText:
    """One file's share of a step: encoded blocks, and how many rows they hold."""

    chunks: list[bytes]
    rows: int


def _quote(text: str) -> str:
    if "," in text or '"' in text or "\n" in text or "\r" in text:
        return '"' + text.replace('"', '""') + '"'
    return text


def _shape_cell(shape: Sequence[int]) -> str:
    return _quote("[" + ", ".join(str(int(d)) for d in shape) + "]")


class _Formatter:
    """Turns values into CSV cells; floats at full precision unless ``ndigits`` is set."""

    def __init__(self, ndigits: int | None):
        if ndigits is not None and (isinstance(ndigits, bool) or int(ndigits) < 1):
            raise ValueError(f"ndigits must be a positive number of significant digits, got {ndigits!r}")
        self._spec = None if ndigits is None else f".{int(ndigits)}g"
        self.full_precision = ndigits is None

    def number(self, value: object) -> str:
        if type(value) is float:  # the common case, first
            return repr(value) if self._spec is None else format(value, self._spec)
        if isinstance(value, float):
            return self._float(value)
        if isinstance(value, numbers.Integral):  # bool too: a statistic cell holds numbers only
            return str(int(value))
        try:
            return self._float(float(cast(SupportsFloat, value)))  # numpy / torch scalars
        except (TypeError, ValueError):
            return "nan"  # not a number (None, text): what the TensorBoard sink records too

    def cell(self, value: object) -> str:
        """An ``extra`` value: numbers as numbers, anything else as (quoted) text."""
        if isinstance(value, numbers.Real):
            return self.number(value)
        return _quote(str(value))

    def _float(self, value: float) -> str:
        # float() first: repr of a numpy float64 is "np.float64(...)" in numpy 2.
        value = float(value)
        return repr(value) if self._spec is None else format(value, self._spec)


def _columns(micro: bool, extra: tuple[str, ...], stats: tuple[str, ...]) -> tuple[str, ...]:
    return ("vpp_stage", "name", "step", *(("micro_step",) if micro else ()), *extra, *stats, "shape", "dtype")


class _FdCache:
    """Open fds by path, least recently used first; beyond ``limit`` the oldest is closed."""

    def __init__(self, limit: int):
        self.limit = max(1, int(limit))
        self._fds: OrderedDict[Path, int] = OrderedDict()

    def get(self, path: Path) -> int | None:
        fd = self._fds.get(path)
        if fd is not None:
            self._fds.move_to_end(path)
        return fd

    def put(self, path: Path, fd: int) -> None:
        self._fds[path] = fd
        while len(self._fds) > self.limit:
            _, old = self._fds.popitem(last=False)
            _close_quietly(old)

    def drop(self, path: Path) -> None:
        fd = self._fds.pop(path, None)
        if fd is not None:
            _close_quietly(fd)

    def close_all(self, sync: bool) -> None:
        while self._fds:
            path, fd = self._fds.popitem(last=False)
            if sync:
                try:
                    os.fsync(fd)
                except OSError as exc:  # e.g. EIO, or a file system without fsync
                    logger.debug("fsync of %s failed: %s", path, exc)
            _close_quietly(fd)


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# On a file system without hard links (some FUSE mounts, vfat) publishing is a check and a
# rename, which the sinks of this process take turns at: a rename would replace the file another
# sink just made, and with it that sink's rows.
_RENAME_LOCK = threading.Lock()


def _publish(tmp: Path, path: Path) -> None:
    """Give the finished ``tmp`` its real name, never replacing a file that appeared meanwhile
    (``FileExistsError``); on a file system without hard links, a rename under ``_RENAME_LOCK``."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:
        with _RENAME_LOCK:
            if os.path.lexists(path):
                raise FileExistsError(f"{path} was made by another sink of this process") from None
            os.replace(tmp, path)
        return
    os.unlink(tmp)


# Creating a file loses to another sink of this process making it first at most this many times
# in a row (each loss leaves a file to append to, or a name with another header to skip).
_PUBLISH_TRIES = 4


class _TailDamaged(OSError):
    """A write failed part way and the partial text could not be cut off again."""


def _write_all(fd: int, data: bytes) -> None:
    """Append all of ``data``; on failure, cut the file back so it ends on a whole row."""
    view = memoryview(data)
    written = 0
    try:
        while written < len(data):
            n = os.write(fd, view[written:])
            if n <= 0:  # a regular file never does this; do not spin if one does
                raise OSError(f"write returned {n}")
            written += n
    except OSError as exc:
        if written:
            # Only this sink appends to the file, so its end minus what we added is where
            # this step's text began: cut it back so the file still ends on a whole row.
            try:
                os.ftruncate(fd, os.fstat(fd).st_size - written)
            except OSError as again:
                raise _TailDamaged(f"{exc}; could not remove the partial row: {again}") from exc
        raise


@register_sink("csv")
class CsvSink(Sink):
    """Writes :class:`StatRow` s as ``{family}_{a}-{b}.csv`` files under ``options.rank_dir``.

    ============ ================================================================
    column       content
    ============ ================================================================
    vpp_stage    virtual pipeline stage (int)
    name         tensor name, csv-quoted when it holds a comma or quote
    step         training step (int)
    micro_step   micro-batch index; only in files of rows that carry one
    <extra>      the row's ``extra`` keys, in order
    <ops>        the row's ``stats`` keys, in order; floats full precision
                 (``repr``) or ``ndigits`` significant digits; counts as ints
    shape        like ``"[64, 32]"``; ``[]`` for a scalar
    dtype        like ``torch.float32``
    ============ ================================================================
    """

    def __init__(self, options: SinkOptions, max_open_files: int = 64):
        super().__init__(options)
        self._steps_per_file = int(options.step_count_per_record)
        if self._steps_per_file < 1:
            raise ValueError(f"step_count_per_record must be >= 1, got {options.step_count_per_record!r}")
        self._fmt = _Formatter(options.ndigits)
        self._dir = Path(options.rank_dir)
        self._fds = _FdCache(max_open_files)
        self._paths: dict[_FileKey, Path] = {}  # files this sink has chosen
        self._claimed: set[Path] = set()  # paths taken by some header (ours or on disk)
        self._retired: set[Path] = set()  # paths whose tail we could not repair
        self._lock = threading.Lock()
        self._heads: dict[tuple, str] = {}  # (vpp_stage, name) -> "vpp,name,"
        self._tails: dict[tuple, str] = {}  # (shape, dtype) -> ",shape,dtype\n"
        self._templates: dict[tuple, tuple] = {}  # a block layout -> its rows' template (_template)
        self._lost = LostRows(self._dir, logger)
        self._token = writer_token()  # its temporary files' names differ from other sinks' here
        self._warned_removed = False
        self._times = StepTimes(self._dir)  # step_times.tsv: when each written step was recorded

    # -- Sink interface -------------------------------------------------------------------

    def write(self, rows: StepRows, step: int) -> None:
        with self._lock:
            grouped = self._group_blocks(rows.blocks())
            for (family, a, columns), text in grouped.items():
                self._append(family, a, columns, text)
            if grouped:
                self._times.record(step, rows.wall_time)

    def flush(self) -> None:
        # Every write() already reached the kernel; there is nothing buffered here.
        pass

    def close(self) -> None:
        with self._lock:
            self._fds.close_all(sync=True)
            self._times.close()
            sync_dir(self._dir)
            self._lost.report()

    @property
    def lost_rows(self) -> int:
        """Rows dropped because their file could not be written."""
        return self._lost.count

    # -- rendering ------------------------------------------------------------------------

    def _group_blocks(self, blocks: Sequence[RowBlock]) -> dict[_FileKey, _FileText]:
        """Text per file, formatted from the columnar blocks without a ``StatRow`` per row (this
        runs on the writer thread, which shares the GIL with training)."""
        layouts = ((self._layout(b.family, b.step, b.micro_step, b.extra, b.stats), b) for b in paced(blocks, 4))
        return self._by_file(layouts)

    def _layout(self, family: str, step: int, micro: int | None, extra: dict | None, stats: tuple[str, ...]) -> tuple:
        n = self._steps_per_file
        return family, step // n * n, micro is not None, tuple(extra) if extra else (), stats

    def _by_file(self, pieces) -> dict[_FileKey, _FileText]:
        by_layout: dict[tuple, _FileText] = {}
        for layout, block in pieces:
            text = b"".join([self._block_text(part) for part in _pieces(block)])
            found = by_layout.get(layout)
            if found is None:
                by_layout[layout] = _FileText([text], len(block.names))
            else:
                found.chunks.append(text)
                found.rows += len(block.names)
        return {(family, a, _columns(*layout)): text for (family, a, *layout), text in by_layout.items()}

    def _block_text(self, b: RowBlock) -> bytes:
        """The block's rows as CSV bytes, in one pass over the whole block where the numbers allow
        (a cached per-layout %-template filled in one C call), else a line at a time: the numbers
        as ``csv_text`` writes them (one C call for all), else ``%r`` of each value in the
        template (``repr``, NaN and infinities included), else the per-line path."""
        if not (self._fmt.full_precision and b.plain and b.stats):
            return "".join(self._block_lines(b)).encode()
        runs = self._cells(b)
        if runs is not None:
            template = self._template(b, ",%s" * len(runs))
            if template is not None:
                cells = tuple(runs[0]) if len(runs) == 1 else tuple(chain.from_iterable(zip(*runs)))
                return self._filled(template, b, cells)
        filled = self._matrix_text(b)
        if filled is not None:
            return filled
        width = len(b.stats)
        if b.values and set(map(len, b.values)) == {width}:
            template = self._template(b, ",%r" * width)  # bytes' %r is ascii(repr(x)): repr for numbers
            if template is not None:
                return self._filled(template, b, tuple(chain.from_iterable(b.values)))
        return "".join(self._block_lines(b)).encode()

    def _matrix_text(self, b: RowBlock) -> bytes | None:
        """A float64 matrix block in the %-template without ``orjson``: ``%r`` per float (``repr``,
        NaN and infinities included) and ``%d`` per count (``str(int(x))``), fed one flat list of
        floats; floats are not containers the collector tracks, so no per-row garbage either.
        None where a count is not finite (a values row) or there is no such matrix."""
        matrix = getattr(b, "matrix", None)
        if matrix is None or matrix.dtype != np.float64 or matrix.ndim != 2 or matrix.shape[1] != len(b.stats):
            return None
        counts = frozenset(getattr(b, "integer_columns", ()))
        if counts and not np.isfinite(matrix[:, sorted(counts)]).all():
            return None
        template = self._template(b, "".join([",%d" if j in counts else ",%r" for j in range(matrix.shape[1])]))
        return None if template is None else self._filled(template, b, tuple(matrix.ravel().tolist()))

    def _filled(self, template: bytes, b: RowBlock, cells: tuple) -> bytes:
        return template.replace(_LEAD, self._lead(b).replace("%", "%%").encode()) % cells

    @staticmethod
    def _cells(b: RowBlock) -> list[list[bytes]] | None:
        """Each row's number cells, per run of columns (``csv_text``): from the block's float64
        matrix when the engine hands one (no Python object per row), else from its values."""
        matrix = getattr(b, "matrix", None)
        if matrix is not None:  # else the %-template fills it from the matrix (``_matrix_text``)
            return matrix_cells(matrix, getattr(b, "integer_columns", ()))
        row_texts = row_cells(b.values)
        return None if row_texts is None else [row_texts]

    def _lead(self, b: RowBlock) -> str:
        """The cells every row of a block shares: step, micro_step, extra values."""
        lead = str(int(b.step))
        if b.micro_step is not None:
            lead += "," + str(int(b.micro_step))
        if b.extra:
            lead += "".join(["," + self._fmt.cell(v) for v in b.extra.values()])
        return lead

    def _template(self, b: RowBlock, cells: str) -> bytes | None:
        """``b``'s rows as a %-template: ``head<LEAD><cells><tail>`` per row, the same bytes step
        after step while the family's tensors stay the same, so it is built once (None: a name
        holds the lead marker, left to the per-line path)."""
        key = (b.family, cells, len(b.names), b.names[0] if b.names else None)
        found = self._templates.get(key)
        layout = [b.names, b.vpp_stages, b.shapes, b.dtypes]
        if found is not None and [found[0], found[1], found[2], found[3]] == layout:
            return found[4]
        template = self._build_template(b, cells)
        if len(self._templates) >= _TEMPLATE_LIMIT:
            self._templates.clear()
        self._templates[key] = (list(b.names), list(b.vpp_stages), list(b.shapes), list(b.dtypes), template)
        return template

    def _build_template(self, b: RowBlock, cells: str) -> bytes | None:
        parts = [
            head.replace("%", "%%") + "\x00" + cells + tail.replace("%", "%%") for head, tail in self._heads_tails(b)
        ]
        text = "".join(parts).encode()
        return None if text.count(_LEAD) != len(parts) else text

    def _block_lines(self, b: RowBlock) -> list[str]:
        # Engine-derived values are Python floats and ints: repr is the full-precision cell.
        number = repr if self._fmt.full_precision and b.plain else self._fmt.number
        lead = self._lead(b)
        return [
            ",".join([head + lead, *map(number, vals)]) + tail
            for (head, tail), vals in zip(self._heads_tails(b), b.values)
        ]

    def _heads_tails(self, b: RowBlock) -> Iterator[tuple[str, str]]:
        """Each row's text before its step (vpp stage, name) and after its numbers (shape, dtype),
        from caches shared by every block."""
        heads, tails = self._heads, self._tails
        for name, vpp, shape, dtype in zip(b.names, b.vpp_stages, b.shapes, b.dtypes):
            head = heads.get((vpp, name))
            if head is None:
                head = self._remember(heads, (vpp, name), f"{int(vpp)},{_quote(str(name))},")
            tail = tails.get((shape, dtype))
            if tail is None:
                tail = self._remember(tails, (shape, dtype), f",{_shape_cell(shape)},{_quote(str(dtype))}\n")
            yield head, tail

    @staticmethod
    def _remember(cache: dict, key: tuple, text: str) -> str:
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()
        cache[key] = text
        return text

    # -- files ----------------------------------------------------------------------------

    def _append(self, family: str, a: int, columns: tuple[str, ...], text: _FileText) -> None:
        header = (",".join(_quote(c) for c in columns) + "\n").encode()
        body = b"".join(text.chunks)
        path = self._paths.get((family, a, columns)) or self._dir / family_file_name(
            family, *window_bounds(a, self._steps_per_file)
        )
        try:
            for _ in range(_PUBLISH_TRIES):
                path, fd, is_new = self._open_for(family, a, columns, header)
                if fd is not None:
                    _write_all(fd, header + body if is_new else body)
                    return
                if self._create(path, header + body):
                    return
            raise FileExistsError(f"{path} kept being created by another writer of this directory")
        except OSError as exc:
            self._failed(path, exc, text.rows)

    def _open_for(self, family: str, a: int, columns: tuple[str, ...], header: bytes) -> tuple[Path, int | None, bool]:
        """The fd to append rows with these columns to (None: the file does not exist yet, create
        it with its first rows), and whether it still needs the header."""
        key = (family, a, columns)
        path = self._paths.get(key)
        if path is not None and path not in self._retired:
            fd = self._fds.get(path)
            if fd is not None and not self._unlinked(path, fd):
                return path, fd, False
            opened = self._try_open(path, header)  # reopened after LRU eviction or removal
            if opened is not None:
                return path, opened[0], opened[1]
            del self._paths[key]  # replaced behind our back: pick a fresh name below
        b = window_bounds(a, self._steps_per_file)[1]
        k = 0
        while True:  # ends: each turn claims a name, and only finitely many files exist
            path = self._dir / family_file_name(family, a, b, k)
            k += 1
            if path in self._claimed or path in self._retired:
                continue
            opened = self._try_open(path, header)
            self._claimed.add(path)
            if opened is not None:
                self._paths[key] = path
                return path, opened[0], opened[1]

    def _unlinked(self, path: Path, fd: int) -> bool:
        """True (after one warning per sink) when the open file was deleted, e.g. with the whole
        output folder: rows appended to it would be lost without a trace, so it is made again."""
        try:
            if os.fstat(fd).st_nlink > 0:
                return False
        except OSError:
            pass
        self._fds.drop(path)
        if not self._warned_removed:
            self._warned_removed = True
            logger.warning(
                "trainmon: monitor output %s was deleted while this run writes it (folder "
                "removed?); recreating it, rows from now on are kept",
                path,
            )
        return True

    def _try_open(self, path: Path, header: bytes) -> tuple[int | None, bool] | None:
        """Open ``path`` for appending rows under ``header``: (fd, is_new), (None, True) if it does
        not exist yet, or None if the file already holds a different header."""
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except FileNotFoundError:
            return None, True
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, len(header), 0) != header:
                _close_quietly(fd)
                return None
        except OSError:
            _close_quietly(fd)
            raise
        self._fds.put(path, fd)
        return fd, size == 0

    def _create(self, path: Path, data: bytes) -> bool:
        """Make ``path`` with its header and first rows in one step: written under a hidden
        temporary name, then linked into place, so a full disk or a kill never leaves an empty
        or header-only file under a family file's name.  False (nothing written) when another
        sink of this process made ``path`` meanwhile: the caller appends to that file instead."""
        tmp = path.with_name(partial_file_name(path.name, os.getpid(), self._token))
        _unlink_quietly(tmp)  # left by a killed process that had this pid
        try:
            fd = os.open(tmp, _OPEN_FLAGS | os.O_CREAT | os.O_EXCL, 0o644)
        except FileNotFoundError:
            # First file of the run, or the directory was removed while running.
            self._dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, _OPEN_FLAGS | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(fd, data)
            _publish(tmp, path)
        except BaseException as exc:
            _close_quietly(fd)
            _unlink_quietly(tmp)
            if isinstance(exc, FileExistsError):
                return False
            raise
        self._fds.put(path, fd)
        return True

    def _failed(self, path: Path, exc: OSError, n_rows: int) -> None:
        self._lost.lose(n_rows, path, exc)
        self._fds.drop(path)  # reopen next time: fstat then tells whether a header is due
        if isinstance(exc, _TailDamaged):
            self._retired.add(path)  # it may end in half a row: never append there again
