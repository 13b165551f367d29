"""The stats engine: collectors hand it tensors, it hands sinks the step's rows.

Within a step, ``capture`` turns tensors into partials rows right away (the tensors may change
later in the step: grads get reduced, params updated) and keeps only those small rows: on the
device for accelerator tensors, in one reused host buffer (``HostRows``) for CPU tensors.
``finish_step`` moves everything of the step to the host in one copy per device and merges
sharded rows over their process group; it is the only place that reads device values on the
host.  It returns ``StepRows``: the statistics are derived from the partials (a block at a time,
``stats.derive``) when a sink first reads them, which for the threaded sink is on its writer
thread.

Accelerator tensors (and, under the test seam ``TRAINMON_DEVICE_PATH=1``, CPU tensors too) take
``stats.device_rows``: in-place fp32 rows, no host sync in hooks, one asynchronous device->host
copy per device per step, resolved (and sharded rows merged in float64) on the host when the rows
are first read.  ``stats_paths`` says which path each device type used (recorded in run.json).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import operator
import os
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from trainmon.stats._fused_cpu import FUSED_DTYPES, fill_rows
from trainmon.stats._fused_cpu import _function as _fused_kernel
from trainmon.stats.derive import derive_matrix, integer_columns
from trainmon.stats.device_rows import DeviceRows, HostCopy
from trainmon.stats.host_rows import HostRows
from trainmon.stats.odd_tensors import Skipped, reason_of, unreadable_device, warn_skipped
from trainmon.stats.partials import device_columns, fused_columns, write_cpu_rows
from trainmon.stats.rows import RowBlock, StepRows, paced_rows
from trainmon.stats.table import combine, partials_for, unscale

__all__ = ["StatsEngine", "Tracked", "Meta", "FamilyBlock", "SEAM_ENV", "device_path_forced", "merge_rows"]

SEAM_ENV = "TRAINMON_DEVICE_PATH"
SKIPPED = Skipped(None)  # the row handle of a tensor seen while a CUDA graph was being captured
log = logging.getLogger(__name__)


def stream_capturing(device: torch.device) -> bool:
    """True while ``device``'s current stream is capturing a CUDA graph: a hook then must not
    launch work or copy (its kernels would only be recorded, and a copy can break the capture).
    A module attribute so tests can fake it."""
    # torch.cuda.is_current_stream_capturing's own C call (a frame less, at every planned capture)
    return device.type == "cuda" and _IS_CAPTURING()


def device_path_forced() -> bool:
    """The test seam: ``TRAINMON_DEVICE_PATH=1`` sends CPU tensors down the accelerator path
    (the same functions, no CPU shortcut, no fused kernel), so CI checks it without a GPU."""
    return os.environ.get(SEAM_ENV, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True, slots=True)
class Tracked:
    """A named tensor to record: what collectors pass to ``capture``."""

    name: str
    tensor: torch.Tensor
    vpp_stage: int = 0
    shape: tuple[int, ...] | None = None  # logical (full) shape when ``tensor`` is a shard


@dataclass(frozen=True, slots=True)
class Meta:
    family: str
    name: str
    vpp_stage: int
    shape: tuple[int, ...]
    dtype: str
    micro_step: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# One captured tensor, as the step keeps it until ``finish_step``: (name, vpp_stage, shape, dtype).
# Plain tuples: a hook on a CPU model captures a few hundred of these per step.
_Item = tuple

# Per-tensor attributes read with ``map`` (a loop in C: no Python frame, whatever the count).
_IS_CPU = operator.attrgetter("is_cpu")
_DEVICE = operator.attrgetter("device")
_LAYOUT = operator.attrgetter("layout")
_DEVICE_INDEX = torch.Tensor.get_device  # -1 on the CPU
_DATA_PTR = torch.Tensor.data_ptr
_IS_CONTIGUOUS = torch.Tensor.is_contiguous
# False on a build without CUDA; a build without the function at all never captures
_IS_CAPTURING = getattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False)
_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the fused kernel's dtype codes


_NO_ROWS = np.empty((0, 0))  # a step without host rows


class FamilyBlock:
    """One family's rows as a block: the layout a collector keeps from step to step
    (``collectors.base.FamilyRows``) plus what the engine caches for it, so that a step of the
    family is one multi-tensor call and one pending entry, with no Python work per tensor:

    * ``items``: the rows' ``(name, vpp_stage, shape, dtype)``, never mutated (a new block is made
      when the layout changes, so a step not yet written keeps its own);
    * the fused CPU kernel's argument arrays: element counts and dtype codes (fixed with the
      layout) and the data pointers, rebuilt only when an address moved (one ``map`` to read
      them, one comparison of two lists);
    * on the accelerator path, the device's route for these tensors (``DeviceRows.plan``), kept
      while the tensors' types, layouts and device stay the same.
    """

    __slots__ = ("_keep", "device_key", "fused", "items", "kinds", "n", "numels", "plan", "ptr_addr", "ptrs")

    def __init__(self, items: list[_Item], dtypes: Sequence[torch.dtype], numels: Sequence[int]):
        self.items = items
        self.n = len(items)
        self.fused = all([d in _KIND for d in dtypes])
        self.numels = array("q", numels)
        self.kinds = array("i", [_KIND.get(d, -1) for d in dtypes])
        self.ptrs: list[int] = []
        self.ptr_addr = 0
        self._keep: array | None = None  # the pointer array ``ptr_addr`` points into
        self.device_key: tuple | None = None
        self.plan: Any = None

    def pointers(self, ptrs: list[int]) -> int:
        """The address of the kernel's pointer array for ``ptrs`` (rebuilt when they moved)."""
        if ptrs != self.ptrs:
            self.ptrs = ptrs
            self._keep = array("q", ptrs)
            self.ptr_addr = self._keep.buffer_info()[0]
        return self.ptr_addr


