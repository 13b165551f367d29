"""The accelerator statistics path: one step's rows of one device, written in place.

Every reduction writes its result with ``out=`` into a per-step buffer on the tensor's device, so
a tensor costs only the reductions that read it (default ops: ``sum``, ``linalg_vector_norm``,
``aminmax``; each requested count one mask written into a reused scratch, plus ONE ``sum`` for all
the counts of the row) and no bookkeeping kernels:

* ``values``: float32 ``[capacity, k]`` (sum, norm, min, max, m2/n as the ops need), never fp64 on
  the device (MPS has none, Ascend per op);
* ``counts``: int64 ``[capacity, c]`` (nans, infs, zeros): exact, however large the tensor;
* ``extremes``: ``[capacity, 2]`` per non-fp32 input dtype: ``aminmax`` writes min/max in the
  input's own dtype, so low-precision min/max are exact elements;
* ``count`` (numel) is host metadata and never travels to the device.

Nothing here reads a device value on the host, branches on one, or copies host memory to the
device: hooks inside forward/backward stay free of syncs whatever the ops.  ``snapshot`` turns the
step's buffers into one byte stream and starts ONE asynchronous device->host copy (pinned memory
plus an event off the CPU); ``HostCopy.rows`` waits for the event and decodes, which the engine
does lazily, i.e. on the sink's writer thread.  The host side squares norms and multiplies m2 in
float64.

The buffer grows by adding a chunk (never by copying): a chunk allocated mid-step is an
asynchronous device allocation, not a sync.

Five or more tensors of one call that are views of one contiguous buffer (Megatron's grad
buffers, DDP buckets as views, DeepSpeed's flat partitions) are reduced together (``_batch``):
per-chunk partials over a ``[chunks, width]`` view of the buffer, combined per tensor by
``segment_reduce`` (counts too, in float32: exact up to 2^24 elements a tensor), a constant
number of ops for the whole group.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trainmon.stats import device_triton
from trainmon.stats.odd_tensors import STRIDED, explicit_elements, with_implicit_zeros
from trainmon.stats.table import PARTIAL

__all__ = ["DeviceRows", "HostCopy", "VALUE_COLUMNS", "COUNT_COLUMNS", "gathered_partials"]

VALUE_COLUMNS = ("sum", "sumsq", "min", "max", "m2")  # float32 on the device (sumsq held as the norm)
COUNT_COLUMNS = ("nans", "infs", "zeros")  # int64 on the device
_F32 = torch.float32
log = logging.getLogger(__name__)
_SCRATCH_MAX = 1 << 26  # elements of the mask scratch at most (64 MiB per count: a flat group's chunks)
# A single tensor larger than this is counted in slices of it through the scratch, so its masks
# take 16 MiB per count at most (an H200 run, where a tensor above the scratch took one transient
# full-size mask per count, added 344 MiB at its peak).
_SLICE = 1 << 24


def _layout(columns: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(device value columns, device count columns) for engine ``columns``; min and max travel
    together (``aminmax`` writes both)."""
    wanted = set(columns) | ({"min", "max"} if {"min", "max"} & set(columns) else set())
    return tuple(c for c in VALUE_COLUMNS if c in wanted), tuple(c for c in COUNT_COLUMNS if c in wanted)


_MIN_BATCH = 5  # tensors of one buffer worth a batched reduction (its ~12 ops vs 3 each)
_FLAT_DTYPES, _PLAIN = device_triton.FLOAT_DTYPES, device_triton.PLAIN_TENSORS
_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_FOREACH_MAX = getattr(torch, "_foreach_max", None)  # torch >= 2.4
_MASKS_OUT = all(hasattr(op, "out") for op in (torch.ops.aten.isnan, torch.ops.aten.isinf))
_WIDTH_MAX = 1 << 12  # chunk width of the batched path: the largest power of two dividing every
_WIDTH_MIN = 256  # boundary, at most this; below _WIDTH_MIN the tensors are reduced one by one
_COUNT_EXACT = 1 << 24  # batched counts are summed in fp32: exact for tensors up to this many elements
# Small tensors of any layout (one ``write``'s separate weights, activations) are reduced as
# segments of one flat buffer per dtype (``_segments``): a constant number of ops per batch. Each
# tensor is cut into blocks of ``_BLOCK`` elements, summed in order within a block (float32, so a
# block's error stays ~_BLOCK ulps) and the blocks per tensor: blocked accumulation, as torch.sum.
_SMALL = 1 << 12  # elements of a tensor at most to join a segment batch (larger: its own reductions,
# whose launches are not the cost and which make no full-size temporary)
_SEG_BUDGET = 1 << 20  # elements of one segment batch at most (its temporaries: a few 4 MiB float32 copies)
_BLOCK = 256
_SEG_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# ``segment_reduce`` checks its lengths unless ``unsafe``: a ``min().item()`` and an
# ``all().item()``, two device->host syncs per call on a GPU, invisible to a dispatch mode (they run
# inside the kernel).  Every lengths tensor here is built by this module from host numbers that
# add up by construction, so the checks are skipped (a C partial: no Python frame per call).
_segment_reduce = functools.partial(torch.segment_reduce, unsafe=True)
_CHUNKS_PER_ROW = 256  # a batched group's float32 partials stay within 1 KiB per row: a tensor that
# alone spans more chunks is reduced by itself (3 ops reading it, no temporary), where the launches a
# batch saves are nothing next to reading it; small tensors beside it lend the group their share


