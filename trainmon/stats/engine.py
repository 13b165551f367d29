"""The stats engine: collectors hand it tensors, it hands sinks the step's rows.

Within a step, ``capture`` turns tensors into partials rows right away (the tensors may change
later in the step: grads get reduced, params updated) and keeps only those small rows: on the
device for accelerator tensors, in one reused host buffer (``HostRows``) for CPU tensors.
``finish_step`` moves everything of the step to the host in one copy per device and merges
sharded rows over their process group; it is the only place that reads device values on the
host.  It returns ``StepRows``: the statistics are derived from the partials (a block at a time,
``stats.derive``) when a sink first reads them, which for the threaded sink is on its writer
thread.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from trainmon.stats.rows import StepRows, RowBlock, paced
from trainmon.stats.host_rows import HostRows
from trainmon.stats.partials import compute_partials, device_columns, fused_columns, write_cpu_rows
from trainmon.stats.derive import derive_block
from trainmon.stats.table import partials_for

__all__ = ["StatsEngine", "Tracked", "Meta"]


@dataclass(frozen=True, slots=True)
class Tracked:
    """A named tensor to record: what collectors pass to ``capture``."""

    name: str
    tensor: torch.Tensor
    vpp_stage: int = 0
    shape: tuple[int, ...] | None = None   # logical (full) shape when ``tensor`` is a shard


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
    rows: list[Any]                        # host row index (CPU) or partials row tensor (device)
    columns: tuple[str, ...]
    micro_step: int | None = None
    extra: dict[str, Any] | None = None
    is_values: bool = False
    group: Any = None                      # process group to merge over (sharded tensors)


class StatsEngine:
    """Batched statistics for one monitor. ``ops`` are names from ``stats.table.STATS``."""

    def __init__(self, ops: Sequence[str], eps: float = 1e-8):
        self.ops = tuple(ops)
        self.eps = eps
        self.columns = device_columns(partials_for(self.ops))
        self._pending: list[_Pending] = []
        self._host = HostRows(len(self.columns))
        self._fused_cols: tuple[int, ...] | None | bool = False

    def capture(self, family: str, items: Sequence[Tracked], *, micro_step: int | None = None,
                extra: dict[str, Any] | None = None, group: Any = None) -> None:
        """Record the stats of ``items`` as they are now.  No host sync.

        ``group``: the tensors are shards of larger tensors split over this process group; the
        rows are merged over it in ``finish_step`` so every rank reports full-tensor stats.
        """
        if not items:
            return
        rows = self.partials([it.tensor for it in items])
        self.capture_rows(family, items, rows, micro_step=micro_step, extra=extra, group=group)

    def partials(self, tensors: Sequence[torch.Tensor], *, no_sync: bool = False) -> list[Any]:
        """Partials rows of ``tensors`` as they are now, as opaque row handles for
        ``capture_rows`` (``no_sync``: never read the device on the host, for hooks that run
        inside the forward/backward on an accelerator)."""
        if all(t.is_cpu for t in tensors):
            return list(write_cpu_rows(tensors, self.columns, self.eps, self._host, self._fused()))
        rows: list[Any] = [None] * len(tensors)
        cpu = [i for i, t in enumerate(tensors) if t.is_cpu]
        device = [i for i, t in enumerate(tensors) if not t.is_cpu]
        for i, r in zip(device, compute_partials([tensors[i] for i in device], self.columns, self.eps,
                                                 no_sync=no_sync)):
            rows[i] = r
        if cpu:
            for i, r in zip(cpu, write_cpu_rows([tensors[i] for i in cpu], self.columns, self.eps,
                                                self._host, self._fused())):
                rows[i] = r
        return rows

    def _fused(self) -> tuple[int, ...] | None:
        # Decided at the first CPU capture (that is when the kernel is built, if ever).
        if self._fused_cols is False:
            self._fused_cols = fused_columns(self.columns)
        return self._fused_cols  # type: ignore[return-value]

    def capture_rows(self, family: str, items: Sequence[Tracked], rows: Sequence[Any], *,
                     micro_step: int | None = None, extra: dict[str, Any] | None = None,
                     group: Any = None) -> None:
        """Record rows from ``partials`` under the names of ``items`` (one row may serve several
        names: a tensor that is the output of one module and the input of the next)."""
        if items:
            self._pending.append(_Pending(family, [
                (it.name, it.vpp_stage, it.shape if it.shape is not None else it.tensor.shape,
                 it.tensor.dtype) for it in items], list(rows), self.columns, micro_step,
                dict(extra) if extra else None, group=group))

    def capture_tensors(self, family: str, vpp_stage: int, names: Sequence[str],
                        tensors: Sequence[torch.Tensor], rows: Sequence[Any], *,
                        micro_step: int | None = None, shape: tuple[int, ...] | None = None) -> None:
        """``capture_rows`` without ``Tracked`` objects, for hooks (activations)."""
        self._pending.append(_Pending(family, [
            (n, vpp_stage, t.shape if shape is None else shape, t.dtype) for n, t in zip(names, tensors)],
            list(rows), self.columns, micro_step))

    def capture_values(self, family: str, metas: Sequence[Meta], values: Sequence[torch.Tensor],
                       columns: Sequence[str]) -> None:
        """Record values already computed on the device (one ``[len(columns)]`` row per meta;
        the rows share the first meta's ``micro_step`` and ``extra``)."""
        if metas:
            self._pending.append(_Pending(family, [(m.name, m.vpp_stage, m.shape, m.dtype) for m in metas],
                                          [v.double().reshape(-1) for v in values], tuple(columns),
                                          metas[0].micro_step, metas[0].extra or None, is_values=True))

    def discard(self) -> None:
        self._pending.clear()
        self._host.clear()

    def finish_step(self, step: int) -> StepRows:
        """All rows captured since the last call, in capture order.  The device values reach
        the host here; the rows themselves (stats derived from partials) are built when first
        read, which for a threaded sink is on its writer thread."""
        pending, self._pending = self._pending, []
        self._merge_sharded(pending)
        values = _to_host(pending, self._host.take())
        return StepRows(functools.partial(_build_blocks, pending, values, step, self.ops))

    def has_pending(self) -> bool:
        return bool(self._pending)

    def discard_sharded(self) -> int:
        """Drop captured rows that would need a merge collective; returns how many were dropped."""
        keep = [p for p in self._pending if p.group is None]
        dropped = sum(len(p.items) for p in self._pending if p.group is not None)
        self._pending = keep
        return dropped

    def _merge_sharded(self, pending: list[_Pending]) -> None:
        for p in pending:
            if p.group is not None and not p.is_values and p.rows and isinstance(p.rows[0], int):
                p.rows = list(self._host.rows(p.rows).unbind(0))
        _merge_sharded(pending)


def _build_blocks(pending: list[_Pending], values: list[list[list[float]]], step: int,
                  ops: tuple[str, ...]) -> list[RowBlock]:
    """One block per run of consecutive captures that share a layout (an activation hook captures
    one or two tensors at a time: merged, a micro-batch's forward is one block, so numpy's fixed
    cost is paid a few times per step, not once per hook call)."""
    blocks = []
    dtypes: dict[Any, str] = {}
    for (family, micro, extra, columns, is_values), run in _runs(pending, values):
        items = [item for p, _ in run for item in p.items]
        partials = [row for _, mat in run for row in mat]
        stats = columns if is_values else ops
        rows = partials if is_values else derive_block(ops, columns, partials)
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


def _runs(pending: list[_Pending], values: list[list[list[float]]]):
    """(layout, [(pending, values), ...]) for each run of consecutive captures with one layout."""
    key = None
    run: list = []
    for p, mat in paced(zip(pending, values), 16):
        k = (p.family, p.micro_step, p.extra, p.columns, p.is_values)
        if run and k != key:
            yield key, run
            run = []
        key = k
        run.append((p, mat))
    if run:
        yield key, run


def _to_host(pending: list[_Pending], host: list[list[float]]) -> list[list[list[float]]]:
    """Each pending's rows as floats: host rows by index, device rows in one copy per device."""
    device_rows = [r for p in pending for r in p.rows if not isinstance(r, int)]
    copied = iter(_device_to_host(device_rows)) if device_rows else iter(())
    return [[host[r] if isinstance(r, int) else next(copied) for r in p.rows] for p in pending]


def _device_to_host(rows: list[torch.Tensor]) -> list[list[float]]:
    """One device-to-host copy per device for every device row of the step."""
    by_device: dict[torch.device, list[int]] = {}
    for k, r in enumerate(rows):
        by_device.setdefault(r.device, []).append(k)
    values: list[list[float] | None] = [None] * len(rows)
    for ks in by_device.values():
        widths = [rows[k].numel() for k in ks]
        host = torch.cat([rows[k].reshape(-1) for k in ks]).cpu().tolist()
        pos = 0
        for k, w in zip(ks, widths):
            values[k] = host[pos:pos + w]
            pos += w
    return values  # type: ignore[return-value]


def _merge_sharded(pending: list[_Pending]) -> None:
    """Replace shard partials by full-tensor partials, in place: one all_gather per group.

    Every rank of a group must have captured the same sharded rows in the same order (each
    rank holds a shard, maybe empty, of every such tensor); the row count travels with the
    data so a mismatch fails loudly instead of merging the wrong rows.
    """
    by_group: dict[int, list[_Pending]] = {}
    for p in pending:
        if p.group is not None and not p.is_values and p.rows:
            by_group.setdefault(id(p.group), []).append(p)
    for members in by_group.values():
        from trainmon.core import dist as _dist

        rows = [r for p in members for r in p.rows]
        device = rows[0].device
        local = torch.stack([r.to(device) for r in rows])
        count = torch.full((1, local.shape[1]), float(len(rows)), dtype=local.dtype, device=device)
        gathered = _dist.all_gather_rows(torch.cat([count, local]), members[0].group)
        counts = gathered[:, 0, 0].tolist()
        if any(c != len(rows) for c in counts):
            raise RuntimeError(f"trainmon: ranks captured different numbers of sharded rows {counts}; "
                               "every rank must capture a (maybe empty) shard of every sharded tensor")
        merged = merge_rows(gathered[:, 1:], members[0].columns).to(device)
        pos = 0
        for p in members:
            p.rows = list(merged[pos:pos + len(p.rows)].unbind(0))
            pos += len(p.rows)


def merge_rows(g: torch.Tensor, columns: Sequence[str]) -> torch.Tensor:
    """Exact merge of ``[world, rows, columns]`` partials over the first dimension."""
    col = {c: j for j, c in enumerate(columns)}
    out = g.sum(0)
    if "min" in col:
        out[:, col["min"]] = g[:, :, col["min"]].amin(0)   # amin/amax propagate NaN, like merge_partials
    if "max" in col:
        out[:, col["max"]] = g[:, :, col["max"]].amax(0)
    if "m2" in col:
        n, s = g[:, :, col["count"]], g[:, :, col["sum"]]
        mean = s.sum(0) / n.sum(0)
        live = n > 0
        shard_mean = torch.where(live, s / n.clamp_min(1), torch.zeros_like(s))
        spread = torch.where(live, n * (shard_mean - mean) ** 2, torch.zeros_like(s))
        out[:, col["m2"]] = g[:, :, col["m2"]].sum(0) + spread.sum(0)
    return out
