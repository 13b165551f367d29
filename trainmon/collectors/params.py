"""Parameters around the optimizer step (``param_distribution``, ``ur_distribution``).

Emits (one row per trainable, selected param, per collected step):

============== =================== ===============================================
family         when                value
============== =================== ===============================================
param_origin   optimizer step entry the parameter before the update
param_updated  after the step       the parameter after the update
update_ratio   after the step       ``||theta_after - theta_before|| / ||theta_before||``
                                    (column ``update_ratio``; inf when theta_before is 0)
============== =================== ===============================================

Config: ``{"param_distribution": true, "ur_distribution": true}``.  With ``step(closure)``, step
entry is still step entry (the params before the step), also when an optimizer moves them
before calling its closure (SAM); ``grad_reduced`` is read after the closure (``core.hooks``).

``update_ratio`` needs theta_before after the step, so it copies the selected params into one
preallocated buffer per (device, dtype) at step entry on collected steps: it is the one family
whose memory cost is a copy of what it monitors (narrow it with ``targets``).
"""

from __future__ import annotations

import operator
from collections import defaultdict

import torch

from trainmon.collectors.base import Collector, FamilyRows, capture_views, register_collector
from trainmon.families import Family
from trainmon.stats.engine import Meta
from trainmon.stats.partials import update_norms

__all__ = ["ParamCollector"]

_param_of = operator.attrgetter("param")  # map() of it: no Python frame


@register_collector
class ParamCollector(Collector):
    name = "params"
    priority = 40
    runs_on_skipped_steps = False

    @staticmethod
    def enabled(config) -> bool:
        return config.param_distribution or config.ur_distribution

    def attach(self) -> None:
        self._snapshot = _Snapshot()
        self._plain = self.ctx.integration.plain_views()
        self._rows = {str(f): FamilyRows(self.ctx.engine, f) for f in (Family.PARAM_ORIGIN, Family.PARAM_UPDATED)}
        self._ratio_key: tuple[int, int] | None = None
        self._ratio_items: list[tuple] = []

    def _capture(self, family: str) -> None:
        params = self.ctx.params
        if self._plain and self._rows[family].capture(params, list(map(_param_of, params))):
            return
        view = self.ctx.integration.param
        capture_views(self.ctx, family, [(tp, view(tp)) for tp in params])

    def on_step_entry(self) -> None:
        # At entry, not after a closure: SAM-like optimizers move the params before calling it.
        if self.ctx.config.param_distribution:
            self._capture(Family.PARAM_ORIGIN)
        if self.ctx.config.ur_distribution:
            tensors = list(map(_param_of, self.ctx.params)) if self._plain else [v.tensor for v in self._views()]
            grad = torch.is_grad_enabled()  # ``torch.no_grad()`` as a decorator costs ~8 frames a call
            torch._C._set_grad_enabled(False)
            try:
                self._snapshot.take(tensors)
            finally:
                torch._C._set_grad_enabled(grad)

    def on_step_end(self) -> None:
        if self.ctx.config.param_distribution:
            self._capture(Family.PARAM_UPDATED)
        if self.ctx.config.ur_distribution:
            grad = torch.is_grad_enabled()
            torch._C._set_grad_enabled(False)
            try:
                self._capture_update_ratio()
            finally:
                torch._C._set_grad_enabled(grad)

    def _views(self) -> list:
        # Sharded params (FSDP2 DTensors, TP shards): the local shard; norms merged over the group.
        return [self.ctx.integration.param(tp) for tp in self.ctx.params]

    def _capture_update_ratio(self) -> None:  # autograd off: the caller (on_step_end)
        if self._plain and self._snapshot.batched:
            self._capture_update_ratio_block()
            return
        views = self._views()
        on_host = not self.ctx.engine.seam and all(v.tensor.is_cpu for v in views)
        before, delta = self._snapshot.norms_and_delta_norms([v.tensor for v in views], fp64=on_host)
        before, delta = _merge_norms(views, before, delta)
        ratios = [d / b for b, d in zip(before, delta)]  # IEEE: inf if theta_before is 0, nan if 0/0
        metas = [
            Meta(Family.UPDATE_RATIO, tp.name, tp.vpp_stage, v.shape or tuple(tp.param.shape), str(tp.param.dtype))
            for tp, v in zip(self.ctx.params, views)
        ]
        self.ctx.engine.capture_values(Family.UPDATE_RATIO, metas, ratios, ("update_ratio",))

    def _capture_update_ratio_block(self) -> None:
        """Plain params: the norms of a whole family in two multi-tensor calls, the ratios as one
        ``[params, 1]`` tensor under a layout kept while the params stay the same."""
        params = self.ctx.params
        tensors: list[torch.Tensor] = [tp.param for tp in params]
        on_host = not self.ctx.engine.seam and all([t.is_cpu for t in tensors])
        before, delta = self._snapshot.stacked_norms(tensors, fp64=on_host)
        ratios = (delta / before).reshape(-1, 1)  # IEEE: inf if theta_before is 0, nan if 0/0
        key = (id(params), len(params))
        if key != self._ratio_key:
            self._ratio_key = key
            self._ratio_items = [(tp.name, tp.vpp_stage, tuple(tp.param.shape), str(tp.param.dtype)) for tp in params]
        self.ctx.engine.capture_value_block(Family.UPDATE_RATIO, self._ratio_items, ratios, ("update_ratio",))