class _HookItems:
    """The ``(name, vpp_stage, shape, dtype)`` items of hook captures (activations), one tuple per
    distinct item, reused while a name's shape and dtype hold: an item lives until the writer
    builds its step, and a new tuple (and ``torch.Size``) per captured tensor was two young
    container allocations per activation row (a collection every ~350 rows)."""

    __slots__ = ("by_vpp",)

    def __init__(self) -> None:
        self.by_vpp: dict[int, _ItemsByName] = {}  # vpp stage -> name -> its item

    def of(
        self, vpp: int, names: Sequence[str], tensors: Sequence[torch.Tensor], shape: tuple[int, ...] | None
    ) -> list[_Item]:
        known = self.by_vpp.get(vpp)
        if known is None or len(known) > 65536:  # bounded: names are a model's modules
            known = self.by_vpp[vpp] = _ItemsByName()
        # ``known[n]``, not ``known.get(n)``: a subscript is no call (one C call less per row)
        if shape is None:
            return [
                i
                if (i := known[n]) is not None and i[3] is t.dtype and i[2] == t.shape
                else _new_item(known, n, vpp, t.shape, t)
                for n, t in zip(names, tensors)
            ]
        return [
            i
            if (i := known[n]) is not None and i[3] is t.dtype and i[2] == shape
            else _new_item(known, n, vpp, shape, t)
            for n, t in zip(names, tensors)
        ]


class _ItemsByName(dict):
    """name -> its item; None for a name not seen yet."""

    def __missing__(self, name: str) -> None:
        return None


def _new_item(known: dict[str, _Item], name: str, vpp: int, shape: Sequence[int], t: torch.Tensor) -> _Item:
    item = known[name] = (name, vpp, tuple(shape), t.dtype)
    return item


@dataclass(slots=True)
class _Pending:
    family: str
    items: list[_Item]
    rows: list[Any]  # host row index (CPU), (DeviceRows, index), or a value tensor; for a block
    # (``capture_block``) a range or an int64 array of row numbers (of ``owner``, or of the host)
    columns: tuple[str, ...]
    micro_step: int | None = None
    extra: dict[str, Any] | None = None
    is_values: bool = False
    integers: tuple[int, ...] = ()  # value columns recorded as ints (flags, counts)
    block: bool = False  # value rows given as one [rows, columns] tensor (``capture_value_block``)
    group: Any = None  # process group to merge over (sharded tensors)
    slot: Any = None  # (device, index) of this capture's tensors in the step's copy
    scale: Any = None  # divide the partials by this (float, or a device 0-d tensor)
    extendable: bool = False  # items/rows are the engine's own lists: later hook rows may join them
    owner: Any = None  # the DeviceRows whose rows ``rows`` (a range, or row numbers) are
    layout: bool = False  # ``items`` is a collector's layout list, the same object step after step


