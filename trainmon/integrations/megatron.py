"""Megatron-core: grads live in ``param.main_grad`` views of DDP's flat grad buffers.

Where each family is read (see docs/megatron.md):

* ``grad_unreduced``: each bucket group's ``start_grad_sync`` is wrapped on the instance (dense
  and expert groups); right before it scales and reduces the bucket, the bucket's params'
  ``main_grad`` is this rank's accumulated local grad.  ``param.grad`` is never read: with
  gradient-accumulation fusion it is an uninitialised dummy.
* ``grad_reduced``: ``main_grad`` at optimizer-step entry (``finalize_model_grads`` has run).
  With the distributed optimizer only the range this rank owns was reduced; the rest of the
  buffer is stale local data, so only the owned range is measured and the shards are merged
  over the optimizer's data-parallel group.
* fp16: ``main_grad`` carries the loss scale; ``grad_unreduced`` is reported divided by
  ``optimizer.get_loss_scale()`` so it is on the scale of the loss.  The grads are not divided
  (that made a full-size copy of every grad): their partials are (sum/s, sumsq/s^2, min/s, max/s),
  the scale travelling as a device tensor with the step's one copy.
* With a Megatron optimizer, ``grad_reduced`` is read where the update uses it: Megatron's
  ``step()`` copies the grads to the fp32 main params, unscales and clips them (``clip_grad``),
  then calls the inner torch optimizer; a step pre-hook on each inner optimizer measures the
  ``.grad`` of the main params / fp32 shards it is about to apply.  Without one (no optimizer
  given), ``main_grad`` at step entry.
* moments and (distributed optimizer) params: the fp32 tensors the inner torch optimizer
  updates, found through the Float16 / FP32 / Distributed / Chained optimizers' group maps.

Nothing here imports megatron: objects are recognised by Megatron's attribute names, so the
same code runs on the real classes and on API-faithful stand-ins.
"""

from __future__ import annotations

import logging
import re
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn

from trainmon.core.hooks import Handle
from trainmon.core.naming import TrackedParam, clean_name, unwrap_model
from trainmon.families import MOMENTS
from trainmon.integrations.base import Integration, View, register_integration

__all__ = ["MegatronIntegration", "megatron_ddp_modules", "leaf_optimizers", "global_layer_names"]

log = logging.getLogger(__name__)

_MOMENTS = tuple(str(f) for f in MOMENTS)


def megatron_ddp_modules(chunks: Sequence[nn.Module]) -> list[Any]:
    """Megatron DDP wrappers (objects with ``bucket_groups`` or grad ``buffers``) in the chunks."""
    found = []
    for chunk in chunks:
        m: Any = chunk
        while m is not None:
            if hasattr(m, "bucket_groups") or (hasattr(m, "buffers") and hasattr(m, "ddp_config")):
                found.append(m)
                break
            m = getattr(m, "module", None)
    return found


def leaf_optimizers(optimizer: Any) -> Iterator[Any]:
    """The Megatron optimizers inside a ``ChainedOptimizer`` (or the optimizer itself)."""
    if optimizer is None:
        return
    inner = getattr(optimizer, "chained_optimizers", None)
    if inner is not None:
        for o in inner:
            yield from leaf_optimizers(o)
    else:
        yield optimizer


def _is_megatron_optimizer(optimizer: Any) -> bool:
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return False
    return hasattr(optimizer, "chained_optimizers") or (
        hasattr(optimizer, "get_loss_scale") and hasattr(optimizer, "optimizer")
    )


def _bucket_groups(ddp: Any) -> list[Any]:
    """Objects whose ``start_grad_sync`` launches one reduce: bucket groups (core >= 0.9), else
    the buckets of each buffer (r0.6-0.8)."""
    groups = list(getattr(ddp, "bucket_groups", None) or []) + list(
        getattr(ddp, "expert_parallel_bucket_groups", None) or []
    )
    if groups or hasattr(ddp, "bucket_groups"):
        return groups
    buffers = list(getattr(ddp, "buffers", []) or []) + list(getattr(ddp, "expert_parallel_buffers", []) or [])
    return [b for buf in buffers for b in buf.buckets]


