"""Native TensorBoard output: one event file per rank, one event per step holding every value.

Where and under which tags is decided in :mod:`trainmon.output.tb_tags` (shared with
``trainmon csv2tb``, which also uses the encoders here).  The default "summary" layout writes per
family and statistic a few aggregates (:func:`summary_values`) and a histogram of the per-tensor
values (:func:`value_histogram`, grad_probe's intervals: :func:`probe_histogram`), computed from
the float64 values the CSV holds with numpy, one call per family and statistic; the run's
custom-scalars layout and HParams record are built with TensorBoard's own protos.  Every event
of a step carries the step's recorded time (``StepRows.wall_time``).  Implementation choices:

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

import dataclasses
import json
import logging
import math
import numbers
import operator
import os
import re
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from datetime import datetime
from itertools import chain, count
from pathlib import Path
from typing import SupportsFloat, cast

import numpy as np

from trainmon.families import NOT_SCALAR
from trainmon.output.tb_tags import (
    COUNT_OPS,
    PER_ROW_FAMILIES,
    PROBE_HISTOGRAM_TAG,
    STEP_LOSS_TAG,
    NameFilter,
    TensorBoardSettings,
    chart_regex,
    event_dir,
    histogram_tag,
    scalar_tag,
    series_name,
    summary_aggregates,
    summary_tag,
)
from trainmon.sinks.base import Sink, SinkOptions, register_sink
from trainmon.stats.rows import RowBlock, StatRow, StepRows, paced

__all__ = [
    "TensorBoardSink",
    "TensorBoardSettings",
    "SummaryEncoder",
    "custom_scalars_value",
    "hparams_value",
    "shape_numel",
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


# --------------------------------------------------------------------------------------------
# The summary layout: a few series per (family, statistic), histograms, the step loss.  Shared
# with ``csv2tb`` so that both write the same events from the same float64 values.
# --------------------------------------------------------------------------------------------
_HIST_BUCKETS = 30  # at most, as tf.summary.histogram
_PROBE_LABEL = re.compile(r"^\((\S+), (\S+)[\])]$")


def summary_values(op: str, x: np.ndarray) -> list[tuple[str, float]]:
    """``(aggregate, value)`` of one statistic over a family's tensors (``x``: float64, one per
    tensor).  Sums are exact (``math.fsum``) so they do not depend on the order of the rows."""
    out: list[tuple[str, float]] = []
    numbers = x[~np.isnan(x)]
    for aggregate in summary_aggregates(op):
        if aggregate == "sum":
            value = math.fsum(x.tolist())
        elif aggregate == "global":
            value = math.sqrt(math.fsum((x * x).tolist())) if x.size else math.nan
        elif aggregate == "max":
            value = float(numbers.max()) if numbers.size else math.nan
        elif aggregate == "min":
            value = float(numbers.min()) if numbers.size else math.nan
        else:  # nonfinite
            value = float(np.count_nonzero(~np.isfinite(x)))
        out.append((aggregate, value))
    return out


def _histogram_body(lefts: np.ndarray, rights: np.ndarray, counts: np.ndarray, x_sum: float, x_sq: float) -> bytes:
    """A ``HistogramProto``: TensorBoard reads bucket ``i`` as ``(bucket_limit[i-1], bucket_limit[i]]``
    from ``min`` to ``max``."""
    return b"".join(
        (
            b"\x09" + _pack_f64(float(lefts[0])),  # min
            b"\x11" + _pack_f64(float(rights[-1])),  # max
            b"\x19" + _pack_f64(float(counts.sum())),  # num
            b"\x21" + _pack_f64(x_sum),  # sum
            b"\x29" + _pack_f64(x_sq),  # sum_squares
            _field(6, rights.astype("<f8").tobytes()),  # bucket_limit, packed
            _field(7, counts.astype("<f8").tobytes()),  # bucket, packed
        )
    )


def histogram_value(tag: str, histo: bytes) -> bytes:
    """A ``Summary.value`` entry ``{tag, histo}``."""
    return _field(1, _field(1, tag.encode("utf-8")) + _field(5, histo))


def value_histogram(x: np.ndarray) -> bytes | None:
    """The histogram of the finite values of ``x`` (None when there is none): up to 30 equal
    buckets from min to max, right-closed as TensorBoard reads them."""
    x = x[np.isfinite(x)]
    if not x.size:
        return None
    lo, hi = float(x.min()), float(x.max())
    k = 1 if lo == hi else min(_HIST_BUCKETS, max(1, math.isqrt(x.size - 1) + 1))
    i = np.arange(k + 1, dtype=np.float64)
    edges = lo / k * (k - i) + hi / k * i  # never overflows, even from -3e38 to 3e38
    edges[0], edges[-1] = lo, hi
    counts = np.bincount(np.searchsorted(edges[1:-1], x, side="left"), minlength=k).astype(np.float64)
    with np.errstate(over="ignore"):
        return _histogram_body(edges[:-1], edges[1:], counts, math.fsum(x.tolist()), math.fsum((x * x).tolist()))


def probe_intervals(labels: Sequence[str]) -> tuple[list[int], np.ndarray, np.ndarray] | None:
    """Columns and finite ``(left, right)`` edges of grad_probe's interval columns (``"(-inf, -1]"``,
    ..., ``"(1, inf)"``); the open ends get the width of the bounds' span.  None if there are none."""
    cols, lefts, rights = [], [], []
    for j, label in enumerate(labels):
        m = _PROBE_LABEL.match(str(label))
        if m is None:
            continue
        try:
            lo, hi = float(m.group(1)), float(m.group(2))
        except ValueError:
            continue
        cols.append(j)
        lefts.append(lo)
        rights.append(hi)
    if not cols:
        return None
    left, right = np.array(lefts), np.array(rights)
    edges = np.concatenate((left, right))
    bounds = np.unique(edges[np.isfinite(edges)]) if np.isfinite(edges).any() else np.zeros(1)
    width = float(bounds[-1] - bounds[0]) if bounds.size > 1 else max(1.0, abs(float(bounds[0])))
    left[~np.isfinite(left)] = float(bounds[0]) - width
    right[~np.isfinite(right)] = float(bounds[-1]) + width
    return cols, left, right