class StatsEngine:
    """Batched statistics for one monitor. ``ops`` are names from ``stats.table.STATS``."""

    def __init__(self, ops: Sequence[str], eps: float = 1e-8):
        self.ops = tuple(ops)
        self.eps = eps
        self.columns = device_columns(partials_for(self.ops))
        self._pending: list[_Pending] = []
        self._host = HostRows(len(self.columns))
        self._fused_cols: tuple[int, ...] | bool | None = False
        self.seam = device_path_forced()
        self._devices: dict[torch.device, DeviceRows] = {}
        self.stats_paths: dict[str, str] = {}  # device type -> "cpu-fused" | "cpu-eager" | "device[-triton]"
        self._warned_capture = False
        self._kernel: Any = None  # (fused kernel, its column map) once the first block decided on it
        self._sharded = False  # a capture this step has a process group: finish_step merges
        self._device_values = False  # a capture this step holds values or a scale on a device
        self._hook_items = _HookItems()

    def capture(
        self,
        family: str,
        items: Sequence[Tracked],
        *,
        micro_step: int | None = None,
        extra: dict[str, Any] | None = None,
        group: Any = None,
        scale: Any = None,
    ) -> None:
        """Record the stats of ``items`` as they are now.  No host sync.

        ``group``: the tensors are shards of larger tensors split over this process group; the
        rows are merged over it in ``finish_step`` so every rank reports full-tensor stats.
        ``scale``: the tensors are ``scale`` times the values to report (fp16 loss scale, a 0-d
        tensor or a number): the partials are divided by it (``Partial.power``) on the host,
        instead of dividing every tensor into a new one on the device.
        """
        if not items:
            return
        if scale is not None and "zeros" in self.columns:  # abs(x) < eps is not scale-free
            items = [Tracked(it.name, it.tensor / scale, it.vpp_stage, it.shape) for it in items]
            scale = None
        rows = self.partials([it.tensor for it in items])
        self.capture_rows(family, items, rows, micro_step=micro_step, extra=extra, group=group, scale=scale)

    def partials(self, tensors: Sequence[torch.Tensor], *, no_sync: bool = False) -> list[Any]:
        """Partials rows of ``tensors`` as they are now, as opaque row handles for
        ``capture_rows``.  Never reads a device value on the host (``no_sync`` is kept for
        callers; every path is sync-free now).  A tensor passed twice is reduced once."""
        if not self.seam and all(map(_IS_CPU, tensors)):  # a C loop: no frame per tensor
            fused = self._fused()
            if "cpu" not in self.stats_paths:
                self.stats_paths["cpu"] = "cpu-fused" if fused is not None else "cpu-eager"
            return write_cpu_rows(tensors, self.columns, self.eps, self._host, fused)  # type: ignore[return-value]
        return self._mixed_partials(tensors)

    def _mixed_partials(self, tensors: Sequence[torch.Tensor]) -> list[Any]:
        """``partials`` of tensors not all on the CPU (or under the seam): one group per device."""
        first: dict[int, int] = {}
        for i, t in enumerate(tensors):
            first.setdefault(id(t), i)
        by_device: dict[torch.device, list[int]] = {}
        for i in first.values():
            by_device.setdefault(tensors[i].device, []).append(i)
        rows: list[Any] = [None] * len(tensors)
        got: list[Any]
        for device, idx in by_device.items():
            if (device.type != "cpu" or self.seam) and stream_capturing(device):
                self._warn_capturing()
                got = [SKIPPED] * len(idx)
            elif (why := unreadable_device(device)) is not None:
                got = [Skipped(why)] * len(idx)
            elif device.type == "cpu" and not self.seam:
                got = list(write_cpu_rows([tensors[i] for i in idx], self.columns, self.eps, self._host, self._fused()))
            else:
                got = self._device_write(device, [tensors[i] for i in idx])
            for i, r in zip(idx, got):
                rows[i] = r
        return [rows[first[id(t)]] for t in tensors]

    def _device_write(self, device: torch.device, tensors: list[torch.Tensor]) -> list[Any]:
        """Rows of ``tensors`` on ``device``'s path; if the batch fails, one by one, so that a
        tensor no reduction can read is skipped alone."""
        rows = self._device_rows(device)
        try:
            return rows.write(tensors)
        except Exception:
            pass
        got: list[Any] = []
        for t in tensors:
            try:
                got.extend(rows.write([t]))
            except Exception as exc:
                got.append(Skipped(reason_of(exc)))
        return got

    def partial(self, t: torch.Tensor) -> Any:
        """``partials([t])[0]`` with fewer frames: the per-hook path of activations.  Takes the
        fused kernel directly once the first CPU capture has decided on it."""
        cols = self._fused_cols
        if isinstance(cols, tuple) and t.is_cpu and t.dtype in FUSED_DTYPES and not self.seam:
            host = self._host
            with host.lock:
                start = host.reserve(1)
                try:
                    fill_rows((t,), host.tensor, start, cols, self.eps)
                    return start
                except Exception:
                    pass  # no strided storage (sparse, ...): the general path below handles it
        return self.partials([t])[0]

    def _warn_capturing(self) -> None:
        if not self._warned_capture:
            self._warned_capture = True
            log.warning(
                "trainmon: a CUDA graph is being captured; statistics of tensors seen during "
                "the capture are skipped (graph replays run no hooks and are not recorded)"
            )

    def _device_rows(self, device: torch.device) -> DeviceRows:
        rows = self._devices.get(device)
        if rows is None:
            rows = self._devices[device] = DeviceRows(device, self.columns, self.eps)
            self.stats_paths[device.type] = rows.path
        return rows

    def _fused(self) -> tuple[int, ...] | None:
        # Decided at the first CPU capture (that is when the kernel is built, if ever).
        if self._fused_cols is False:
            self._fused_cols = fused_columns(self.columns)
        return self._fused_cols  # type: ignore[return-value]

    def capture_rows(
        self,
        family: str,
        items: Sequence[Tracked],
        rows: Sequence[Any],
        *,
        micro_step: int | None = None,
        extra: dict[str, Any] | None = None,
        group: Any = None,
        scale: Any = None,
    ) -> None:
        """Record rows from ``partials`` under the names of ``items`` (one row may serve several
        names: a tensor that is the output of one module and the input of the next); ``scale``:
        see ``capture``."""
        if items and not isinstance(rows, range) and any([type(r) is Skipped for r in rows]):
            kept = [(it, r) for it, r in zip(items, rows) if not _skipped(family, it.name, r)]
            items, rows = [it for it, _ in kept], [r for _, r in kept]
        if items:
            if group is not None:
                self._sharded = True
            if isinstance(scale, torch.Tensor):
                self._device_values = True
            self._pending.append(
                _Pending(
                    family,
                    [
                        (it.name, it.vpp_stage, it.shape if it.shape is not None else it.tensor.shape, it.tensor.dtype)
                        for it in items
                    ],
                    rows if isinstance(rows, list) else list(rows),
                    self.columns,
                    micro_step,
                    dict(extra) if extra else None,
                    group=group,
                    scale=None
                    if scale is None
                    else scale.detach()
                    if isinstance(scale, torch.Tensor) and (self.seam or not scale.is_cpu)
                    else float(scale),
                )
            )

    def capture_items(
        self,
        family: str,
        items: list[_Item],
        tensors: Sequence[torch.Tensor],
        *,
        micro_step: int | None = None,
    ) -> None:
        """``capture`` for a collector that keeps a family's rows step after step
        (``collectors.base.FamilyRows``): ``items`` are the rows' ``(name, vpp_stage, shape,
        dtype)``, built once by the caller and reused (never mutated) while the layout holds, so
        a step creates no Python object per row; the partials of all ``tensors`` come from one
        multi-tensor call.  No autograd recording, no host sync."""
        if not items:
            return
        grad_was = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            rows = self.partials(tensors)
        finally:
            torch._C._set_grad_enabled(grad_was)
        if not isinstance(rows, range) and Skipped in map(type, rows):  # a C loop, no frame
            kept = [k for k, r in enumerate(rows) if not _skipped(family, items[k][0], r)]
            items, rows = [items[k] for k in kept], [rows[k] for k in kept]
            if not items:
                return
        self._pending.append(_Pending(family, items, rows, self.columns, micro_step, layout=True))

    def block(self, items: list[_Item], dtypes: Sequence[torch.dtype], numels: Sequence[int]) -> FamilyBlock:
        """A new ``FamilyBlock`` for ``capture_block`` (a collector makes one when its layout
        changes)."""
        return FamilyBlock(items, dtypes, numels)

    def capture_block(
        self, family: str, block: FamilyBlock, tensors: Sequence[torch.Tensor], micro_step: int | None = None
    ) -> None:
        """``capture_items`` of a family kept as a ``FamilyBlock``: ``tensors`` match its layout
        (dtypes and element counts, checked by the caller).  CPU tensors: one call of the fused
        kernel over the block's cached pointer table straight into the step buffer; accelerator
        tensors (and the seam): the device's cached route.  Either way a step costs this frame,
        the pending entry's and no Python work per tensor.  Anything unusual (no kernel, a
        non-contiguous or sparse tensor, a tensor the kernel refuses, a device without a route)
        takes ``capture_items``, whose values are the same."""
        if not block.n:
            return
        try:
            if not self.seam and block.fused and all(map(_IS_CPU, tensors)) and all(map(_IS_CONTIGUOUS, tensors)):
                kernel = self._kernel if self._kernel is not None else self._fused_kernel()
                if kernel:
                    addresses = list(map(_DATA_PTR, tensors))
                    ptrs = block.ptr_addr if addresses == block.ptrs else block.pointers(addresses)
                    host, n, width = self._host, block.n, len(self.columns)
                    with host.lock:
                        start = host.count
                        if start + n > host.tensor.shape[0]:
                            host.reserve(n)
                        host.count = start + n
                        out = host.tensor.data_ptr() + start * width * 8
                        bad = kernel[0](
                            ptrs,
                            block.numels.buffer_info()[0],
                            block.kinds.buffer_info()[0],
                            n,
                            out,
                            width,
                            kernel[1],
                            self.eps,
                        )
                    if not bad:  # else: rows left unused; the general path says which tensor
                        rows: Any = range(start, start + n)
                        self._pending.append(_Pending(family, block.items, rows, self.columns, micro_step, layout=True))
                        return
            elif self.seam or not tensors[0].is_cpu:
                # device indices, not torch.device objects (one allocation per tensor): a mix of
                # device types with one index fails in the route and takes the general path
                key = (
                    set(map(type, tensors)),
                    set(map(_LAYOUT, tensors)),
                    set(map(_DEVICE_INDEX, tensors)),
                    set(map(_IS_CPU, tensors)),
                )
                if key != block.device_key:
                    block.device_key, block.plan = key, self._plan(tensors)
                # a step captured into a CUDA graph after the plan was made: the general path, which
                # launches nothing then and says so once
                if block.plan is not None and not stream_capturing(block.plan[0].device):
                    owner, plan = block.plan
                    start = owner.write_planned(plan, tensors)
                    rows = range(start, start + block.n) if plan.order is None else plan.order + start
                    self._pending.append(
                        _Pending(family, block.items, rows, self.columns, micro_step, owner=owner, layout=True)
                    )
                    return
        except Exception:  # a tensor these paths cannot read (sparse, no storage): the general path
            block.plan = None  # handles it; a route that failed is not tried again for this layout
        self.capture_items(family, block.items, tensors, micro_step=micro_step)

    def _fused_kernel(self) -> Any:
        """(the fused kernel, the engine's column map) or False (no kernel: the eager path)."""
        cols = self._fused()
        if "cpu" not in self.stats_paths:
            self.stats_paths["cpu"] = "cpu-fused" if cols is not None else "cpu-eager"
        fn = _fused_kernel() if cols is not None else None
        # False: no kernel (decided once, like ``_fused``): blocks take the eager path
        self._kernel = (fn, (ctypes.c_int64 * len(cols))(*cols)) if fn is not None and cols else False
        return self._kernel

    def _plan(self, tensors: Sequence[torch.Tensor]) -> tuple[DeviceRows, Any] | None:
        """The device route of a block's tensors, or None (several devices, a capturing stream,
        a device the host cannot read, or tensors without a fixed route: the general path)."""
        devices = set(map(_DEVICE, tensors))
        if len(devices) != 1:
            return None
        (device,) = devices
        if stream_capturing(device) or unreadable_device(device) is not None:
            return None
        owner = self._device_rows(device)
        plan = owner.plan(tensors)
        return None if plan is None else (owner, plan)

    def capture_tensors(
        self,
        family: str,
        vpp_stage: int,
        names: Sequence[str],
        tensors: Sequence[torch.Tensor],
        rows: Sequence[Any],
        *,
        micro_step: int | None = None,
        shape: tuple[int, ...] | None = None,
    ) -> None:
        """``capture_rows`` without ``Tracked`` objects, for hooks (activations)."""
        if not isinstance(rows, range) and Skipped in map(type, rows):  # a C loop, no frame
            kept = [k for k, r in enumerate(rows) if not _skipped(family, names[k], r)]
            if not kept:
                return
            names, tensors, rows = [names[k] for k in kept], [tensors[k] for k in kept], [rows[k] for k in kept]
        items = self._hook_items.of(vpp_stage, names, tensors, shape)
        pending = self._pending
        if pending:
            # Consecutive hook captures of one family and micro-batch share one pending entry
            # (``_build_blocks`` would merge them into one block anyway): a forward's flushes
            # are one entry for the writer to read, not one per flush.
            last = pending[-1]
            if last.extendable and last.family == family and last.micro_step == micro_step:
                last.items.extend(items)
                last.rows.extend(rows)
                return
        pending.append(_Pending(family, items, list(rows), self.columns, micro_step, extendable=True))

    def capture_values(
        self,
        family: str,
        metas: Sequence[Meta],
        values: Sequence[torch.Tensor],
        columns: Sequence[str],
        integers: Sequence[str] = (),
    ) -> None:
        """Record values already computed on the device (one ``[len(columns)]`` row per meta;
        the rows share the first meta's ``micro_step`` and ``extra``).  Kept as they are (no fp64
        on the device); they reach the host with the step's one copy.  ``integers``: the columns
        written as ints (a flag or a count travels as a float with the step's copy)."""
        if metas and values and (self.seam or not values[0].is_cpu) and stream_capturing(values[0].device):
            self._warn_capturing()
            return
        if metas and any(not v.is_cpu and unreadable_device(v.device) for v in values):
            kept = [k for k, v in enumerate(values) if v.is_cpu or not _unreadable_value(family, metas[k], v)]
            metas, values = [metas[k] for k in kept], [values[k] for k in kept]
        if metas:
            self._device_values = True
            self._pending.append(
                _Pending(
                    family,
                    [(m.name, m.vpp_stage, m.shape, m.dtype) for m in metas],
                    [v.detach().reshape(-1) for v in values],
                    tuple(columns),
                    metas[0].micro_step,
                    metas[0].extra or None,
                    is_values=True,
                    integers=tuple(i for i, c in enumerate(columns) if c in integers),
                )
            )

    def capture_value_block(
        self, family: str, items: list[_Item], values: torch.Tensor, columns: Sequence[str]
    ) -> None:
        """``capture_values`` of one ``[len(items), len(columns)]`` tensor whose rows are
        ``items`` (reused by the caller while its layout holds, as in ``capture_items``): one
        tensor per family and step instead of one per row."""
        if not items:
            return
        if (self.seam or not values.is_cpu) and stream_capturing(values.device):
            self._warn_capturing()
            return
        if not values.is_cpu and unreadable_device(values.device) is not None:
            return
        self._device_values = True
        self._pending.append(
            _Pending(family, items, [values.detach()], tuple(columns), is_values=True, block=True, layout=True)
        )

    def mark(self) -> tuple[int, int]:
        """Where the captures stand now, for ``drop_since``: (pending entries, items of the last)."""
        pending = self._pending
        return len(pending), (len(pending[-1].items) if pending else 0)

    def drop_since(self, mark: tuple[int, int], family: str, vpp_stage: int) -> int:
        """Forget the rows of ``family`` and ``vpp_stage`` captured since ``mark`` (a forward that
        raised: its rows belong to no micro-batch); other rows stay.  Their partials stay unread in
        the step's buffers.  Returns how many rows were dropped."""
        pending, dropped = self._pending, 0
        at, kept = mark
        for i in range(max(at - 1, 0), len(pending)):
            p = pending[i]
            start = kept if i == at - 1 else 0
            if p.family != family or p.is_values or start >= len(p.items):
                continue
            keep = [j for j in range(start, len(p.items)) if p.items[j][1] != vpp_stage]
            dropped += len(p.items) - start - len(keep)
            # New lists: ``items`` may be a collector's reused layout (``capture_items``).
            p.items = list(p.items[:start]) + [p.items[j] for j in keep]
            p.rows = list(p.rows[:start]) + [p.rows[j] for j in keep]
        self._pending[max(at - 1, 0) :] = [p for p in pending[max(at - 1, 0) :] if p.items]
        return dropped

    def discard(self) -> None:
        self._pending.clear()
        self._sharded = self._device_values = False
        self._host.clear()
        for rows in self._devices.values():
            rows.clear()

    def finish_step(self, step: int) -> StepRows:
        """All rows captured since the last call, in capture order.  CPU values are read here;
        device values start their one asynchronous copy here and are read (and sharded device
        rows merged) when the rows are first built, which for a threaded sink is on its writer
        thread."""
        pending, self._pending = self._pending, []
        sharded, self._sharded = self._sharded, False
        if sharded:
            self._merge_sharded(pending)
        # only values, a device loss scale or sharded device rows add to a device's copy
        extras = _device_extras(pending, self.seam) if self._device_values or (sharded and self._devices) else {}
        self._device_values = False
        copies: dict[Any, HostCopy | None] = {}
        for dev, rows in self._devices.items():  # a loop, not a comprehension: one frame less
            # the Triton kernel may have been turned off since (``DeviceRows.path``, inlined)
            self.stats_paths[dev.type] = "device" if rows._triton is None else "device-triton"
            copies[dev] = rows.snapshot(extras.get(dev, ()))
        for dev, tensors in extras.items():
            if dev not in copies:
                copies[dev] = self._device_rows(dev).snapshot(tensors)
        host = self._host.take() if self._host.count else _NO_ROWS
        return StepRows(functools.partial(_build_blocks, pending, host, copies, step, self.ops))

    def has_pending(self) -> bool:
        return bool(self._pending)

    def discard_sharded(self) -> int:
        """Drop captured rows that would need a merge collective; returns how many were dropped."""
        keep = [p for p in self._pending if p.group is None]
        dropped = sum(len(p.items) for p in self._pending if p.group is not None)
        self._pending = keep
        return dropped

    def _merge_sharded(self, pending: list[_Pending]) -> None:
        """Host (CPU) rows of sharded captures: gathered and merged now (reading CPU memory is
        free).  Device rows: see ``_start_device_merges``."""
        host = [
            p for p in pending if p.group is not None and not p.is_values and len(p.rows) and isinstance(p.rows[0], int)
        ]
        for p in host:
            p.rows = list(self._host.rows(p.rows).unbind(0))
        _merge_host_sharded(host)