def _group_params(bucket_group: Any) -> list[Any]:
    buckets = getattr(bucket_group, "buckets", None) or [bucket_group]
    return [p for b in buckets for p in getattr(b, "params_list", None) or list(b.params)]


def _wrap_instance(obj: Any, name: str, make: Callable[[Callable], Callable]) -> Handle:
    """Replace ``obj.name`` on the instance only; the handle restores exactly what was there."""
    had_own = name in vars(obj)
    original = vars(obj).get(name)
    obj.__dict__[name] = types.MethodType(make(getattr(obj, name)), obj)

    def undo() -> None:
        if had_own:
            obj.__dict__[name] = original
        else:
            obj.__dict__.pop(name, None)

    return Handle(undo)


@register_integration
class MegatronIntegration(Integration):
    name = "megatron"
    priority = 20
    needs_all_ranks = True  # shards are merged over a process group: every rank takes part

    @classmethod
    def detect(cls, chunks: Sequence[nn.Module], optimizer: Any) -> bool:
        return (
            bool(megatron_ddp_modules(chunks))
            or _is_megatron_optimizer(optimizer)
            or any(type(unwrap_model(c)).__module__.startswith("megatron.") for c in chunks)
        )

    def __init__(self, chunks: Sequence[nn.Module], optimizer: Any, use_main_grad: bool):
        self.ddps = megatron_ddp_modules(chunks)
        # Megatron DDP's grads are main_grad whatever was detected; a bare Megatron model is torch
        super().__init__(chunks, optimizer, use_main_grad or bool(self.ddps))
        self._sharded: dict[int, tuple[Any, Any]] | None = None  # param id -> (dist opt, group)
        self._state: dict[int, tuple[Any, Any, Any]] | None = None  # id -> (torch opt, key, group)
        self._warned_no_opt = False

    # -- loss scale ----------------------------------------------------------------------------
    def _loss_scale(self) -> torch.Tensor | None:
        """The fp16 loss scale (a device tensor, no host sync), or None when grads are unscaled."""
        for o in leaf_optimizers(self.optimizer):
            if getattr(o, "grad_scaler", None) is not None:
                return o.get_loss_scale()
        return None

    def _view(self, g: torch.Tensor, group: Any = None, shape: tuple[int, ...] | None = None) -> View:
        """``g`` as recorded: with an fp16 loss scale, its partials are divided by the scale."""
        return View(g, group, shape, scale=self._loss_scale())

    # -- pre-reduce ----------------------------------------------------------------------------
    def pre_reduce_points(
        self, params: list[TrackedParam], emit: Callable[[list[TrackedParam]], None]
    ) -> list[Handle] | None:
        if not self.ddps:
            return super().pre_reduce_points(params, emit)
        by_id = {id(tp.param): tp for tp in params}
        handles: list[Handle] = []
        for ddp in self.ddps:
            for bg in _bucket_groups(ddp):
                mine = [by_id[id(p)] for p in _group_params(bg) if id(p) in by_id]
                if mine:
                    handles.extend(self._wrap_bucket_group(bg, mine, emit))
        return handles

    @staticmethod
    def _wrap_bucket_group(
        bg: Any, mine: list[TrackedParam], emit: Callable[[list[TrackedParam]], None]
    ) -> list[Handle]:
        state = {"emitted": False}

        def make_start(inner: Callable) -> Callable:
            def start_grad_sync(self, *args, **kwargs):
                # A handle already out means this bucket is being reduced: its data is no
                # longer local (Megatron makes such a second call a no-op in the first batch).
                if not state["emitted"] and getattr(self, "grad_reduce_handle", None) is None:
                    state["emitted"] = True
                    emit(mine)
                return inner(*args, **kwargs)

            return start_grad_sync

        def make_reset(inner: Callable) -> Callable:
            def reset(self, *args, **kwargs):
                state["emitted"] = False  # zero_grad_buffer: a new iteration starts
                return inner(*args, **kwargs)

            return reset

        handles = [_wrap_instance(bg, "start_grad_sync", make_start)]
        if hasattr(bg, "reset"):
            handles.append(_wrap_instance(bg, "reset", make_reset))
        return handles

    def local_grad(self, tp: TrackedParam) -> View | None:
        g = getattr(tp.param, "main_grad", None) if self.use_main_grad else tp.param.grad
        return None if g is None else self._view(g)

    # -- post-reduce -------------------------------------------------------------------------
    def _dist_map(self) -> dict[int, tuple[Any, Any]]:
        """Params handled by a distributed optimizer -> (that optimizer, its DP group)."""
        if self._sharded is None:
            self._sharded = {}
            for o in leaf_optimizers(self.optimizer):
                if hasattr(o, "_get_model_param_range_map") and getattr(o, "buffers", None):
                    group = getattr(o, "data_parallel_group", None)
                    for buf in o.buffers:
                        for p in buf.param_index_map:
                            self._sharded[id(p)] = (o, group)
        return self._sharded

    def _uses_dist_opt_without_optimizer(self) -> bool:
        return self.optimizer is None and any(
            getattr(getattr(d, "ddp_config", None), "use_distributed_optimizer", False) for d in self.ddps
        )

    def reduced_grad(self, tp: TrackedParam) -> View | None:
        g = getattr(tp.param, "main_grad", None) if self.use_main_grad else tp.param.grad
        if g is None:
            return None
        if self._uses_dist_opt_without_optimizer():
            if not self._warned_no_opt:
                self._warned_no_opt = True
                log.warning(
                    "trainmon: Megatron distributed optimizer but set_monitor got no optimizer: "
                    "owned grad ranges are unknown, grad_reduced is not recorded"
                )
            return None
        entry = self._dist_map().get(id(tp.param))
        if entry is None:
            return self._view(g)
        opt, group = entry
        if tp.param not in opt.model_param_gbuf_map:  # this rank owns none of it
            return self._view(g.new_empty(0), group, tuple(tp.param.shape))  # same capture on every rank
        rng = opt._get_model_param_range_map(tp.param)["param"]
        shard = g.view(-1)[rng.start : rng.end]
        return self._view(shard, group, tuple(tp.param.shape))

    def applied_grad_points(
        self, params: list[TrackedParam], emit: Callable[[list[tuple[TrackedParam, View]]], None]
    ) -> list[Handle] | None:
        if not _is_megatron_optimizer(self.optimizer):
            return None
        handles = []
        state = self._state_map()
        for inner in {
            id(o.optimizer): o.optimizer
            for o in leaf_optimizers(self.optimizer)
            if isinstance(getattr(o, "optimizer", None), torch.optim.Optimizer)
        }.values():
            mine = [tp for tp in params if state.get(id(tp.param), (None,))[0] is inner]
            if mine:
                hook = inner.register_step_pre_hook(lambda *_, mine=mine: emit(self._applied(mine)))
                handles.append(Handle(hook.remove))
        return handles or None

    def _applied(self, params: list[TrackedParam]) -> list[tuple[TrackedParam, View]]:
        """The grads the inner optimizer is about to apply: unscaled and clipped by Megatron."""
        out = []
        for tp in params:
            _, key, group = self._state_map()[id(tp.param)]
            grad = None if key is None else key.grad
            if group is not None:  # distributed optimizer: every rank emits every row
                shard = grad if grad is not None else tp.param.new_empty(0, dtype=torch.float32)
                out.append((tp, View(shard.detach().reshape(-1), group, tuple(tp.param.shape))))
            elif grad is not None:
                out.append((tp, View(grad.detach())))
        return out

    # -- optimizer state -----------------------------------------------------------------------
    def _state_map(self) -> dict[int, tuple[Any, Any, Any]]:
        if self._state is None:
            self._state = {}
            for o in leaf_optimizers(self.optimizer):
                self._state.update(_optimizer_state_map(o))
        return self._state

    def param(self, tp: TrackedParam) -> View:
        entry = self._state_map().get(id(tp.param))
        if entry is None or entry[2] is None:
            return View(tp.param.detach())
        # Distributed optimizer: the fp32 shard is current right after the step even when the
        # model copy is refreshed only by the next forward (overlap_param_gather).
        _, key, group = entry
        shard = key if key is not None else tp.param.new_empty(0, dtype=torch.float32)
        return View(shard.detach(), group, tuple(tp.param.shape))

    def moments(self, tp: TrackedParam) -> dict[str, View]:
        if not _is_megatron_optimizer(self.optimizer):
            return super().moments(tp)
        entry = self._state_map().get(id(tp.param))
        if entry is None:
            return {}
        inner, key, group = entry
        state = inner.state.get(key, {}) if (inner is not None and key is not None) else {}
        if group is None:
            return {k: View(state[k]) for k in _MOMENTS if isinstance(state.get(k), torch.Tensor)}
        # Sharded: every rank of the group must emit the same rows, owned or not.
        empty = tp.param.new_empty(0, dtype=torch.float32)
        return {
            k: View(state[k] if isinstance(state.get(k), torch.Tensor) else empty, group, tuple(tp.param.shape))
            for k in _MOMENTS
        }

    def has_moments(self) -> bool:
        if not _is_megatron_optimizer(self.optimizer):
            return super().has_moments()
        return any(getattr(o, "optimizer", None) is not None for o in leaf_optimizers(self.optimizer))

    # -- names ---------------------------------------------------------------------------------
    def display_params(self, params: list[TrackedParam], config: Any) -> list[TrackedParam]:
        if not getattr(config, "global_layer_names", False):
            return params
        renames = global_layer_names(self.chunks)
        return [TrackedParam(_rename(tp.name, renames.get(tp.vpp_stage, {})), tp.vpp_stage, tp.param) for tp in params]