def probe_histogram(labels: Sequence[str], fractions: np.ndarray, numels: np.ndarray) -> bytes | None:
    """grad_probe's intervals as one histogram: the number of grad elements of every probed
    parameter in each interval (its fraction times its element count, summed over parameters)."""
    found = probe_intervals(labels)
    if found is None or not len(fractions):
        return None
    cols, left, right = found
    counts = np.nansum(fractions[:, cols] * numels[:, None], axis=0)
    mids = (left + right) / 2
    with np.errstate(over="ignore", invalid="ignore"):
        return _histogram_body(left, right, counts, float((counts * mids).sum()), float((counts * mids * mids).sum()))


class SummaryEncoder:
    """The summary-layout bytes of a family's rows at one step (both the sink and ``csv2tb``)."""

    def __init__(self, histograms: bool = True):
        self.histograms = histograms
        self._prefixes: dict[str, bytes] = {}

    def _prefix(self, tag: str) -> bytes:
        head = self._prefixes.get(tag)
        if head is None:
            head = self._prefixes[tag] = value_prefix(tag)
        return head

    def family(self, family: str, ops: Sequence[str], values: np.ndarray, numels: np.ndarray | None = None) -> bytes:
        """``values``: float64, one row per tensor, one column per statistic of ``ops``."""
        parts: list[bytes] = []
        for j, op in enumerate(ops):
            x = values[:, j]
            for aggregate, v in summary_values(op, x):
                parts.append(self._prefix(summary_tag(family, op, aggregate)))
                parts.append(f32_bytes(v))
            if self.histograms and op not in COUNT_OPS:
                histo = value_histogram(x)
                if histo is not None:
                    parts.append(histogram_value(histogram_tag(family, op), histo))
        if self.histograms and family == "grad_probe":
            weights = numels if numels is not None else np.ones(len(values))
            histo = probe_histogram(ops, values, weights)
            if histo is not None:
                parts.append(histogram_value(PROBE_HISTOGRAM_TAG, histo))
        return b"".join(parts)

    def step_loss(self, losses: Sequence[float]) -> bytes:
        """``STEP_LOSS_TAG``: the mean of a step's micro-batch losses (exact sum: order-free)."""
        return self._prefix(STEP_LOSS_TAG) + f32_bytes(math.fsum(losses) / len(losses))


def shape_numel(shape: object) -> int:
    """Elements of a shape as the sinks hold it (a tuple) or the CSV writes it (``"[64, 32]"``)."""
    if isinstance(shape, str):
        dims = [d for d in shape.strip("[]() ").split(",") if d.strip()]
        try:
            return math.prod(int(d) for d in dims)
        except ValueError:
            return 1
    try:
        return math.prod(int(d) for d in cast(Iterable, shape))
    except (TypeError, ValueError):
        return 1