def _skipped(family: str, name: str, row: Any) -> bool:
    """True for a skipped row (after its one warning)."""
    if isinstance(row, Skipped):
        warn_skipped(name, family, row)
        return True
    return False


def _unreadable_value(family: str, meta: Meta, value: torch.Tensor) -> bool:
    """True for a computed value on a device the host cannot read (after its one warning)."""
    why = unreadable_device(value.device)
    if why is not None:
        warn_skipped(meta.name, family, Skipped(why))
    return why is not None


def _build_blocks(
    pending: list[_Pending],
    host: np.ndarray,
    copies: dict[Any, HostCopy | None],
    step: int,
    ops: tuple[str, ...],
) -> list[RowBlock]:
    """One block per run of consecutive captures that share a layout (an activation hook captures
    one or two tensors at a time: merged, a micro-batch's forward is one block, so numpy's fixed
    cost is paid a few times per step, not once per hook call).  Each run's partials are one
    float64 matrix, derived in one numpy pass."""
    values = _to_host(pending, host, copies)
    blocks = []
    counts = integer_columns(ops)
    for (family, micro, extra, columns, is_values), run in _runs(pending, values):
        first = run[0][0]
        items = first.items if len(run) == 1 else [item for p, _ in run for item in p.items]
        partials = run[0][1] if len(run) == 1 else np.concatenate([mat for _, mat in run])
        if is_values:
            stats, matrix, ints = columns, np.ascontiguousarray(partials, dtype=np.float64), first.integers
        else:
            stats, matrix, ints = ops, derive_matrix(ops, columns, partials), counts
        # a family's cached layout (not a hook-extended list): its lists, the same objects each step
        names, vpps, shapes, dts = _layout_lists(items, cached=len(run) == 1 and first.layout)
        blocks.append(
            RowBlock(
                family, step, micro, extra, tuple(stats), names, vpps, shapes, dts, matrix=matrix, integer_columns=ints
            )
        )
    return blocks