def _optimizer_state_map(o: Any) -> dict[int, tuple[Any, Any, Any]]:
    """model param id -> (inner torch optimizer, the tensor its state is keyed by, shard group)."""
    inner = getattr(o, "optimizer", None)
    out: dict[int, tuple[Any, Any, Any]] = {}
    if hasattr(o, "shard_fp32_groups"):  # DistributedOptimizer: fp32 shards
        group = getattr(o, "data_parallel_group", None)
        for buf in getattr(o, "buffers", None) or []:
            for p in buf.param_index_map:  # not owned here: an empty shard in the merge
                out[id(p)] = (inner, None, group)
        pairs = [(o.model_float16_groups, o.shard_fp32_from_float16_groups), (o.model_fp32_groups, o.shard_fp32_groups)]
        for models, shards in pairs:
            for mg, sg in zip(models, shards):
                for p, s in zip(mg, sg):
                    out[id(p)] = (inner, s, group)
    elif hasattr(o, "fp32_from_float16_groups"):  # Float16Optimizer: full fp32 masters
        for mg, fg in zip(o.float16_groups, o.fp32_from_float16_groups):
            for p, main in zip(mg, fg):
                out[id(p)] = (inner, main, None)
        for group in o.fp32_from_fp32_groups:
            for p in group:
                out[id(p)] = (inner, p, None)
    elif inner is not None:  # FP32Optimizer: the model params themselves
        for g in inner.param_groups:
            for p in g["params"]:
                out[id(p)] = (inner, p, None)
    return out


_LAYER_INDEX = re.compile(r"^(?P<prefix>.*\blayers)\.(?P<index>\d+)$")


def global_layer_names(chunks: Sequence[nn.Module]) -> dict[int, dict[str, str]]:
    """Per chunk: local layer module name -> name with the global 0-based layer index.

    Megatron numbers every ``TransformerLayer`` with a global 1-based ``layer_number`` (pipeline
    and virtual-pipeline offsets included), while module names restart at ``layers.0`` on every
    stage and chunk.
    """
    out: dict[int, dict[str, str]] = {}
    for vpp, chunk in enumerate(chunks):
        renames = out.setdefault(vpp, {})
        for name, module in unwrap_model(chunk).named_modules():
            number = getattr(module, "layer_number", None)
            m = _LAYER_INDEX.match(clean_name(name))
            if m and isinstance(number, int) and not isinstance(number, bool):
                renames[name] = f"{m.group('prefix')}.{number - 1}"
    return out


def _rename(name: str, renames: dict[str, str]) -> str:
    for local, global_name in renames.items():
        if name.startswith(local + "."):
            return global_name + name[len(local) :]
    return name
