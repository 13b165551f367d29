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

import functools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from trainmon.stats._fused_cpu import FUSED_DTYPES, fill_rows
from trainmon.stats.derive import derive_block
from trainmon.stats.device_rows import DeviceRows, HostCopy
from trainmon.stats.host_rows import HostRows
from trainmon.stats.odd_tensors import Skipped, reason_of, unreadable_device, warn_skipped
from trainmon.stats.partials import device_columns, fused_columns, write_cpu_rows
from trainmon.stats.rows import RowBlock, StepRows, paced_rows
from trainmon.stats.table import combine, partials_for, unscale

__all__ = ["StatsEngine", "Tracked", "Meta", "SEAM_ENV", "device_path_forced", "merge_rows"]

SEAM_ENV = "TRAINMON_DEVICE_PATH"
SKIPPED = Skipped(None)  # the row handle of a tensor seen while a CUDA graph was being captured
log = logging.getLogger(__name__)


def stream_capturing(device: torch.device) -> bool:
    """True while ``device``'s current stream is capturing a CUDA graph: a hook then must not
    launch work or copy (its kernels would only be recorded, and a copy can break the capture).
    A module attribute so tests can fake it."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


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


@dataclass(slots=True)
class _Pending:
    family: str
    items: list[_Item]
    rows: list[Any]  # host row index (CPU), (DeviceRows, index), or a value tensor
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
        if not self.seam and all([t.is_cpu for t in tensors]):  # a list: no frame per tensor
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
        if not isinstance(rows, range) and any([type(r) is Skipped for r in rows]):
            kept = [k for k, r in enumerate(rows) if not _skipped(family, items[k][0], r)]
            items, rows = [items[k] for k in kept], [rows[k] for k in kept]
            if not items:
                return
        self._pending.append(_Pending(family, items, rows, self.columns, micro_step))

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
        if not isinstance(rows, range) and any([type(r) is Skipped for r in rows]):
            kept = [k for k, r in enumerate(rows) if not _skipped(family, names[k], r)]
            if not kept:
                return
            names, tensors, rows = [names[k] for k in kept], [tensors[k] for k in kept], [rows[k] for k in kept]
        self._pending.append(
            _Pending(
                family,
                [(n, vpp_stage, t.shape if shape is None else shape, t.dtype) for n, t in zip(names, tensors)],
                list(rows),
                self.columns,
                micro_step,
                extendable=True,
            )
        )

    def capture_one(
        self, family: str, vpp_stage: int, name: str, t: torch.Tensor, row: Any, micro_step: int | None
    ) -> None:
        """``capture_tensors`` of one tensor.  Consecutive hook rows of one layout share one
        pending entry (``_build_blocks`` would merge them into one block anyway)."""
        if isinstance(row, Skipped):
            warn_skipped(name, family, row)
            return
        item = (name, vpp_stage, t.shape, t.dtype)
        pending = self._pending
        if pending:
            last = pending[-1]
            if last.extendable and last.family == family and last.micro_step == micro_step:
                last.items.append(item)
                last.rows.append(row)
                return
        pending.append(_Pending(family, [item], [row], self.columns, micro_step, extendable=True))

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
        self._pending.append(_Pending(family, items, [values.detach()], tuple(columns), is_values=True, block=True))

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
        self._host.clear()
        for rows in self._devices.values():
            rows.clear()

    def finish_step(self, step: int) -> StepRows:
        """All rows captured since the last call, in capture order.  CPU values are read here;
        device values start their one asynchronous copy here and are read (and sharded device
        rows merged) when the rows are first built, which for a threaded sink is on its writer
        thread."""
        pending, self._pending = self._pending, []
        for dev, rows in self._devices.items():  # the Triton kernel may have been turned off since
            self.stats_paths[dev.type] = rows.path
        self._merge_sharded(pending)
        extras = _device_extras(pending, self.seam)
        copies = {dev: rows.snapshot(extras.get(dev, ())) for dev, rows in self._devices.items()}
        for dev, tensors in extras.items():
            if dev not in copies:
                copies[dev] = self._device_rows(dev).snapshot(tensors)
        host = self._host.take()
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
        host = [p for p in pending if p.group is not None and not p.is_values and p.rows and isinstance(p.rows[0], int)]
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
    host: list[list[float]],
    copies: dict[Any, HostCopy | None],
    step: int,
    ops: tuple[str, ...],
) -> list[RowBlock]:
    """One block per run of consecutive captures that share a layout (an activation hook captures
    one or two tensors at a time: merged, a micro-batch's forward is one block, so numpy's fixed
    cost is paid a few times per step, not once per hook call)."""
    values = _to_host(pending, host, copies)
    blocks = []
    dtypes: dict[Any, str] = {}
    for (family, micro, extra, columns, is_values), run in _runs(pending, values):
        items = [item for p, _ in run for item in p.items]
        partials = [row for _, mat in run for row in mat]
        stats = columns if is_values else ops
        rows = partials if is_values else derive_block(ops, columns, partials)
        if is_values and run[0][0].integers:
            rows = [_as_ints(row, run[0][0].integers) for row in rows]
        names, vpps, shapes, dts = [], [], [], []
        for name, vpp, shape, dtype in items:
            dt = dtypes.get(dtype)
            if dt is None:
                dt = dtypes[dtype] = str(dtype)
            names.append(name)
            vpps.append(vpp)
            shapes.append(tuple(shape))
            dts.append(dt)
        blocks.append(RowBlock(family, step, micro, extra, tuple(stats), names, vpps, shapes, dts, rows))
    return blocks


def _as_ints(row: list[float], columns: tuple[int, ...]) -> list[Any]:
    out: list[Any] = list(row)
    for j in columns:
        out[j] = int(out[j]) if out[j] == out[j] else out[j]  # a NaN stays NaN
    return out


def _runs(pending: list[_Pending], values: list[list[list[float]]]):
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


def _to_host(
    pending: list[_Pending], host: list[list[float]], copies: dict[Any, HostCopy | None]
) -> list[list[list[float]]]:
    """Each pending's rows as floats: host rows by index, device rows from their device's copy
    (waiting for it here), value tensors and gathered shards from the extras of that copy."""
    decoded: dict[Any, list[list[float]]] = {}
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
            out[-1] = unscale(out[-1], p.columns, p.scale)
    return out


def _values_of(
    p: _Pending,
    host: list[list[float]],
    copies: dict[Any, HostCopy | None],
    decoded: dict[Any, list[list[float]]],
    extras: dict[Any, list[torch.Tensor]],
) -> list[list[float]]:
    """One pending's rows as floats (see ``_to_host``)."""
    if p.slot is not None:
        device, k = p.slot
        if device not in extras:
            extras[device] = copies[device].extra()  # type: ignore[union-attr]
        ex = extras[device]
        return _merged_rows(ex[k], ex[k + 1], p.columns) if p.group is not None else ex[k].double().tolist()
    if p.block:
        return p.rows[0].double().tolist()
    row_values = []
    for r in p.rows:
        if isinstance(r, int):
            row_values.append(host[r])
        elif isinstance(r, tuple):
            owner, i = r
            if owner not in decoded:
                decoded[owner] = copies[owner.device].rows(p.columns).tolist()  # type: ignore[union-attr]
            row_values.append(decoded[owner][i])
        else:
            row_values.append(r.double().tolist())
    return row_values


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
        if not p.rows:
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