_NAME, _VPP, _SHAPE, _DTYPE = (operator.itemgetter(k) for k in range(4))


class _Interned(dict):
    """``key -> its text or plain tuple``, made once per distinct key: read with
    ``map(d.__getitem__, ...)`` (a C loop; a Python frame only for a key not seen yet).  Bounded
    (cleared when full)."""

    def __init__(self, make: Any):
        super().__init__()
        self.make = make

    def __missing__(self, key: Any) -> Any:
        if len(self) >= 4096:
            self.clear()
        value = self[key] = self.make(key)
        return value


_DTYPE_TEXT = _Interned(str)  # torch.float32 -> "torch.float32"
_SHAPE_TUPLE = _Interned(tuple)  # torch.Size([4, 4]) -> (4, 4), one tuple per distinct shape
# id(items) -> (items, its four lists): a family's layout list is reused step after step (kept
# alive here, so its id is not reused while it is cached)
_LAYOUTS: dict[int, tuple[list, tuple[list, list, list, list]]] = {}


def _layout_lists(items: list[_Item], cached: bool) -> tuple[list, list, list, list]:
    """The names, vpp stages, shapes and dtypes of ``items`` as lists, built with C loops (no
    Python frame or object per row); for a family's cached ``items`` list, the same lists every
    step (which also lets the CSV sink's template check compare them by identity)."""
    if cached:
        found = _LAYOUTS.get(id(items))
        if found is not None and found[0] is items:
            return found[1]
    try:
        shapes = list(map(_SHAPE_TUPLE.__getitem__, map(_SHAPE, items)))
    except TypeError:  # a shape given as a list (unhashable)
        shapes = [tuple(shape) for shape in map(_SHAPE, items)]
    lists = (
        list(map(_NAME, items)),
        list(map(_VPP, items)),
        shapes,
        list(map(_DTYPE_TEXT.__getitem__, map(_DTYPE, items))),
    )
    if cached:
        if len(_LAYOUTS) >= 256:
            _LAYOUTS.clear()
        _LAYOUTS[id(items)] = (items, lists)
    return lists


