"""Native TensorBoard output: one event file per rank, one event per step holding every value.

Where and under which tags is decided in :mod:`trainmon.output.tb_tags` (shared with
``trainmon csv2tb``).  Implementation choices:

* **Values are float32.** TensorBoard keeps scalars as float32 (``simple_value``; its
  default Rust data server has no other scalar type), so every value written is the float32
  nearest to the CSV cell -- ``numpy.float32(csv_value)``, +-inf beyond float32's range,
  counts exact up to 2**24.  The CSV keeps full float64 precision; both the native sink and
  ``csv2tb`` apply the same conversion, so their events are identical.
* **Speed.** ``SummaryWriter.add_scalar`` per value costs ~0.1 ms and blocks on its queue;
  here the wire bytes of a value are a cached per-tag prefix plus 4 bytes, and a step is one
  record.  TensorBoard's pure-Python CRC-32C runs at ~5 MB/s (a 1,000-param step is ~1 MB),
  so records are checksummed with the vectorised CRC below (~150-300 MB/s with numpy).
  The file header is built with TensorBoard's own ``event_pb2``.
* **Durability.** Each step's record is appended with ``os.write`` on an ``O_APPEND`` fd and
  nothing is buffered in user space: a TensorBoard started during the run sees a step as soon
  as ``write`` returned, and a killed run leaves every written step readable (a record cut
  by the kill is at the end, where TensorBoard's readers stop).  ``close`` fsyncs.
* The sink writes synchronously; ``create_sink`` puts it behind the off-thread ``AsyncSink``.
"""

from __future__ import annotations

import logging
import math
import numbers
import operator
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from itertools import chain, count
from pathlib import Path
from typing import SupportsFloat, cast

import numpy as np

from trainmon.families import NOT_SCALAR
from trainmon.output.tb_tags import event_dir, scalar_tag, series_name
from trainmon.sinks.base import Sink, SinkOptions, register_sink
from trainmon.stats.rows import StatRow, StepRows, paced

__all__ = [
    "TensorBoardSink",
    "EventFile",
    "crc32c",
    "masked_crc32c",
    "encode_event",
    "frame_record",
    "value_prefix",
    "row_prefixes",
    "f32_bytes",
    "make_rounder",
    "tb_rank_dir",
    "event_file_name",
]

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------
# CRC-32C (Castagnoli), as TFRecord framing needs.  Data is cut into equal lanes whose CRCs
# are computed side by side with numpy (4 bytes per step through two 16-bit tables), then
# combined pairwise: crc(A+B) = Z^len(B)(crc(A)) ^ crc(B), with Z^m the GF(2)-linear effect
# of m zero bytes on the register, also applied through 16-bit tables.
# --------------------------------------------------------------------------------------------
_POLY = 0x82F63B78


def _byte_table() -> np.ndarray:
    t = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        t = np.where(t & 1, (t >> 1) ^ np.uint32(_POLY), t >> 1).astype(np.uint32)
    return t


_T0 = _byte_table()
_T1 = _T0[_T0 & 0xFF] ^ (_T0 >> 8)
_T2 = _T0[_T1 & 0xFF] ^ (_T1 >> 8)
_T3 = _T0[_T2 & 0xFF] ^ (_T2 >> 8)
_T0_LIST = _T0.tolist()
_IDX16 = np.arange(65536, dtype=np.uint32)
# after ``reg ^= word``: reg' = T3[b0] ^ T2[b1] ^ T1[b2] ^ T0[b3], as two 16-bit lookups
_WORD_LO = _T3[_IDX16 & 0xFF] ^ _T2[_IDX16 >> 8]
_WORD_HI = _T1[_IDX16 & 0xFF] ^ _T0[_IDX16 >> 8]
_BASIS = np.array([1 << j for j in range(32)], dtype=np.uint32)
_shift_tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def _crc_bytes(reg: int, data: bytes) -> int:
    t = _T0_LIST
    for b in data:
        reg = t[(reg ^ b) & 0xFF] ^ (reg >> 8)
    return reg