def _merge_norms(
    views: list, before: list[torch.Tensor], delta: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Full-tensor norms from shard norms: one SUM all-reduce of the squares per group."""
    by_group: dict[int, list[int]] = {}
    for i, v in enumerate(views):
        if v.group is not None:
            by_group.setdefault(id(v.group), []).append(i)
    if not by_group:
        return before, delta
    import torch.distributed as dist

    from trainmon.core import dist as _dist

    before, delta = list(before), list(delta)
    for idx in by_group.values():
        group = views[idx[0]].group
        squares = torch.stack([torch.stack([before[i], delta[i]]) for i in idx]).square()
        device = squares.device
        if dist.get_backend(group) == "gloo":
            squares = squares.cpu()
        with _dist.internal():
            dist.all_reduce(squares, group=group)
        norms = squares.to(device).sqrt()
        for k, i in enumerate(idx):
            before[i], delta[i] = norms[k, 0], norms[k, 1]
    return before, delta


class _Snapshot:
    """theta_before in buffers that are reused across steps (no allocation per step).

    The views into the buffers are kept while the params keep their sizes and dtypes, so a step
    copies every param in one ``_foreach_copy_`` and takes each side's norms in one
    ``_foreach_norm`` (``batched``: every param is fp32/bf16/fp16, accumulated in fp32, as the
    per-tensor reductions below do); other dtypes take one reduction per tensor."""

    _LOW = (torch.float16, torch.bfloat16, torch.float32)

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._views: list[torch.Tensor] = []
        self._layout: tuple[list[int], list[torch.dtype], torch.device | None] | None = None
        self.batched = False

    def take(self, params: list[torch.Tensor]) -> None:  # called with autograd off (on_step_entry)
        layout = ([p.numel() for p in params], [p.dtype for p in params], params[0].device if params else None)
        if layout != self._layout:
            self._layout = layout
            self._make_views(params)
            self.batched = all([d in self._LOW for d in layout[1]]) and not any([p.is_meta for p in params])
        if self._views:
            torch._foreach_copy_(self._views, params)

    def _make_views(self, params: list[torch.Tensor]) -> None:
        sizes: dict[tuple[torch.device, torch.dtype], int] = defaultdict(int)
        for p in params:
            sizes[(p.device, p.dtype)] += p.numel()
        for key, n in sizes.items():
            buf = self._buffers.get(key)
            if buf is None or buf.numel() != n:
                self._buffers[key] = torch.empty(n, device=key[0], dtype=key[1])
        offsets: dict[tuple[torch.device, torch.dtype], int] = defaultdict(int)
        self._views = []
        for p in params:
            key = (p.device, p.dtype)
            self._views.append(self._buffers[key][offsets[key] : offsets[key] + p.numel()].view_as(p))
            offsets[key] += p.numel()

    @torch.no_grad()
    def norms_and_delta_norms(
        self, params: list[torch.Tensor], fp64: bool = True
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """0-d norms of theta_before and of theta_before - theta_after.  ``fp64``: float64 results
        (CPU tensors: free there); otherwise float32 (accelerators: no fp64 on the device, MPS has
        none, Ascend emulates it), accumulated in fp32 inside the reduction for every dtype."""
        if self.batched and self._views:
            stacked = self.stacked_norms(params, fp64)
            return list(stacked[0].unbind(0)), list(stacked[1].unbind(0))
        if not fp64:
            return self._fp32_norms(params)
        acc = {torch.float16: torch.float32, torch.bfloat16: torch.float32}
        before = [torch.linalg.vector_norm(v, dtype=acc.get(v.dtype)).double() for v in self._views]
        delta = []
        for v, p in zip(self._views, params):
            v.sub_(p)  # the snapshot is not needed after this step: reuse it for the difference
            delta.append(torch.linalg.vector_norm(v, dtype=acc.get(v.dtype)).double())
        return before, delta

    def stacked_norms(self, params: list[torch.Tensor], fp64: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """``norms_and_delta_norms`` as two ``[params]`` tensors, when ``batched``.  Called with
        autograd off (``ParamCollector.on_step_end``, ``norms_and_delta_norms``).  On the host,
        the fused kernel reads each snapshot and param once, in float64 (torch's ops below read
        five times the bytes, and round a bf16 param's difference to bf16)."""
        norms = update_norms(self._views, params) if fp64 else None
        if norms is not None:
            return norms[:, 0], norms[:, 1]
        before = torch.stack(torch._foreach_norm(self._views, 2, dtype=torch.float32))
        torch._foreach_sub_(self._views, params)  # the snapshot is not needed after this step
        delta = torch.stack(torch._foreach_norm(self._views, 2, dtype=torch.float32))
        return (before.double(), delta.double()) if fp64 else (before, delta)

    def _fp32_norms(self, params: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The device path: one fp32 norm per tensor per side, nothing else per tensor (an fp64
        param is reduced in fp64, its own dtype, and its norms cast to fp32: 0-d)."""

        def norm(v: torch.Tensor) -> torch.Tensor:
            if v.dtype == torch.float64:
                return torch.linalg.vector_norm(v).float()
            return torch.linalg.vector_norm(v, dtype=torch.float32)

        before = [norm(v) for v in self._views]
        delta = []
        for v, p in zip(self._views, params):
            v.sub_(p)
            delta.append(norm(v))
        return before, delta