def _runs(pending: list[_Pending], values: list[np.ndarray]):
    """(layout, [(pending, values), ...]) for each run of consecutive captures with one layout.
    Paced by rows (a pending entry may hold one row or hundreds: hook rows join one entry)."""
    key = None
    run: list = []
    for p, mat in paced_rows(zip(pending, values), len_of=lambda pm: len(pm[1])):
        k = (p.family, p.micro_step, p.extra, p.columns, p.is_values)
        if run and k != key:
            yield key, run
            run = []
        key = k
        run.append((p, mat))
    if run:
        yield key, run


def _to_host(pending: list[_Pending], host: np.ndarray, copies: dict[Any, HostCopy | None]) -> list[np.ndarray]:
    """Each pending's rows as a float64 ``[rows, columns]`` matrix: host rows by index, device
    rows from their device's copy (waiting for it here), value tensors and gathered shards from
    the extras of that copy."""
    decoded: dict[Any, np.ndarray] = {}
    extras: dict[Any, list[torch.Tensor]] = {}
    out = []
    for p in pending:
        out.append(_values_of(p, host, copies, decoded, extras))
        if p.scale is not None:
            if isinstance(p.scale, tuple):
                device, k = p.scale
                if device not in extras:
                    extras[device] = copies[device].extra()  # type: ignore[union-attr]
                p.scale = float(extras[device][k][0])
            out[-1] = np.asarray(unscale(out[-1].tolist(), p.columns, p.scale), dtype=np.float64).reshape(out[-1].shape)
    return out