def _halves(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Views of the low and high 16 bits of a contiguous uint32 array."""
    lo, hi = x.view(np.uint16).reshape(-1, 2).T
    return (lo, hi) if sys.byteorder == "little" else (hi, lo)


def _apply16(tables: tuple[np.ndarray, np.ndarray], x: np.ndarray) -> np.ndarray:
    lo, hi = _halves(np.ascontiguousarray(x, dtype=np.uint32))
    return np.take(tables[0], lo) ^ np.take(tables[1], hi)


def _tables_of(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """16-bit lookup tables of the linear map sending bit j to ``images[j]``."""
    out = []
    for base in (images[:16], images[16:]):
        tab = np.zeros(65536, dtype=np.uint32)
        for j in range(16):
            tab[1 << j : 2 << j] = tab[: 1 << j] ^ base[j]
        out.append(tab)
    return out[0], out[1]


def _zero_shift(m: int) -> tuple[np.ndarray, np.ndarray]:
    tables = _shift_tables.get(m)
    if tables is None:
        if m == 1:
            images = _T0[_BASIS & 0xFF] ^ (_BASIS >> 8)
        elif m % 2 == 0:
            half = _zero_shift(m // 2)
            images = _apply16(half, _apply16(half, _BASIS))
        else:
            images = _apply16(_zero_shift(1), _apply16(_zero_shift(m - 1), _BASIS))
        tables = _shift_tables[m] = _tables_of(images.astype(np.uint32))
    return tables


def crc32c(data: bytes | bytearray | memoryview) -> int:
    """CRC-32C of ``data`` (equal to TensorBoard's ``crc32c``)."""
    n = len(data)
    if n < 512:
        return _crc_bytes(0xFFFFFFFF, bytes(data)) ^ 0xFFFFFFFF
    lane = max(32, (n // 4096 + 3) // 4 * 4)
    k = -(-n // lane)
    buf = np.zeros(k * lane, dtype=np.uint8)
    pad = k * lane - n  # leading zeros do not change a zero register
    buf[pad:] = np.frombuffer(data, dtype=np.uint8)
    buf[pad : pad + 4] ^= 0xFF  # the initial register ~0, folded into the data
    words = buf.view("<u4").reshape(k, lane // 4).T.copy()
    reg = np.zeros(k, dtype=np.uint32)
    lo, hi = _halves(reg)
    a, b = np.empty(k, np.uint32), np.empty(k, np.uint32)
    for w in words:
        np.bitwise_xor(reg, w, out=reg)
        np.take(_WORD_LO, lo, out=a)
        np.take(_WORD_HI, hi, out=b)
        np.bitwise_xor(a, b, out=reg)
    m = lane
    while len(reg) > 1:
        if len(reg) % 2:  # a zero lane in front keeps the pairs aligned
            reg = np.concatenate((np.zeros(1, np.uint32), reg))
        reg = _apply16(_zero_shift(m), reg[0::2]) ^ reg[1::2]
        m *= 2
    return int(reg[0]) ^ 0xFFFFFFFF


def masked_crc32c(data: bytes | bytearray | memoryview) -> int:
    x = crc32c(data)
    return (((x >> 15) | (x << 17)) + 0xA282EAD8) & 0xFFFFFFFF


# --------------------------------------------------------------------------------------------
# Wire format (protobuf) of the few messages written per step.
# --------------------------------------------------------------------------------------------
_pack_f64 = struct.Struct("<d").pack
_pack_f32 = struct.Struct("<f").pack
_pack_u64 = struct.Struct("<Q").pack
_pack_u32 = struct.Struct("<I").pack
_FILE_VERSION = "brain.Event:2"


def _varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def value_prefix(tag: str) -> bytes:
    """Bytes of a ``Summary.value`` entry ``{tag, simple_value}`` up to its 4-byte float."""
    body = _field(1, tag.encode("utf-8")) + b"\x15"  # simple_value: field 2, fixed32
    return b"\x0a" + _varint(len(body) + 4) + body


def f32_bytes(v: object) -> bytes:
    """``v`` as the little-endian float32 TensorBoard stores (overflow gives +-inf, as numpy;
    something that is not a number gives NaN)."""
    try:
        return _pack_f32(v)
    except OverflowError:
        return _pack_f32(math.copysign(math.inf, float(cast(SupportsFloat, v))))
    except (struct.error, TypeError, ValueError):
        return _pack_f32(math.nan)


def encode_event(step: int, wall_time: float, summary: bytes) -> bytes:
    """An ``Event{wall_time, step, summary}`` whose summary body is ``summary``."""
    return b"\x09" + _pack_f64(wall_time) + b"\x10" + _varint(int(step)) + _field(5, summary)


def frame_record(data: bytes) -> bytes:
    """TFRecord framing: length, masked CRC of the length, data, masked CRC of the data."""
    head = _pack_u64(len(data))
    return head + _pack_u32(masked_crc32c(head)) + data + _pack_u32(masked_crc32c(data))


def file_header(wall_time: float) -> bytes:
    from tensorboard.compat.proto import event_pb2

    event = event_pb2.Event(
        wall_time=wall_time, file_version=_FILE_VERSION, source_metadata=event_pb2.SourceMetadata(writer="trainmon")
    )
    return frame_record(event.SerializeToString())


def row_prefixes(family: str, series: str, ops: Iterable[str]) -> list[bytes]:
    """Value prefixes of the ``<family>.<op>/<series>`` tags, in ``ops`` order."""
    return [value_prefix(scalar_tag(family, op, series)) for op in ops]


def make_rounder(ndigits: int | None):
    """The value a CSV cell holds for a statistic: floats keep ``ndigits`` significant digits
    when set (as the CSV sink writes them), counts are exact."""
    spec = None if ndigits is None else f".{int(ndigits)}g"

    def value(v: object) -> float:
        if isinstance(v, numbers.Integral):
            return float(int(v))
        try:
            v = float(cast(SupportsFloat, v))  # numpy / torch scalars too
        except (TypeError, ValueError):
            return math.nan
        return v if spec is None or not math.isfinite(v) else float(format(v, spec))

    return value


# --------------------------------------------------------------------------------------------
# Event file.
# --------------------------------------------------------------------------------------------
_file_counter = count()  # next() on it is atomic under the GIL


def event_file_name(suffix: str = "") -> str:
    """TensorBoard's naming: ``events.out.tfevents.<time>.<host>.<pid>.<n><suffix>``."""
    n = next(_file_counter)
    return f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{n}{suffix}"


class EventFile:
    """An append-only event file: every ``append`` is on disk (page cache) when it returns."""

    def __init__(self, path: str | Path, wall_time: float | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)
        self._fd: int | None = os.open(self.path, flags, 0o644)
        self.append(file_header(time.time() if wall_time is None else wall_time))

    def append(self, data: bytes) -> None:
        """Append already framed records."""
        if self._fd is None:
            raise ValueError(f"{self.path} is closed")
        view, done = memoryview(data), 0
        while done < len(data):
            n = os.write(self._fd, view[done:])
            if n <= 0:
                raise OSError(f"write to {self.path} returned {n}")
            done += n

    def write_event(self, step: int, wall_time: float, summary: bytes) -> None:
        self.append(frame_record(encode_event(step, wall_time, summary)))

    def close(self, sync: bool = True) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if sync:
                os.fsync(fd)
        except OSError as exc:
            logger.debug("fsync of %s failed: %s", self.path, exc)
        finally:
            os.close(fd)


# one getter per field: comparing a list per field allocates less than a tuple per row
_layout_of = tuple(operator.attrgetter(f) for f in ("family", "vpp_stage", "name", "micro_step", "extra"))
_stats_of = operator.attrgetter("stats")
_step_of = operator.attrgetter("step")


class _StepTemplate:
    """A step's summary bytes with the values left out, for one sequence of rows.

    Training records the same tensors with the same ops every step, so after the first step
    only the values change: they become float32 in one numpy call and are dropped into the
    template, instead of ~60 bytes per value being assembled in Python (which holds the GIL
    the training thread needs).
    """

    def __init__(self):
        self.layout: list | None = None
        self.orders: tuple | None = None
        self.buf = np.zeros(0, np.uint8)
        self.idx = np.zeros(0, np.intp)
        self.count = 0

    def body(self, rows: Sequence[StatRow], heads_of) -> bytes | None:
        """The summary body of ``rows``; None if a value is not a number."""
        stats = list(map(_stats_of, rows))
        layout = [list(map(get, rows)) for get in _layout_of]
        # every row's ops in order: the flat key sequence plus the row lengths
        orders = (list(map(len, stats)), list(chain.from_iterable(stats)))
        if layout != self.layout or orders != self.orders:
            self._build(rows, heads_of)
            self.layout, self.orders = layout, orders
        try:
            values = np.array(list(chain.from_iterable(map(dict.values, stats))), dtype=np.float64)
        except (TypeError, ValueError):
            return None
        if values.shape != (self.count,):
            return None
        with np.errstate(over="ignore"):  # beyond float32's range: +-inf, as f32_bytes
            self.buf[self.idx] = values.astype("<f4").view(np.uint8)
        return self.buf.tobytes()

    def _build(self, rows: Sequence[StatRow], heads_of) -> None:
        heads = [h for row in rows for h in heads_of(row)]
        ends = np.cumsum(np.fromiter(map(len, heads), np.intp, count=len(heads)) + 4)
        self.buf = np.frombuffer(b"".join(h + b"\0\0\0\0" for h in heads), np.uint8).copy()
        self.idx = ((ends - 4)[:, None] + np.arange(4)).ravel()
        self.count = len(heads)


def tb_rank_dir(options: SinkOptions) -> Path:
    rank_dir = Path(options.rank_dir)
    return event_dir(rank_dir.parent, rank_dir.name)


@register_sink("tensorboard")
class TensorBoardSink(Sink):
    """Writes :class:`StatRow` s as TensorBoard scalars under ``<run>/tensorboard/rank<R>/``.

    One tag per (row, statistic): ``<family>.<op>/vp<vpp>:<name>[:<key>=<value>...][:micro<m>]``
    (see :mod:`trainmon.output.tb_tags`), at TensorBoard step = the row's ``step``; values are
    ``simple_value`` float32 of the CSV cells.  ``shape`` and ``dtype`` are not written.
    """

    def __init__(self, options: SinkOptions):
        super().__init__(options)
        self.directory = tb_rank_dir(options)
        self._value = None if options.ndigits is None else make_rounder(options.ndigits)
        self._file: EventFile | None = None
        self._prefixes: dict[tuple, list[bytes]] = {}
        self._template = _StepTemplate()
        self._lock = threading.Lock()
        self._failed: OSError | None = None
        self._lost_steps = 0
        self._closed = False

    def write(self, rows: StepRows, step: int) -> None:
        if any(b.family in NOT_SCALAR for b in rows.blocks()):  # packed bits are no scalar series
            rows = StepRows.of(r for r in rows if r.family not in NOT_SCALAR)
        if not rows:
            return
        with self._lock:
            if self._closed or self._failed is not None:
                self._lost_steps += 1
                return
            try:
                if self._file is None:
                    self._file = EventFile(self.directory / event_file_name())
                self._file.append(self._encode(rows))
            except OSError as exc:
                self._failed = exc
                self._lost_steps += 1
                logger.warning(
                    "trainmon: cannot write TensorBoard events to %s (%s); TensorBoard "
                    "output of this rank stops here, training continues",
                    self.directory,
                    exc,
                )

    def _heads(self, row: StatRow) -> list[bytes]:
        key: tuple | None
        key = (
            row.family,
            row.vpp_stage,
            row.name,
            row.micro_step,
            tuple(row.extra.items()) if row.extra else (),
            tuple(row.stats),
        )
        try:
            heads = self._prefixes.get(key)
        except TypeError:  # an unhashable extra value: fine, just not cached
            key, heads = None, None
        if heads is None:
            series = series_name(row.vpp_stage, row.name, row.extra.items(), row.micro_step)
            heads = row_prefixes(row.family, series, row.stats)
            if key is not None:
                self._prefixes[key] = heads
        return heads

    def _encode(self, rows: Sequence[StatRow]) -> bytes:
        """One framed event per distinct row step (one per call in practice)."""
        now = time.time()
        if self._value is None and len(set(map(_step_of, rows))) == 1:
            body = self._template.body(rows, self._heads)
            if body is not None:
                return frame_record(encode_event(rows[0].step, now, body))
        by_step: dict[int, list] = {}
        value, f32 = self._value, f32_bytes
        for row in paced(rows):
            parts = by_step.setdefault(row.step, [])
            values = row.stats.values() if value is None else map(value, row.stats.values())
            for head, v in zip(self._heads(row), values):
                parts.append(head)
                parts.append(f32(v))
        return b"".join(frame_record(encode_event(s, now, b"".join(p))) for s, p in by_step.items())

    def flush(self) -> None:
        # Every write() already reached the file; durability beyond the page cache is close()'s job.
        pass

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._file is not None:
                self._file.close(sync=True)
        if self._lost_steps:
            logger.warning(
                "trainmon: %d step(s) of TensorBoard output were not written to %s", self._lost_steps, self.directory
            )