@dataclass(frozen=True)
class _FlatLayout:
    """Where a group of views lies in its buffer: the span ``[start, start + chunks * width)`` of
    the storage as ``[chunks, width]`` rows, the segments (tensors and the gaps between them, in
    storage order) as chunk counts on the device, and the caller-order segment of each tensor
    (None when that is the identity).  Built once per layout, at its first sight: the only
    host->device copy of the path (two small index tensors), reused by every later step."""

    start: int
    width: int
    chunks: int
    lengths: torch.Tensor
    select: torch.Tensor | None
    largest: int  # elements of the largest tensor (counts are summed in fp32: exact to 2^24)

    @staticmethod
    def of(key: tuple[tuple[int, int], ...], device: torch.device) -> _FlatLayout | None:
        order = sorted(range(len(key)), key=lambda k: key[k][0])
        start = key[order[0]][0]
        width = _WIDTH_MAX
        for a, b in itertools.pairwise(order):
            if key[a][0] + key[a][1] > key[b][0]:
                return None  # overlapping views: not one buffer's disjoint parts
        for off, n in key:
            width = math.gcd(width, off - start, n)
        if width < _WIDTH_MIN:
            return None
        lengths, seg_of, end = [], [0] * len(key), start
        for k in order:
            off, n = key[k]
            if off > end:
                lengths.append((off - end) // width)  # a gap: its own segment, never selected
            seg_of[k] = len(lengths)
            lengths.append(n // width)
            end = off + n
        select = None if seg_of == list(range(len(lengths))) else _to_device(seg_of, device)
        largest = max(n for _, n in key)
        return _FlatLayout(start, width, (end - start) // width, _to_device(lengths, device), select, largest)


def _batches(key: tuple[tuple[int, int], ...], device: torch.device) -> list[tuple[list[int], _FlatLayout]]:
    """The views ``key`` (offset, elements) of one buffer split into runs, in storage order, whose
    per-chunk partials fit ``_CHUNKS_PER_ROW`` chunks per row (gaps between them included), each
    with its layout; a run of fewer than ``_MIN_BATCH`` tensors is left to the one-by-one paths.
    Built once per layout."""
    width = _WIDTH_MAX
    for off, n in key:
        width = math.gcd(width, off - key[0][0], n)
    if width < _WIDTH_MIN:
        return []
    runs: list[list[int]] = []
    run: list[int] = []
    chunks = end = 0
    for k in sorted(range(len(key)), key=lambda k: key[k][0]):
        off, n = key[k]
        more = (n + max(off - end, 0)) // width
        if run and chunks + more <= _CHUNKS_PER_ROW * (len(run) + 1):
            run.append(k)
            chunks += more
        else:
            runs.append(run)
            run, chunks = [k], n // width
        end = off + n
    runs.append(run)
    out = []
    for run in runs:
        layout = _FlatLayout.of(tuple(key[k] for k in run), device) if len(run) >= _MIN_BATCH else None
        if layout is not None:
            out.append((run, layout))
    return out


def _to_device(values: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.int64)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class _Plan:
    """``DeviceRows.plan``: the steps of a write (kind, tensor indices or None for all, element
    counts and dtype of a segment batch) and each tensor's row offset (None: in order)."""

    steps: list[tuple[str, list[int] | None, list[int] | None, torch.dtype | None]]
    order: np.ndarray | None
    contiguous: bool = False  # replayed only while every tensor is contiguous (the Triton route)


class Unplanned(RuntimeError):
    """A plan no longer fits its tensors (``write_planned`` changed nothing): the caller takes the
    general path."""


@dataclass
class _Chunk:
    raw: torch.Tensor  # uint8: ``values`` then ``counts``, one buffer, so a step's rows are one copy
    values: torch.Tensor  # [capacity, len(value columns)] float32, a view of ``raw``
    counts: torch.Tensor | None  # [capacity, len(count columns)] int64, a view of ``raw``
    extremes: dict[torch.dtype, torch.Tensor]  # dtype -> [capacity, 2] in that dtype

    @staticmethod
    def new(capacity: int, values: int, counts: int, device: torch.device) -> _Chunk:
        """A chunk whose ``values`` and ``counts`` share one zeroed buffer (``values`` first: its
        byte size is a multiple of 8, so the int64 ``counts`` are aligned)."""
        split = capacity * values * 4
        raw = torch.zeros(split + capacity * counts * 8, dtype=torch.uint8, device=device)
        return _Chunk(
            raw,
            raw[:split].view(_F32).view(capacity, values),
            raw[split:].view(torch.int64).view(capacity, counts) if counts else None,
            {},
        )


class DeviceRows:
    """This step's partials rows on one device (see the module docstring)."""

    def __init__(self, device: torch.device, columns: Sequence[str], eps: float, capacity: int = 512):
        self.device = device
        # the current device index while launching (Triton launches on the current device)
        index = device.index
        self.device_index = torch.cuda.current_device() if index is None and device.type == "cuda" else index
        # the current stream of this device (scratch buffers are per stream): a partial, one frame
        self.stream_key: Callable[[], Any] = functools.partial(_stream_key, device)
        # ``values`` as an int64 tensor on this device (pinned, asynchronous: first sights only)
        self.to_device: Callable[[list[int] | torch.Tensor], torch.Tensor]
        self.to_device = functools.partial(_to_device, device=device)
        self.eps = eps
        self._eps_cache: dict[torch.dtype, float] = {}
        self.values, self.counts = _layout(columns)
        self.vcol = {c: j for j, c in enumerate(self.values)}
        self.ccol = {c: j for j, c in enumerate(self.counts)}
        self.capacity = capacity
        self.chunks: list[_Chunk] = []
        self.lock = threading.Lock()
        self.numels: list[int] = []
        self.kinds: list[torch.dtype] = []  # the dtype whose extremes buffer holds the row's min/max
        self.pads: dict[int, int] = {}  # row -> implicit zeros of a sparse tensor (its values were reduced)
        self._scratch: dict[Any, torch.Tensor] = {}  # stream -> [counts, size] bool masks (see _count)
        self._layouts: dict[tuple, list[tuple[list[int], _FlatLayout]]] = {}  # seen (see _flat_groups)
        self._seg_layouts: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._batchable = set(self.values) <= {"sum", "sumsq", "min", "max"}  # not m2 (std)
        self._triton = device_triton.TritonRows(self) if device_triton.supported(device, self.values) else None

    @property
    def path(self) -> str:
        """What produces this device's rows, for run.json: ``device-triton`` or ``device``."""
        return "device" if self._triton is None else "device-triton"

    # -- hooks ---------------------------------------------------------------------------------
    def write(self, tensors: Sequence[torch.Tensor]) -> list[tuple[DeviceRows, int]]:
        """``_write`` with autograd off (``torch.no_grad()``'s decorator costs ~8 Python frames a
        call; the C switch none)."""
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            return self._write(tensors)
        finally:
            torch._C._set_grad_enabled(grad)

    def _write(self, tensors: Sequence[torch.Tensor]) -> list[tuple[DeviceRows, int]]:
        """Reduce ``tensors`` into new rows; returns their handles.  No sync, no H2D copy (but at
        the first sight of a flat layout, see ``_FlatLayout``).  Tensors that are views of one contiguous
        buffer (Megatron's/DDP's grad buckets, DeepSpeed's flat partitions, flattened params) are
        reduced together: O(1) + O(row chunks) ops for the group instead of 3 per tensor.  A sparse
        tensor is reduced by its stored values; its implicit zeros join its row on the host."""
        pads: dict[int, int] = {}
        if any([t.layout is not STRIDED for t in tensors]):  # a list: a generator is a frame per item
            tensors, pads = explicit_elements(tensors)
        with self.lock:
            start = len(self.numels)
            self.numels.extend([0] * len(tensors))
            self.kinds.extend([_F32] * len(tensors))
            rows: list[int] = [-1] * len(tensors)
            pos = start
            if self._triton is not None:
                pos = self._write_triton(tensors, rows, pos)
            for idx, layout in self._flat_groups(tensors, rows):
                self._batch([tensors[k] for k in idx], layout, pos)
                for j, k in enumerate(idx):
                    rows[k] = pos + j
                pos += len(idx)
            small = self._small_group(tensors, rows)
            if small:
                for j, k in enumerate(self._segments(tensors, small, pos)):
                    rows[k] = pos + j
                pos += len(small)
            separate = self._foreach_group(tensors, rows) if pos - start < len(tensors) else []
            if separate:
                self._foreach([tensors[k] for k in separate], pos)
                for j, k in enumerate(separate):
                    rows[k] = pos + j
                pos += len(separate)
            for k, t in enumerate(tensors):
                if rows[k] < 0:
                    rows[k] = pos
                    self._reduce(t, pos)
                    pos += 1
            for k, n in pads.items():
                self.pads[rows[k]] = n
        return [(self, r) for r in rows]

    def plan(self, tensors: Sequence[torch.Tensor]) -> _Plan | None:
        """The route ``_write`` takes for ``tensors`` worked out once, for a caller that hands the
        same layout step after step (``StatsEngine.capture_block``): the segment batches of the
        small tensors, the ``_foreach`` group, the tensors reduced alone, and each tensor's row.
        Valid while the tensors keep their dtypes, element counts, types, layouts and device
        (the caller checks those).  None where the route depends on more than that: the Triton
        kernel's groups are planned while every tensor is contiguous and the kernel reads them
        all; sparse tensors and views of one buffer are not (``_flat_groups`` reads storage
        addresses)."""
        if any([t.layout is not STRIDED for t in tensors]):
            return None
        n = len(tensors)
        rows = [-1] * n
        if self._triton is not None:
            return self._triton_plan(tensors, rows)
        if self._flat_groups(tensors, rows):
            return None
        steps: list[tuple[str, Any, Any, Any]] = []
        order: list[int] = []
        small = self._small_group(tensors, rows)
        if small:
            for dtype, ks, numels in self._segment_batches(tensors, small):
                steps.append(("segments", ks, numels, dtype))
                order += ks
            for k in small:
                rows[k] = 0
        separate = self._foreach_group(tensors, rows) if len(order) < n else []
        if separate:
            steps.append(("foreach", separate, None, None))
            order += separate
            for k in separate:
                rows[k] = 0
        alone = [k for k in range(n) if rows[k] < 0]
        if alone:
            steps.append(("reduce", alone, None, None))
            order += alone
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.arange(n)
        return _Plan(
            [(kind, None if ks == list(range(n)) else ks, numels, dtype) for kind, ks, numels, dtype in steps],
            None if order == list(range(n)) else rank,
        )

    def _triton_plan(self, tensors: Sequence[torch.Tensor], rows: list[int]) -> _Plan | None:
        """``plan`` on the Triton route: one group per dtype when the kernel reads every tensor."""
        groups = self._triton.groups(tensors, rows)  # type: ignore[union-attr]
        n = len(tensors)
        if sum(map(len, groups.values())) != n or not all(map(_IS_CONTIGUOUS, tensors)):
            return None
        order = [k for idx in groups.values() for k in idx]
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.arange(n)
        steps: list[tuple[str, Any, Any, Any]] = [
            ("triton", None if idx == list(range(n)) else idx, None, dtype) for dtype, idx in groups.items()
        ]
        return _Plan(steps, None if order == list(range(n)) else rank, contiguous=True)

    def write_planned(self, plan: _Plan, tensors: Sequence[torch.Tensor]) -> int:
        """``write`` along ``plan`` (``plan(tensors)`` of tensors of this layout): the rows'
        first number; tensor ``k``'s row is that plus ``plan.order[k]`` (or ``k``).  No Python
        work per tensor for the segment batches; per tensor as ``write`` for the others."""
        if plan.contiguous and not all(map(_IS_CONTIGUOUS, tensors)):
            raise Unplanned("a tensor of a planned Triton group is no longer contiguous")
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            with self.lock:
                start = pos = len(self.numels)
                self.numels.extend([0] * len(tensors))
                self.kinds.extend([_F32] * len(tensors))
                for kind, ks, numels, dtype in plan.steps:
                    group = tensors if ks is None else [tensors[k] for k in ks]
                    if kind == "segments":
                        self._segment_batch(group, numels, dtype, pos)  # type: ignore[arg-type]
                    elif kind == "triton" and self._triton is not None:
                        try:
                            self._triton.write_group(group, pos)  # type: ignore[arg-type]
                        except Exception as exc:  # as in ``_write_triton``: the eager path from now on
                            self._triton_failed(exc)
                            self._reduce_each(group, pos)
                    elif kind == "foreach":
                        self._foreach(group, pos)  # type: ignore[arg-type]
                    else:  # reduced alone, or a Triton group after the kernel failed
                        self._reduce_each(group, pos)
                    pos += len(group)
            return start
        finally:
            torch._C._set_grad_enabled(grad)

    def _reduce_each(self, group: Sequence[torch.Tensor], pos: int) -> None:
        for j, t in enumerate(group):
            self._reduce(t, pos + j)

    def _segment_batches(
        self, tensors: Sequence[torch.Tensor], idx: list[int]
    ) -> list[tuple[torch.dtype, list[int], list[int]]]:
        """``_segments``' batches: (dtype, indices, element counts) in row order."""
        by_dtype: dict[torch.dtype, list[int]] = {}
        for k in idx:
            by_dtype.setdefault(tensors[k].dtype, []).append(k)
        out = []
        for dtype, ks in by_dtype.items():
            numels = [tensors[k].numel() for k in ks]
            begin = total = 0
            for j, n in enumerate(numels):
                if total + n > _SEG_BUDGET and j > begin:
                    out.append((dtype, ks[begin:j], numels[begin:j]))
                    begin, total = j, 0
                total += n
            out.append((dtype, ks[begin:], numels[begin:]))
        return out

    def _write_triton(self, tensors: Sequence[torch.Tensor], rows: list[int], pos: int) -> int:
        """The Triton kernel's share of ``write``; if it fails (a GPU Triton cannot compile for),
        one warning and the eager path from then on: the monitor never stops training."""
        try:
            return self._triton.write(tensors, rows, pos)  # type: ignore[union-attr]
        except Exception as exc:
            self._triton_failed(exc)
            return max([pos, *(r + 1 for r in rows)])

    def _triton_failed(self, exc: Exception) -> None:
        """One warning, and the eager path for this device from now on."""
        log.warning("trainmon: the Triton statistics kernel failed on %s (%s); using the eager path", self.device, exc)
        self._triton = None

    def _small_group(self, tensors: Sequence[torch.Tensor], rows: list[int]) -> list[int]:
        """Indices of the not yet placed small plain fp32/bf16/fp16 tensors when there are enough
        of them for ``_segments`` (fewer take the per-tensor ops: fewer than its ~20)."""
        if len(tensors) < _MIN_BATCH or not self.values:
            return []
        ks = [
            k
            for k, t in enumerate(tensors)
            if rows[k] < 0 and type(t) in _PLAIN and t.dtype in _SEG_DTYPES and t.numel() <= _SMALL
        ]
        return ks if len(ks) >= _MIN_BATCH else []

    def _segments(self, tensors: Sequence[torch.Tensor], idx: list[int], row: int) -> list[int]:
        """``tensors[idx]`` into rows ``row..`` as segment batches: one per dtype (the zeros
        threshold is the dtype's) and per ``_SEG_BUDGET`` elements; returns the indices in row
        order.  No Python call per tensor: plain loops and comprehensions only."""
        order: list[int] = []
        for dtype, ks, numels in self._segment_batches(tensors, idx):
            self._segment_batch([tensors[k] for k in ks], numels, dtype, row + len(order))
            order += ks
        return order

    def _segment_batch(self, group: list[torch.Tensor], numels: list[int], dtype: torch.dtype, row: int) -> None:
        """One batch of small tensors of one dtype into rows ``row..``: their elements flattened
        into one buffer (one ``cat``), the sums reduced per block of ``_BLOCK`` elements, then per
        tensor (``segment_reduce`` with the layout's cached lengths), the extremes per tensor at
        once (a maximum is exact in any order), the columns written into the row buffer as one
        block per buffer chunk (no view per row).  The sums (``x``, the scaled squares, each
        count's mask) are reduced together, as the columns of one ``[elements, k]`` matrix, so a
        batch costs 21 ops with the shipped columns (33 with every one), whatever the number of
        tensors.  min/max go to the float32 columns (exact for bf16/fp16); m2 takes the tensor's
        mean back to its elements (``repeat_interleave``, output size known on the host: no sync)."""
        key = tuple(numels)
        layout = self._seg_layouts.get(key)  # inline: the common case costs no frame
        blocks, tensor_blocks, lengths = layout if layout is not None else self._segment_layout(key)
        flat = torch._C._nn.flatten_dense_tensors(group)  # contiguous + view + cat, in C++
        x = flat if dtype == _F32 else flat.to(_F32)
        seg = _segment_reduce  # blocks, then the blocks of each tensor
        vc = self.values
        # the extremes per tensor (an empty one: -inf/+inf, which the host replaces), and from
        # them the largest |x| that the norm's scale needs
        top = low = peak = None
        if "min" in vc:
            top, low = seg(x, "max", lengths=lengths), seg(x, "min", lengths=lengths)
            if "sumsq" in vc:
                peak = torch.maximum(top, torch.neg(low))
        elif "sumsq" in vc:
            peak = seg(x.abs(), "max", lengths=lengths)
        scale = None
        sums = [x] if "sum" in vc or "m2" in vc else []
        if peak is not None:
            # each tensor scaled by the power of two at or below its largest |x| before squaring
            # (exact): a sum of squares beyond float32 (|x| above ~1.8e19) still gives a finite
            # norm, and squares below its range do not vanish.  The power is the float's own
            # exponent field, kept to the normal range (a subnormal, zero or empty peak: 2^-126;
            # Inf/NaN: 2^127, so they stay Inf/NaN): three integer ops, exact on every device.
            bits = peak.view(torch.int32).bitwise_right_shift(23).clamp_(1, 254)
            scale = bits.bitwise_left_shift_(23).view(_F32)
            y = x / scale.repeat_interleave(lengths, output_size=x.numel())
            sums.append(y * y)
        for col in self.counts:  # the masks inline (no frame per count); zeros at the dtype's eps
            if col == "nans":
                sums.append(torch.isnan(flat))
            elif col == "infs":
                sums.append(torch.isinf(flat))
            else:
                sums.append(flat.abs() < self._eps_in(dtype))
        totals = None
        if sums:
            m = torch.stack(sums, dim=1)  # the masks become 0/1 float32 (exact counts: _SMALL elements)
            totals = seg(seg(m, "sum", lengths=blocks, axis=0), "sum", lengths=tensor_blocks, axis=0)
        vcols: list[torch.Tensor] = []
        for c in vc:
            if c == "sum":
                vcols.append(totals[:, 0])  # type: ignore[index]
            elif c == "sumsq":  # the column after x's when x is summed
                norm = totals[:, 1 if "sum" in vc or "m2" in vc else 0].sqrt()  # type: ignore[index]
                vcols.append(norm.mul_(scale))  # type: ignore[arg-type]
            elif c == "min":
                vcols += [low, top]  # type: ignore[list-item]
            elif c == "m2":
                count = lengths.to(_F32)
                dev = x - (totals[:, 0] / count).repeat_interleave(lengths, output_size=x.numel())  # type: ignore[index]
                vcols.append(seg(seg(dev * dev, "sum", lengths=blocks), "sum", lengths=tensor_blocks) / count)
        self.numels[row : row + len(numels)] = numels
        values = torch.stack(vcols, dim=1) if vcols else None
        counts = totals[:, len(sums) - len(self.counts) :] if self.counts else None  # type: ignore[index]
        done = 0
        while done < len(numels):  # rows may continue into the next chunk of the row buffer
            at, r = divmod(row + done, self.capacity)  # ``_chunk`` inline when the chunk exists
            chunk = self.chunks[at] if at < len(self.chunks) else self._chunk(row + done)[0]
            n = min(len(numels) - done, self.capacity - r)
            if values is not None:
                chunk.values[r : r + n, : values.shape[1]].copy_(values[done : done + n])
            if counts is not None and chunk.counts is not None:
                chunk.counts[r : r + n].copy_(counts[done : done + n])
            done += n

    def _segment_layout(self, numels: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(block lengths, blocks per tensor, elements per tensor) on the device for a batch of
        ``numels``: built at the first sight of the shapes (the one host->device copy), cached."""
        cached = self._seg_layouts.get(numels)
        if cached is None:
            blocks: list[int] = []
            per: list[int] = []
            for n in numels:  # an empty tensor keeps one empty block: every tensor has a row
                full, rest = divmod(n, _BLOCK)
                mine = [_BLOCK] * full + ([rest] if rest or not full else [])
                blocks += mine
                per.append(len(mine))
            if len(self._seg_layouts) > 256:
                self._seg_layouts.clear()
            cached = self._seg_layouts[numels] = (
                self.to_device(blocks),
                self.to_device(per),
                self.to_device(list(numels)),
            )
        return cached

    def _foreach_group(self, tensors: Sequence[torch.Tensor], rows: list[int]) -> list[int]:
        """Indices of the not yet placed non-empty fp32 tensors when there are enough for the
        multi-tensor norms and maxima of ``_foreach`` (bf16/fp16: ``_foreach_norm`` would round
        the norms to their dtype, and ``dtype=`` is what we never pass)."""
        if len(tensors) < _MIN_BATCH or not self._batchable or "sumsq" not in self.vcol:
            return []
        ks = [k for k, t in enumerate(tensors) if rows[k] < 0 and t.dtype == _F32 and t.numel()]
        return ks if len(ks) >= _MIN_BATCH else []

    def _flat_groups(self, tensors: Sequence[torch.Tensor], rows: list[int]) -> list[tuple[list[int], _FlatLayout]]:
        """Groups of the not yet placed ``tensors`` that ``_batch`` can reduce together (see
        ``_FlatLayout.of``)."""
        if len(tensors) < _MIN_BATCH or not self._batchable:
            return []
        by_storage: dict[tuple[int, torch.dtype], list[int]] = {}
        for k, t in enumerate(tensors):  # plain tensors only: a subclass's storage may not be its data
            if rows[k] < 0 and type(t) in _PLAIN and t.dtype in _FLAT_DTYPES and t.numel() and t.is_contiguous():
                try:  # inline, not _storage_ptr: no Python frame per tensor
                    ptr = t.untyped_storage().data_ptr()
                except (RuntimeError, NotImplementedError):
                    continue  # no storage (XLA, lazy, functional)
                by_storage.setdefault((ptr, t.dtype), []).append(k)
        groups = []
        for idx in by_storage.values():
            if len(idx) >= _MIN_BATCH:
                key = tuple((int(tensors[k].storage_offset()), tensors[k].numel()) for k in idx)
                if key not in self._layouts:
                    if len(self._layouts) > 256:
                        self._layouts.clear()
                    self._layouts[key] = _batches(key, self.device)
                for pos, layout in self._layouts[key]:
                    fits = not self.counts or (
                        _MASKS_OUT and layout.chunks * layout.width <= _SCRATCH_MAX and layout.largest <= _COUNT_EXACT
                    )
                    if fits:
                        groups.append(([idx[j] for j in pos], layout))
        return groups

    def _batch(self, tensors: list[torch.Tensor], layout: _FlatLayout, row: int) -> None:
        """One group of views of one buffer into rows ``row..``: per-chunk partials over a
        ``[chunks, C]`` view of the buffer (``sum``, ``linalg_vector_norm``, ``aminmax`` along
        dim 1, each reading the buffer once; each count a mask into the scratch summed per chunk),
        combined per tensor by ``segment_reduce`` (chunk norms squared and summed, then the root:
        the row holds the norm), gathered into caller order and copied into the rows.  min/max go
        to the fp32 values (bf16/fp16 are exact there).  Every per-chunk partial is one float32
        per chunk: the largest temporary, 1/``width`` of the span's elements times 4 bytes."""
        flat = tensors[0].as_strided((layout.chunks, layout.width), (layout.width, 1), layout.start)
        lengths, cols = layout.lengths, []
        for c in self.values:
            if c == "sum":
                cols.append(_segment_reduce(torch.sum(flat, dim=1, dtype=_F32), "sum", lengths=lengths))
            elif c == "sumsq":
                sq = torch.linalg.vector_norm(flat, dim=1, dtype=_F32).square_()
                cols.append(_segment_reduce(sq, "sum", lengths=lengths).sqrt_())
            elif c == "min":
                lo, hi = torch.aminmax(flat, dim=1)
                cols += [
                    _segment_reduce(lo, "min", lengths=lengths),
                    _segment_reduce(hi, "max", lengths=lengths),
                ]
        cols += self._batch_counts(flat, layout)
        for k, t in enumerate(tensors):
            self.numels[row + k] = t.numel()
        seg = torch.stack(cols, dim=1) if len(cols) > 1 else cols[0].unsqueeze(1)
        picked = seg if layout.select is None else seg.index_select(0, layout.select)
        nv = len(self.values)
        done = 0
        while done < len(tensors):  # rows may continue into the next chunk of the row buffer
            chunk, r = self._chunk(row + done)
            n = min(len(tensors) - done, self.capacity - r)
            if nv:
                chunk.values[r : r + n, :nv].copy_(picked[done : done + n, :nv])
            if chunk.counts is not None:
                chunk.counts[r : r + n].copy_(picked[done : done + n, nv:])
            done += n

    def _foreach(self, group: list[torch.Tensor], row: int) -> None:
        """Separate fp32 tensors into rows ``row..``: ``sum`` and ``amin`` per tensor (``out=``),
        the norms and maxima of the whole group by ``_foreach_norm``/``_foreach_max`` (one
        multi-tensor launch each on CUDA) stacked into their columns: 2 ops per tensor + 4, not 3
        per tensor.  There is no ``_foreach`` sum or min in ATen."""
        vc = self.vcol
        for j, t in enumerate(group):
            self.numels[row + j] = t.numel()
            chunk, r = self._chunk(row + j)
            v = chunk.values[r]
            if "sum" in vc:
                torch.sum(t, dim=None, dtype=_F32, out=v[vc["sum"]])
            if "min" in vc:
                torch.amin(t, out=v[vc["min"]])
            if self.counts:
                self._count(t, chunk.counts[r])  # type: ignore[index]
        norms = torch._foreach_norm(group)
        maxes, foreach_max = None, _FOREACH_MAX
        if "max" in vc and foreach_max is not None:
            maxes = foreach_max(group)
        elif "max" in vc:  # torch < 2.4: one amax per tensor
            for j, t in enumerate(group):
                chunk, r = self._chunk(row + j)
                torch.amax(t, out=chunk.values[r, vc["max"]])
        done = 0
        while done < len(group):  # rows may continue into the next chunk of the row buffer
            chunk, r = self._chunk(row + done)
            n = min(len(group) - done, self.capacity - r)
            torch.stack(norms[done : done + n], out=chunk.values[r : r + n, vc["sumsq"]])
            if maxes is not None:
                torch.stack(maxes[done : done + n], out=chunk.values[r : r + n, vc["max"]])
            done += n

    def _batch_counts(self, flat: torch.Tensor, layout: _FlatLayout) -> list[torch.Tensor]:
        """Per count, ``[segments]`` float32 counts of a group: a mask over the whole span into
        the scratch, summed per chunk, then per segment by ``segment_reduce``.  Exact: float32
        holds every count of a tensor of up to 2^24 elements (``_COUNT_EXACT``; larger tensors
        are not batched).  One count at a time, so no partial is larger than one float per
        chunk (three ops per count)."""
        m, w = layout.chunks, layout.width
        masks = self._masks(m * w) if self.counts else None
        out = []
        for k, col in enumerate(self.counts):
            mask = self._mask(flat, col, masks[k, : m * w].view(m, w))  # type: ignore[index]
            out.append(_segment_reduce(torch.sum(mask, dim=1, dtype=_F32), "sum", lengths=layout.lengths))
        return out

    def _chunk(self, row: int) -> tuple[_Chunk, int]:
        c, r = divmod(row, self.capacity)
        while c >= len(self.chunks):
            self.chunks.append(_Chunk.new(self.capacity, max(len(self.values), 1), len(self.counts), self.device))
        return self.chunks[c], r

    def _reduce(self, t: torch.Tensor, row: int) -> None:
        if t.is_complex():
            t = t.abs()  # the modulus, as ``collectors.base.capture_views`` records complex tensors
        if not (t.is_floating_point() and t.dtype.itemsize >= 2):  # ints, bool, fp8: small, rare
            t = t.to(_F32)
        self.numels[row] = t.numel()
        self.kinds[row] = t.dtype
        if t.numel() == 0:
            return  # the host writes the merge identities (it knows the count)
        chunk, r = self._chunk(row)
        v, vc = chunk.values[r], self.vcol
        if "sum" in vc:
            torch.sum(t, dim=None, dtype=_F32, out=v[vc["sum"]])
        if "sumsq" in vc:
            if t.dtype == torch.float64:  # a norm may not narrow its input: taken in fp64, stored in fp32
                v[vc["sumsq"]].copy_(torch.linalg.vector_norm(t))
            else:
                torch.linalg.vector_norm(t, dtype=_F32, out=v[vc["sumsq"]])
        if "min" in vc:
            ext = v[vc["min"] : vc["min"] + 2] if t.dtype == _F32 else self._extremes(chunk, t.dtype)[r]
            torch.aminmax(t, out=(ext[0], ext[1]))
        if "m2" in vc:
            torch.var(t if t.dtype == _F32 else t.to(_F32), dim=None, correction=0, out=v[vc["m2"]])
        if self.counts:
            self._count(t, chunk.counts[r])  # type: ignore[index]

    def _count(self, t: torch.Tensor, c: torch.Tensor) -> None:
        """The requested counts with one mask per count and ONE ``sum`` for all of them: the masks
        are written (``out=``) into the rows of a per-stream scratch, summed along its rows into
        the row's adjacent count columns (``nans, infs``: 3 ops instead of 4)."""
        n = t.numel()
        if not _MASKS_OUT:
            self._count_transient(t, c)
            return
        if n > min(_SLICE, _SCRATCH_MAX):
            self._count_in_slices(t, c, min(_SLICE, _SCRATCH_MAX))
            return
        masks = self._masks(n)
        for k, col in enumerate(self.counts):
            self._mask(t, col, masks[k, :n].view(t.shape))
        torch.sum(masks[:, :n], dim=1, out=c)

    def _count_in_slices(self, t: torch.Tensor, c: torch.Tensor, size: int) -> None:
        """The counts of a tensor larger than a slice: slices of ``size`` elements of its
        span (counts do not depend on the order of the elements) through the scratch, each slice's
        counts summed into a small ``[slices, counts]`` table, the table into the row.  A view that
        does not fill one span (strided, expanded) takes one transient mask per count instead."""
        flat = _span(t)
        if flat is None:
            self._count_transient(t, c)
            return
        n = flat.numel()
        masks = self._masks(size)
        parts = torch.empty((-(-n // size), len(self.counts)), dtype=c.dtype, device=c.device)
        for i, start in enumerate(range(0, n, size)):
            piece = flat[start : start + size]
            m = piece.numel()
            for k, col in enumerate(self.counts):
                self._mask(piece, col, masks[k, :m])
            torch.sum(masks[:, :m], dim=1, out=parts[i])
        torch.sum(parts, dim=0, out=c)

    def _count_transient(self, t: torch.Tensor, c: torch.Tensor) -> None:
        """One full-size mask per count, freed after its ``sum`` (no scratch can hold ``t``'s masks)."""
        for k, col in enumerate(self.counts):
            torch.sum(self._mask(t, col), dim=None, out=c[k])

    def _mask(self, t: torch.Tensor, col: str, out: torch.Tensor | None = None) -> torch.Tensor:
        if col == "nans":
            return torch.isnan(t) if out is None else torch.ops.aten.isnan.out(t, out=out)
        if col == "infs":
            return torch.isinf(t) if out is None else torch.ops.aten.isinf.out(t, out=out)
        return torch.lt(t.abs(), self._eps_in(t.dtype), out=out) if out is not None else t.abs() < self._eps_in(t.dtype)

    def _masks(self, n: int) -> torch.Tensor:
        """``[counts, >= n]`` bool scratch of the current stream, grown by doubling, dropped at the
        step end.  Per stream: a hook on a side stream must not overwrite masks that another
        stream's ``sum`` has not read yet (the allocator orders reuse within one stream only)."""
        key = self.stream_key()
        buf = self._scratch.get(key)
        if buf is None or buf.shape[1] < n:
            size = max(4096, 1 << (n - 1).bit_length(), 2 * buf.shape[1] if buf is not None else 0)
            buf = self._scratch[key] = torch.empty(
                (len(self.counts), min(size, _SCRATCH_MAX)), dtype=torch.bool, device=self.device
            )
        return buf

    def _eps_in(self, dtype: torch.dtype) -> float:
        """``eps`` rounded up to ``dtype``: the comparison runs in the tensor's dtype, where 1e-8
        would round to 0 in fp16 (no element would count); rounding up keeps |x| < eps exact."""
        cached = self._eps_cache.get(dtype)
        if cached is None:
            exact = torch.tensor(self.eps, dtype=torch.float64)
            low = exact.to(dtype)
            if low.double() < exact:
                low = torch.nextafter(low, torch.tensor(math.inf, dtype=dtype))
            cached = self._eps_cache[dtype] = float(low)
        return cached

    def _extremes(self, chunk: _Chunk, dtype: torch.dtype) -> torch.Tensor:
        buf = chunk.extremes.get(dtype)
        if buf is None:
            buf = chunk.extremes[dtype] = torch.empty((self.capacity, 2), dtype=dtype, device=self.device)
        return buf

    # -- step end ------------------------------------------------------------------------------
    def gather_payload(self, rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The raw rows ``rows`` for a shard merge, on the device: fp32 ``[n, values]`` (min/max in
        fp32: exact for bf16/fp16) and int64 ``[1 + n, 1 + counts]`` (first row: n; then numel and
        the counts).  Step end only: the numels come from the host (one small copy)."""
        vals, cnts = [], []
        for i in rows:
            chunk, r = self._chunk(i)
            v = chunk.values[r]
            if "min" in self.vcol and self.kinds[i] != _F32 and self.numels[i]:
                j = self.vcol["min"]
                v = torch.cat([v[:j], chunk.extremes[self.kinds[i]][r].to(_F32), v[j + 2 :]])
            vals.append(v)
            if self.counts:
                cnts.append(chunk.counts[r])  # type: ignore[index]
        meta = torch.tensor([[len(rows)]] + [[self.numels[i]] for i in rows], dtype=torch.int64)
        meta = torch.cat([meta, torch.zeros((1 + len(rows), len(self.counts)), dtype=torch.int64)], 1)
        meta = meta.to(self.device)
        if cnts:
            meta[1:, 1:] = torch.stack(cnts)
        values = torch.stack(vals) if vals else torch.empty((0, max(len(self.values), 1)), device=self.device)
        return values, meta

    def snapshot(self, extra: Sequence[torch.Tensor] = ()) -> HostCopy | None:
        """Start the step's one device->host copy (the rows, then ``extra`` tensors of this device:
        ready-made values, gathered shard rows); the buffers are reused for the next step."""
        with self.lock:
            n, numels, kinds, pads = len(self.numels), self.numels, self.kinds, self.pads
            self.numels, self.kinds, self.pads = [], [], {}
            self._scratch = {}  # the Triton route's partials scratch stays (2-4 MiB a stream at most)
        if n == 0 and not extra:
            return None
        parts: list[torch.Tensor] = []
        # (chunk or index, key, dtype, width or shape, rows used, rows in the stream)
        layout: list[tuple[Any, ...]] = []
        cap = self.capacity
        for c, chunk in enumerate(self.chunks[: (n + cap - 1) // cap]):
            rows = min(cap, n - c * cap)
            # a chunk's values and counts travel whole, as the one buffer they are (a few KiB):
            # no view per column and no ``cat`` for a step whose rows fit one chunk
            parts.append(chunk.raw)
            layout.append((c, "values", _F32, chunk.values.shape[1], rows, cap))
            if chunk.counts is not None:
                layout.append((c, "counts", torch.int64, chunk.counts.shape[1], rows, cap))
            for key, buf in chunk.extremes.items():
                parts.append(buf[:rows].reshape(-1).view(torch.uint8))
                layout.append((c, key, buf.dtype, buf.shape[1], rows, rows))
        for k, t in enumerate(extra):
            parts.append(t.reshape(-1).view(torch.uint8))
            layout.append((k, "extra", t.dtype, t.shape, 0, 0))
        flat = (
            torch.cat(parts)
            if len(parts) > 1
            else parts[0].clone()
            if parts
            else torch.empty(0, dtype=torch.uint8, device=self.device)
        )
        return HostCopy(_copy_to_host(flat), layout, numels, kinds, self, pads)

    def clear(self) -> None:
        with self.lock:
            self.numels, self.kinds, self.pads = [], [], {}
            self._scratch = {}
            if self._triton is not None:
                self._triton.drop_scratch()


_RAW_CUDA_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what Triton's launcher reads too


def _span(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s elements as one flat view of the memory they fill (any order of the dims), or None
    when they do not fill one span (strided, expanded)."""
    if t.is_contiguous():
        return t.view(-1)
    return t.as_strided((t.numel(),), (1,)) if device_triton.dense(t) else None


def _stream_key(device: torch.device) -> Any:
    """The current stream of ``device`` (None where there are no streams: the CPU seam)."""
    if device.type == "cpu":
        return None
    if device.type == "cuda" and _RAW_CUDA_STREAM is not None and device.index is not None:
        # the stream's handle: torch.cuda.current_stream builds a Stream object (~10x slower)
        return _RAW_CUDA_STREAM(device.index)
    backend = getattr(torch, device.type, None)
    current = getattr(backend, "current_stream", None)
    if current is None:
        return None
    stream = current(device)
    return getattr(stream, "stream_id", None), getattr(stream, "cuda_stream", id(stream))


_UNPINNED: set[str] = set()  # device types warned about (once per process)


def _copy_to_host(flat: torch.Tensor) -> tuple[torch.Tensor, object]:
    """One asynchronous copy into pinned memory with an event (synchronous on the CPU seam, and
    where no pinned memory can be allocated for the device: one warning, then a plain copy)."""
    if flat.device.type == "cpu":
        return flat, None
    try:
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    except RuntimeError as exc:
        _warn_unpinned(flat.device, exc)
        return flat.to("cpu"), None
    host.copy_(flat, non_blocking=True)
    backend = getattr(torch, flat.device.type, None)
    event = backend.Event() if backend is not None and hasattr(backend, "Event") else None
    if event is not None:  # on the stream of the rows' device, which may not be the current device
        current = getattr(backend, "current_stream", None)
        if current is not None:
            event.record(current(flat.device))
        else:
            event.record()
    return host, event


def _warn_unpinned(device: torch.device, exc: Exception) -> None:
    if device.type not in _UNPINNED:
        _UNPINNED.add(device.type)
        log.warning(
            "trainmon: no pinned host memory for %s tensors (%s); each step's statistics are copied "
            "to the host synchronously instead of asynchronously (the same values; the training "
            "thread waits for the copy at the step end). Fix: a torch build with pinned memory "
            "support for this device",
            device.type,
            str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
        )


class HostCopy:
    """The step's device rows on their way to the host; ``rows`` waits for the copy."""

    def __init__(
        self,
        copy: tuple[torch.Tensor, object],
        layout: list,
        numels: list[int],
        kinds: list[torch.dtype],
        owner: DeviceRows,
        pads: dict[int, int] | None = None,
    ):
        self._host, self._event = copy
        self._layout, self.numels, self.kinds, self._owner = layout, numels, kinds, owner
        self._pads = pads or {}

    def extra(self) -> list[torch.Tensor]:
        """The ``extra`` tensors given to ``snapshot``, on the host, in order."""
        self._wait()
        pos, out = 0, []
        for _k, key, dtype, shape, _rows, stored in self._layout:
            size = (int(np.prod(shape)) if key == "extra" else stored * shape) * dtype.itemsize
            if key == "extra":
                out.append(self._host[pos : pos + size].clone().view(dtype).reshape(shape))
            pos += size
        return out

    def _wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()  # type: ignore[attr-defined]
            self._event = None

    def rows(self, columns: Sequence[str]) -> np.ndarray:
        """``[rows, len(columns)]`` float64 partials (``count`` first), merge identities for empty
        tensors.  Blocks until the copy has landed: call it off the training thread."""
        self._wait()
        o, n, cap = self._owner, len(self.numels), self._owner.capacity
        values = np.zeros((n, len(o.values)))
        counts = np.zeros((n, len(o.counts)))
        mins, maxs = np.full(n, np.nan), np.full(n, np.nan)
        pos = 0
        for c, key, dtype, width, rows, stored in self._layout:
            if key == "extra":
                break
            size = stored * width * dtype.itemsize
            part = self._host[pos : pos + size].clone().view(dtype).reshape(stored, width)[:rows]
            mat = part.to(torch.float64).numpy()
            pos += size
            span = slice(c * cap, c * cap + rows)
            if key == "values":
                values[span] = mat[:, : len(o.values)]
            elif key == "counts":
                counts[span] = mat
            else:
                pick = np.array([k == key for k in self.kinds[span]], dtype=bool)
                mins[span] = np.where(pick, mat[:, 0], mins[span])
                maxs[span] = np.where(pick, mat[:, 1], maxs[span])
        return self._assemble(columns, values, counts, mins, maxs)

    def _assemble(
        self, columns: Sequence[str], values: np.ndarray, counts: np.ndarray, mins: np.ndarray, maxs: np.ndarray
    ) -> np.ndarray:
        if "min" in self._owner.vcol:
            j = self._owner.vcol["min"]
            f32 = np.array([k == _F32 for k in self.kinds], dtype=bool)
            values[:, j] = np.where(f32, values[:, j], mins)
            values[:, j + 1] = np.where(f32, values[:, j + 1], maxs)
        out = _partials(columns, np.asarray(self.numels, dtype=np.float64), values, counts)
        if self._pads:  # sparse tensors: their stored values' rows merged with their implicit zeros
            idx = np.fromiter(self._pads, dtype=np.int64)
            zeros = np.fromiter(self._pads.values(), dtype=np.float64)
            out[idx] = with_implicit_zeros(out[idx], columns, zeros, self._owner.eps)
        return out


def gathered_partials(columns: Sequence[str], values: np.ndarray, meta: np.ndarray) -> np.ndarray:
    """One rank's gathered shard rows (``DeviceRows.gather_payload`` without its first meta row)
    as a float64 partials matrix."""
    return _partials(columns, meta[:, 0].astype(np.float64), values, meta[:, 1:].astype(np.float64))


def _partials(columns: Sequence[str], numel: np.ndarray, values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The engine's partials columns from the device layout: norms squared and var(correction=0)
    times n in float64 on the host; merge identities for empty tensors (no reduction ran)."""
    vals, cnts = _layout(columns)
    vcol, ccol = {c: j for j, c in enumerate(vals)}, {c: j for j, c in enumerate(cnts)}
    out = np.empty((len(numel), len(columns)))
    with np.errstate(over="ignore", invalid="ignore"):
        for j, c in enumerate(columns):
            if c == "count":
                out[:, j] = numel
                continue
            if c in ccol:
                col = counts[:, ccol[c]]
            elif c == "sumsq":
                col = np.square(values[:, vcol[c]])  # the device holds the norm
            elif c == "m2":
                col = values[:, vcol[c]] * numel  # the device holds var(correction=0)
            else:
                col = values[:, vcol[c]]
            out[:, j] = np.where(numel > 0, col, PARTIAL[c].identity)
    return out