def _decoded(owner: Any, columns: Sequence[str], copies: dict[Any, HostCopy | None], decoded: dict) -> np.ndarray:
    """Every row of ``owner`` (a ``DeviceRows``) this step, decoded once per step."""
    mat = decoded.get(owner)
    if mat is None:
        mat = decoded[owner] = copies[owner.device].rows(columns)  # type: ignore[union-attr]
    return mat


def _values_of(
    p: _Pending,
    host: np.ndarray,
    copies: dict[Any, HostCopy | None],
    decoded: dict[Any, np.ndarray],
    extras: dict[Any, list[torch.Tensor]],
) -> np.ndarray:
    """One pending's rows as a float64 matrix (see ``_to_host``)."""
    width = len(p.columns)
    if p.slot is not None:
        device, k = p.slot
        if device not in extras:
            extras[device] = copies[device].extra()  # type: ignore[union-attr]
        ex = extras[device]
        if p.group is not None:
            return np.asarray(_merged_rows(ex[k], ex[k + 1], p.columns), dtype=np.float64).reshape(-1, width)
        return ex[k].double().numpy().reshape(-1, width)
    if p.block:
        return p.rows[0].detach().double().cpu().numpy().reshape(-1, width)
    rows = p.rows
    if p.owner is not None:  # a block of one device's rows
        mat = _decoded(p.owner, p.columns, copies, decoded)
        return mat[rows.start : rows.stop] if isinstance(rows, range) else mat[rows]
    if isinstance(rows, range):
        return host[rows.start : rows.stop]
    if rows and all([type(r) is int for r in rows]):
        return host[rows]
    row_values = []
    for r in rows:
        if isinstance(r, (int, np.integer)):
            row_values.append(host[r])
        elif isinstance(r, tuple):
            owner, i = r
            row_values.append(_decoded(owner, p.columns, copies, decoded)[i])
        else:
            row_values.append(r.double().cpu().numpy().reshape(-1))
    return np.asarray(row_values, dtype=np.float64).reshape(-1, width)