# --------------------------------------------------------------------------------------------
# Run-level records: the custom-scalars layout and the HParams of the run.
# --------------------------------------------------------------------------------------------
_REDUCE_PAIR = ("grad_unreduced", "grad_reduced")


def _family_order(family: str) -> tuple[int, str]:
    from trainmon.families import FAMILIES

    names = [str(f) for f in FAMILIES]
    return (names.index(family) if family in names else len(names), family)


def custom_scalars_value(ops_of: dict[str, tuple[str, ...]]) -> bytes:
    """The ``custom_scalars__config__`` summary value (TensorBoard's ``layout_pb2``): a category
    per family with one multi-line chart per statistic (every series of ``<family>.<op>``), and
    grad_unreduced next to grad_reduced per statistic (before / after the reduce)."""
    from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata

    def chart(family: str, op: str):
        return layout_pb2.Chart(
            title=f"{family}.{op}", multiline=layout_pb2.MultilineChartContent(tag=[chart_regex(family, op)])
        )

    families = sorted(ops_of, key=_family_order)
    categories = []
    if all(f in ops_of for f in _REDUCE_PAIR):
        common = [op for op in ops_of[_REDUCE_PAIR[0]] if op in ops_of[_REDUCE_PAIR[1]]]
        charts = [chart(f, op) for op in common for f in _REDUCE_PAIR]
        categories.append(layout_pb2.Category(title="grad: before vs after the reduce", chart=charts))
    for family in families:
        categories.append(layout_pb2.Category(title=family, chart=[chart(family, op) for op in ops_of[family]]))
    layout = layout_pb2.Layout(category=categories)
    tensor = tensor_pb2.TensorProto(
        dtype="DT_STRING", string_val=[layout.SerializeToString()], tensor_shape=tensor_shape_pb2.TensorShapeProto()
    )
    value = summary_pb2.Summary.Value(
        tag=metadata.CONFIG_SUMMARY_TAG, tensor=tensor, metadata=metadata.create_summary_metadata()
    )
    return summary_pb2.Summary(value=[value]).SerializeToString()


