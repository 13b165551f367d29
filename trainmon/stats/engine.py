"""The stats engine: collectors hand it tensors, it hands sinks ``StatRow``s.

Within a step, ``capture`` turns tensors into partials rows right away (the tensors may change
later in the step: grads get reduced, params updated) and keeps only those small rows on the
device.  ``finish_step`` moves everything of the step to the host in one copy per device, merges
sharded rows over their process group, derives the requested stats and returns the rows.
It is the only place that reads device values on the host.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from trainmon.records import StatRow
from trainmon.stats.partials import compute_partials, device_columns
from trainmon.stats.table import derive, partials_for

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


@dataclass
class _Pending:
    metas: list[Meta]
    rows: list[torch.Tensor]               # partials rows, or value rows for capture_values
    columns: tuple[str, ...]
    is_values: bool = False
    group: Any = None                      # process group to merge over (sharded tensors)


class StatsEngine:
    """Batched statistics for one monitor. ``ops`` are names from ``stats.table.STATS``."""

    def __init__(self, ops: Sequence[str], eps: float = 1e-8):
        self.ops = tuple(ops)
        self.eps = eps
        self.columns = device_columns(partials_for(self.ops))
        self._pending: list[_Pending] = []

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

    def partials(self, tensors: Sequence[torch.Tensor], *, no_sync: bool = False) -> list[torch.Tensor]:
        """Partials rows of ``tensors`` as they are now (``no_sync``: never read the device on
        the host, for hooks that run inside the forward/backward on an accelerator)."""
        return compute_partials(tensors, self.columns, self.eps, no_sync=no_sync)

    def capture_rows(self, family: str, items: Sequence[Tracked], rows: Sequence[torch.Tensor], *,
                     micro_step: int | None = None, extra: dict[str, Any] | None = None,
                     group: Any = None) -> None:
        """Record rows from ``partials`` under the names of ``items`` (one row may serve several
        names: a tensor that is the output of one module and the input of the next)."""
        if not items:
            return
        metas = [Meta(family, it.name, it.vpp_stage,
                      it.shape if it.shape is not None else tuple(it.tensor.shape),
                      str(it.tensor.dtype), micro_step, dict(extra or {})) for it in items]
        self._pending.append(_Pending(metas, list(rows), self.columns, group=group))

    def capture_values(self, family: str, metas: Sequence[Meta], values: Sequence[torch.Tensor],
                       columns: Sequence[str]) -> None:
        """Record values already computed on the device (one ``[len(columns)]`` row per meta)."""
        if metas:
            self._pending.append(_Pending([Meta(family, *_meta_fields(m)) for m in metas],
                                          [v.double().reshape(-1) for v in values],
                                          tuple(columns), is_values=True))

    def discard(self) -> None:
        self._pending.clear()

    def finish_step(self, step: int) -> list[StatRow]:
        """All rows captured since the last call, in capture order."""
        pending, self._pending = self._pending, []
        _merge_sharded(pending)
        host = _to_host([p.rows for p in pending])
        out: list[StatRow] = []
        for p, mat in zip(pending, host):
            if p.is_values:
                out.extend(self._value_rows(p, mat, step))
            else:
                out.extend(self._stat_rows(p, mat, step))
        return out

    def has_pending(self) -> bool:
        return bool(self._pending)

    def discard_sharded(self) -> int:
        """Drop captured rows that would need a merge collective; returns how many were dropped."""
        keep = [p for p in self._pending if p.group is None]
        dropped = sum(len(p.metas) for p in self._pending if p.group is not None)
        self._pending = keep
        return dropped

    def _stat_rows(self, p: _Pending, mat: list[list[float]], step: int) -> list[StatRow]:
        rows = []
        for meta, values in zip(p.metas, mat):
            partials = dict(zip(p.columns, values))
            rows.append(_row(meta, step, derive(self.ops, partials)))
        return rows

    @staticmethod
    def _value_rows(p: _Pending, mat: list[list[float]], step: int) -> list[StatRow]:
        return [_row(meta, step, dict(zip(p.columns, values))) for meta, values in zip(p.metas, mat)]


def _meta_fields(m: Meta) -> tuple:
    return (m.name, m.vpp_stage, m.shape, m.dtype, m.micro_step, m.extra)


def _row(meta: Meta, step: int, stats: dict) -> StatRow:
    return StatRow(family=meta.family, name=meta.name, step=step, stats=stats, shape=meta.shape,
                   dtype=meta.dtype, vpp_stage=meta.vpp_stage, micro_step=meta.micro_step,
                   extra=meta.extra)


def _to_host(groups: list[list[torch.Tensor]]) -> list[list[list[float]]]:
    """One device-to-host copy per device for every row of the step."""
    flat = [(gi, r) for gi, rows in enumerate(groups) for r in rows]
    by_device: dict[torch.device, list[int]] = {}
    for k, (_, r) in enumerate(flat):
        by_device.setdefault(r.device, []).append(k)
    values: list[list[float] | None] = [None] * len(flat)
    for device, ks in by_device.items():
        widths = [flat[k][1].numel() for k in ks]
        host = torch.cat([flat[k][1] for k in ks]).cpu().tolist()
        pos = 0
        for k, w in zip(ks, widths):
            values[k] = host[pos:pos + w]
            pos += w
    out: list[list[list[float]]] = [[] for _ in groups]
    for (gi, _), v in zip(flat, values):
        out[gi].append(v)  # type: ignore[arg-type]
    return out


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
        from trainmon import _dist

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
