"""FSDP2 (``torch.distributed.fsdp.fully_shard``).

Params, grads and Adam moments are ``DTensor`` s sharded on dim 0 over the FSDP mesh.  Every
rank measures its own local shard (``to_local()``, maybe empty) and the engine merges the
partials over the shard group, so ``grad_reduced``, ``param_*`` and ``exp_avg*`` rows are the
statistics of the full tensor (the squares of the ``grad_reduced`` norms sum to the square of
``clip_grad_norm_``'s total norm).  With HSDP (replicate x shard mesh) the merge runs over the
shard dimension only, so replicas are not counted twice.  With tensor parallelism as well (the
torchtitan layout: ``parallelize_module`` over a TP mesh dimension, ``fully_shard`` over the DP
one: 2-D DTensors), a tensor split over several mesh dimensions is merged over the group of all of
them (the flattened sub-mesh, built once per mesh and set of dimensions), and one replicated over
TP (a RowwiseParallel bias) over its DP dimension only.

Pre-reduce grads: FSDP2 runs a sharded param's post-accumulate-grad hooks *after* the
reduce-scatter, so the generic hooks would see reduced shards: they are not used.  The local,
unreduced grads exist only inside FSDP2, as the unsharded params' grads just before each param
group's ``post_backward`` reduce-scatters them.  Reading them needs private torch API, so it is
opt-in: ``TRAINMON_FSDP2_PRE_REDUCE=1``.  It wraps ``post_backward`` on each param-group
instance (checked to exist, else one warning and no ``grad_unreduced``) and records only when the
group is about to reduce (``set_requires_gradient_sync(False)`` micro-batches are skipped), so
with accumulation the row holds this rank's accumulated local grad.  Without the opt-in,
``grad_unreduced`` is not recorded under FSDP2.
"""

from __future__ import annotations

import logging
import os
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from trainmon.core.dtensor import dtensor_parts
from trainmon.core.hooks import Handle
from trainmon.core.naming import TrackedParam
from trainmon.integrations.base import Integration, View, register_integration

__all__ = ["FSDP2Integration", "PRE_REDUCE_ENV", "dtensor_view", "sharded_view"]

log = logging.getLogger(__name__)

PRE_REDUCE_ENV = "TRAINMON_FSDP2_PRE_REDUCE"


def _fsdp_module_class() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6
        return None
    return FSDPModule


def sharded_view(t: torch.Tensor) -> View:
    """A View of a (maybe) DTensor: its local shard, merged over its shard group."""
    local, group, shape = dtensor_parts(t)
    return View(local, group, shape) if group is not None else View(local)


def dtensor_view(t: torch.Tensor) -> View:
    """``sharded_view`` of an activation DTensor (``core.dtensor.dtensor_parts(reduce_partial=True)``)."""
    local, group, shape = dtensor_parts(t, reduce_partial=True)
    return View(local, group, shape) if group is not None else View(local)


@register_integration
class FSDP2Integration(Integration):
    name = "fsdp2"
    priority = 30
    needs_all_ranks = True  # shards are merged over a process group: every rank takes part

    def __init__(self, chunks: Sequence[nn.Module], optimizer: Any, use_main_grad: bool):
        super().__init__(chunks, optimizer, use_main_grad)
        self._unreduced: dict[int, torch.Tensor] = {}

    @classmethod
    def detect(cls, chunks: Sequence[nn.Module], optimizer: Any) -> bool:
        fsdp = _fsdp_module_class()
        return fsdp is not None and any(isinstance(m, fsdp) for c in chunks for m in c.modules())

    # -- pre-reduce (opt-in, private API) ----------------------------------------------------
    def pre_reduce_points(
        self, params: list[TrackedParam], emit: Callable[[list[TrackedParam]], None]
    ) -> list[Handle] | None:
        if os.environ.get(PRE_REDUCE_ENV, "") not in ("1", "true", "True"):
            return []  # the collector warns once that grad_unreduced is not recorded
        by_param = {id(tp.param): tp for tp in params}
        handles = []
        for group in self._param_groups():
            handles.append(self._wrap_post_backward(group, by_param, emit))
        if not handles:
            log.warning(
                "trainmon: %s=1 but this torch has no FSDP2 param groups where trainmon "
                "looks for them (torch %s); grad_unreduced is not recorded",
                PRE_REDUCE_ENV,
                torch.__version__,
            )
        return handles

    def _param_groups(self) -> list[Any]:
        fsdp = _fsdp_module_class()
        assert fsdp is not None  # detect() found FSDPModule instances
        groups = []
        for chunk in self.chunks:
            for m in chunk.modules():
                if not isinstance(m, fsdp):
                    continue
                state = getattr(m, "_get_fsdp_state", lambda: None)()
                group = getattr(state, "_fsdp_param_group", None)
                if group is not None and hasattr(group, "post_backward") and hasattr(group, "fsdp_params"):
                    groups.append(group)
        return groups

    def _wrap_post_backward(
        self, group: Any, by_param: dict[int, TrackedParam], emit: Callable[[list[TrackedParam]], None]
    ) -> Handle:
        inner = group.post_backward
        integration = self

        def post_backward(self_, *args, **kwargs):
            if getattr(self_, "reduce_grads", True):
                integration._before_reduce(self_, by_param, emit)
            return inner(*args, **kwargs)

        group.post_backward = types.MethodType(post_backward, group)
        return Handle(lambda: vars(group).pop("post_backward", None))

    def _before_reduce(
        self, group: Any, by_param: dict[int, TrackedParam], emit: Callable[[list[TrackedParam]], None]
    ) -> None:
        ready = []
        for fp in group.fsdp_params:
            tp = by_param.get(id(getattr(fp, "sharded_param", None)))
            if tp is None or not hasattr(fp, "_unsharded_param"):
                continue
            acc = getattr(fp, "unsharded_accumulated_grad", None)
            grad = fp.unsharded_param.grad
            if acc is not None:
                # FSDP2 adds this micro-batch's grad into the accumulator first thing in
                # post_backward; measure the sum it is about to reduce.
                grad = acc if grad is None else acc + grad
            if grad is not None:
                self._unreduced[id(tp.param)] = grad.detach()
                ready.append(tp)
        if ready:
            emit(ready)
        self._unreduced.clear()

    def local_grad(self, tp: TrackedParam) -> View | None:
        g = self._unreduced.get(id(tp.param))
        # Under TP the unsharded (DP-gathered) grad is still a DTensor split over TP: merged over it.
        return None if g is None else sharded_view(g)

    # -- at and after the optimizer step -----------------------------------------------------
    def reduced_grad(self, tp: TrackedParam) -> View | None:
        g = tp.param.grad
        return None if g is None else sharded_view(g)

    def param(self, tp: TrackedParam) -> View:
        return sharded_view(tp.param)

    def moments(self, tp: TrackedParam) -> dict[str, View]:
        return {k: sharded_view(v.tensor) for k, v in super().moments(tp).items()}