def _device_extras(pending: list[_Pending], seam: bool) -> dict[torch.device, list[torch.Tensor]]:
    """What each device adds to its step copy: value rows (stacked per capture) and, per process
    group of sharded device rows, the gathered raw partials (fp32 values and int64 counts).  The
    gather is a device collective; nothing is read on the host here."""
    extras: dict[torch.device, list[torch.Tensor]] = {}
    groups: dict[int, list[_Pending]] = {}
    for p in pending:
        if isinstance(p.scale, torch.Tensor):  # a device loss scale: read with the step's copy
            slots = extras.setdefault(p.scale.device, [])
            p.scale, slot = (p.scale.device, len(slots)), p.scale.float().reshape(1)
            slots.append(slot)
        if not len(p.rows):  # a list, a range or (a block's) an array of row numbers
            continue
        if p.is_values and (seam or not p.rows[0].is_cpu):
            device = p.rows[0].device
            slots = extras.setdefault(device, [])
            p.slot = (device, len(slots))
            slots.append(p.rows[0] if p.block else torch.stack([r.to(device) for r in p.rows]))
        elif p.group is not None and not p.is_values and isinstance(p.rows[0], tuple):
            groups.setdefault(id(p.group), []).append(p)
    for members in groups.values():
        from trainmon.core import dist as _dist

        rows = [r for p in members for r in p.rows]
        owner = rows[0][0]
        values, counts = owner.gather_payload([i for _, i in rows])
        gathered = (_dist.all_gather_rows(values, members[0].group), _dist.all_gather_rows(counts, members[0].group))
        slots = extras.setdefault(owner.device, [])
        pos = 0
        for p in members:  # each member reads its own rows of the gathered payload
            n = len(p.rows)
            p.slot = (owner.device, len(slots))
            slots.extend(
                [
                    gathered[0][:, pos : pos + n],
                    torch.cat([gathered[1][:, :1], gathered[1][:, 1 + pos : 1 + pos + n]], 1),
                ]
            )
            pos += n
    return extras


def _merged_rows(values: torch.Tensor, counts: torch.Tensor, columns: Sequence[str]) -> list[list[float]]:
    """Full-tensor partials from every rank's raw shard rows, merged in float64 on the host."""
    from trainmon.stats.device_rows import gathered_partials

    n_ranks = counts[:, 0, 0].tolist()
    n = values.shape[1]
    if any(c != n_ranks[0] for c in n_ranks):
        raise RuntimeError(
            f"trainmon: ranks captured different numbers of sharded rows {n_ranks}; "
            "every rank must capture a (maybe empty) shard of every sharded tensor"
        )
    mats = (
        np.stack(
            [
                gathered_partials(columns, values[w].double().numpy(), counts[w, 1:].numpy())
                for w in range(values.shape[0])
            ]
        )
        if n
        else np.zeros((values.shape[0], 0, len(columns)))
    )
    return combine(mats, columns).tolist()


def _merge_host_sharded(pending: list[_Pending]) -> None:
    """Replace shard partials (CPU rows) by full-tensor partials, in place: one all_gather per group.

    Every rank of a group must have captured the same sharded rows in the same order (each
    rank holds a shard, maybe empty, of every such tensor); the row count travels with the
    data so a mismatch fails loudly instead of merging the wrong rows.
    """
    by_group: dict[int, list[_Pending]] = {}
    for p in pending:
        by_group.setdefault(id(p.group), []).append(p)
    for members in by_group.values():
        from trainmon.core import dist as _dist

        rows = [r for p in members for r in p.rows]
        local = torch.stack(rows)
        count = torch.full((1, local.shape[1]), float(len(rows)), dtype=local.dtype)
        gathered = _dist.all_gather_rows(torch.cat([count, local]), members[0].group)
        counts = gathered[:, 0, 0].tolist()
        if any(c != len(rows) for c in counts):
            raise RuntimeError(
                f"trainmon: ranks captured different numbers of sharded rows {counts}; "
                "every rank must capture a (maybe empty) shard of every sharded tensor"
            )
        merged = merge_rows(gathered[:, 1:], members[0].columns)
        pos = 0
        for p in members:
            p.rows = list(merged[pos : pos + len(p.rows)].unbind(0))
            pos += len(p.rows)


def merge_rows(g: torch.Tensor, columns: Sequence[str]) -> torch.Tensor:
    """Exact merge of ``[world, rows, columns]`` partials over the first dimension (float64, on
    the host: ``stats.table.combine``)."""
    return torch.from_numpy(combine(g.detach().cpu().double().numpy(), columns))