def _flatten(prefix: str, value: object, out: dict[str, object]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    elif isinstance(value, (bool, int, float, str)):
        out[prefix] = value
    else:  # lists, null: as their JSON text
        out[prefix] = json.dumps(value)


def run_hparams(run_dir: Path) -> tuple[dict[str, object], str | None, float | None]:
    """The HParams of a run: its ``run.json`` (run id, world size) and the keys of the config file
    it names, flattened (``grad_probe.bounds``); lists and null as JSON text.  Also the run id and
    start time.  Empty when the run has no readable ``run.json``."""
    from trainmon.output.layout import RUN_META

    try:
        info = json.loads((run_dir / RUN_META).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}, None, None
    if not isinstance(info, dict):
        return {}, None, None
    hparams: dict[str, object] = {}
    config_file = info.get("config_file")
    if isinstance(config_file, str):
        try:
            config = json.loads(Path(config_file).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            config = None
        if isinstance(config, dict):
            _flatten("", config, hparams)
    for key in ("run_id", "world_size"):
        if isinstance(info.get(key), (str, int)):
            hparams[key] = info[key]
    started = None
    try:
        started = datetime.strptime(str(info.get("started")), "%Y-%m-%dT%H:%M:%S%z").timestamp()
    except (ValueError, OverflowError):
        pass
    run_id = info.get("run_id")
    return hparams, run_id if isinstance(run_id, str) else None, started


def hparams_value(run_dir: Path, first_step_time: float) -> bytes | None:
    """The HParams plugin's session record of a run (``hparams.summary_v2.hparams_pb``), or None;
    it started at ``run.json``'s ``started``, else when its first step was recorded."""
    hparams, run_id, started = run_hparams(run_dir)
    if not hparams:
        return None
    from tensorboard.plugins.hparams.summary_v2 import hparams_pb

    start = first_step_time if started is None else started
    return hparams_pb(hparams, trial_id=run_id, start_time_secs=start).SerializeToString()


def tb_rank_dir(options: SinkOptions) -> Path:
    rank_dir = Path(options.rank_dir)
    return event_dir(rank_dir.parent, rank_dir.name)


def _block_of(b: RowBlock, keep: list[int]) -> RowBlock:
    """The rows ``keep`` of a block."""
    return dataclasses.replace(
        b,
        names=[b.names[i] for i in keep],
        vpp_stages=[b.vpp_stages[i] for i in keep],
        shapes=[b.shapes[i] for i in keep],
        dtypes=[b.dtypes[i] for i in keep],
        values=[b.values[i] for i in keep],
    )


@register_sink("tensorboard")
class TensorBoardSink(Sink):
    """Writes a step's rows as TensorBoard events under ``<run>/tensorboard/rank<R>/``.

    The tag layout is ``settings.tags`` (:class:`TensorBoardSettings`, the ``"tensorboard"``
    config block): ``"summary"`` (default) writes a few series per family and statistic plus
    histograms, ``"per_tensor"`` one series per (row, statistic):
    ``<family>.<op>/vp<vpp>:<name>[:<key>=<value>...][:micro<m>]`` (see
    :mod:`trainmon.output.tb_tags`).  TensorBoard step = the row's ``step``, wall time = when the
    step was recorded (``StepRows.wall_time``); values are ``simple_value`` float32 of the CSV cells.
    The run's custom-scalars layout and HParams record are written with the first step.
    """

    settings_schema = TensorBoardSettings

    def __init__(self, options: SinkOptions, settings: TensorBoardSettings | None = None):
        super().__init__(options)
        self.directory = tb_rank_dir(options)
        settings = settings or getattr(options, "settings", None)
        # the "tensorboard" config block, parsed by the loader (settings_schema); absent: the defaults
        self.settings = settings if isinstance(settings, TensorBoardSettings) else TensorBoardSettings()
        self._names = NameFilter(self.settings.names)
        self._value = None if options.ndigits is None else make_rounder(options.ndigits)
        self._number = make_rounder(None)
        self._file: EventFile | None = None
        self._prefixes: dict[tuple, list[bytes]] = {}
        self._template = _StepTemplate()
        self._summary = SummaryEncoder(self.settings.histograms)
        self._ops_of: dict[str, tuple[str, ...]] = {}  # family -> its statistics, as laid out
        self._hparams_written = False
        self._warned: set[str] = set()
        self._losses: dict[int, tuple[float, list[float]]] = {}  # step -> (wall time, micro-batch losses)
        self._lock = threading.Lock()
        self._failed: OSError | None = None
        self._lost_steps = 0
        self._closed = False

    def write(self, rows: StepRows, step: int) -> None:
        blocks = [b for b in rows.blocks() if b.family not in NOT_SCALAR]  # packed bits: no scalar series
        if not blocks:
            return
        with self._lock:
            if self._closed or self._failed is not None:
                self._lost_steps += 1
                return
            try:
                data = self._encode(blocks, rows.wall_time)
                if self._file is None:
                    self._file = EventFile(self.directory / event_file_name(), wall_time=rows.wall_time)
                self._file.append(data)
            except OSError as exc:
                self._fail(exc)

    def _fail(self, exc: OSError) -> None:
        self._failed = exc
        self._lost_steps += 1
        logger.warning(
            "trainmon: cannot write TensorBoard events to %s (%s); TensorBoard output of this rank stops here, "
            "training continues",
            self.directory,
            exc,
        )

    # -- encoding -----------------------------------------------------------------------------

    def _encode(self, blocks: list[RowBlock], wall_time: float) -> bytes:
        bodies: dict[int, list[bytes]] = {}
        steps = {b.step for b in blocks}
        out = [self._finished_losses(steps)]
        out.extend(self._run_records(blocks, min(steps), wall_time))
        per_row, summarized = self._split(blocks)
        if per_row:
            for step, body in self._row_bodies(StepRows(lambda: per_row)).items():
                bodies.setdefault(step, []).append(body)
        for (step, family, ops), values, numels in self._family_values(summarized):
            bodies.setdefault(step, []).append(self._summary.family(family, ops, values, numels))
        self._collect_losses(blocks, wall_time)
        out.extend(frame_record(encode_event(step, wall_time, b"".join(parts))) for step, parts in bodies.items())
        return b"".join(out)

    def _split(self, blocks: list[RowBlock]) -> tuple[list[RowBlock], list[RowBlock]]:
        """Blocks written one series per row, and blocks summarized."""
        if self.settings.per_tensor:
            return blocks, []
        per_row = [b for b in blocks if b.family in PER_ROW_FAMILIES]
        summarized = [b for b in blocks if b.family not in PER_ROW_FAMILIES]
        if self._names:
            for b in summarized:
                keep = [i for i, hit in enumerate(map(self._names, b.names)) if hit]
                if keep:
                    per_row.append(b if len(keep) == len(b.names) else _block_of(b, keep))
        return per_row, summarized

    def _values(self, b: RowBlock) -> np.ndarray:
        """A block's values as float64 (rows x statistics): the CSV cells' numbers."""
        if self._value is None and b.plain:
            try:
                return np.array(b.values, dtype=np.float64).reshape(len(b.names), len(b.stats))
            except (TypeError, ValueError):
                pass
        value = self._value or self._number
        return np.array([[value(v) for v in row] for row in b.values], dtype=np.float64).reshape(
            len(b.names), len(b.stats)
        )

    def _family_values(self, blocks: list[RowBlock]):
        """``((step, family, ops), values, numels)`` per family (all its micro-steps, stages and
        calls together) and step."""
        groups: dict[tuple, list[RowBlock]] = {}
        for b in paced(blocks, 8):
            groups.setdefault((b.step, b.family, b.stats), []).append(b)
        for key, group in groups.items():
            values = np.concatenate([self._values(b) for b in group])
            numels = None
            if key[1] == "grad_probe":
                numels = np.array([shape_numel(s) for b in group for s in b.shapes], dtype=np.float64)
            yield key, values, numels

    def _collect_losses(self, blocks: list[RowBlock], wall_time: float) -> None:
        for b in blocks:
            if b.family == "loss" and "loss" in b.stats:
                j = b.stats.index("loss")
                _, losses = self._losses.setdefault(b.step, (wall_time, []))
                losses.extend(float(v) for v in self._values(b)[:, j])

    def _finished_losses(self, steps: set[int] | None) -> bytes:
        """Step-loss events of the steps that are complete: those before the steps now written
        (a step's late ``record_loss`` rows come as a write of their own), or all (``None``)."""
        done = [s for s in self._losses if steps is None or s not in steps]
        return b"".join(
            frame_record(encode_event(s, self._losses[s][0], self._summary.step_loss(self._losses.pop(s)[1])))
            for s in done
        )

    def _run_records(self, blocks: list[RowBlock], step: int, wall_time: float) -> list[bytes]:
        """The HParams record (once) and the custom-scalars layout (again whenever a family or a
        statistic appears).  Neither may cost the step's values: a failure is one warning."""
        values = []
        if not self._hparams_written:
            self._hparams_written = True
            values.append(
                self._guarded("the HParams record", hparams_value, Path(self.options.rank_dir).parent, wall_time)
            )
        grew = False
        for b in blocks:
            known = self._ops_of.get(b.family, ())
            if not set(b.stats) <= set(known):
                self._ops_of[b.family] = (*known, *(op for op in b.stats if op not in known))
                grew = True
        if grew:
            values.append(self._guarded("the custom-scalars layout", custom_scalars_value, self._ops_of))
        return [frame_record(encode_event(step, wall_time, v)) for v in values if v]

    def _guarded(self, what: str, build, *args) -> bytes | None:
        try:
            return build(*args)
        except Exception as exc:  # a TensorBoard without the plugin, a config file that is not JSON, ...
            if what not in self._warned:
                self._warned.add(what)
                logger.warning("trainmon: %s of %s is not written (%s); the values are", what, self.directory, exc)
            return None

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

    def _row_bodies(self, rows: Sequence[StatRow]) -> dict[int, bytes]:
        """Summary bodies of one series per (row, statistic), per distinct row step."""
        if self._value is None and len(set(map(_step_of, rows))) == 1:
            body = self._template.body(rows, self._heads)
            if body is not None:
                return {rows[0].step: body}
        by_step: dict[int, list] = {}
        value, f32 = self._value, f32_bytes
        for row in paced(rows):
            parts = by_step.setdefault(row.step, [])
            values = row.stats.values() if value is None else map(value, row.stats.values())
            for head, v in zip(self._heads(row), values):
                parts.append(head)
                parts.append(f32(v))
        return {s: b"".join(p) for s, p in by_step.items()}

    def flush(self) -> None:
        # Every write() already reached the file; durability beyond the page cache is close()'s job.
        pass

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._file is not None and self._losses and self._failed is None:
                try:
                    self._file.append(self._finished_losses(None))
                except OSError as exc:
                    self._fail(exc)
            if self._file is not None:
                self._file.close(sync=True)
        if self._lost_steps:
            logger.warning(
                "trainmon: %d step(s) of TensorBoard output were not written to %s", self._lost_steps, self.directory
            )
