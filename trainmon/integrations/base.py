"""Integrations: where a training stack keeps grads, params and moments, and when it reduces.

Collectors never look at DDP, FSDP, Megatron or DeepSpeed objects themselves; they ask the
session's ``Integration``.  The base class is plain PyTorch (also right for torch DDP, whose
reducer runs after ``register_post_accumulate_grad_hook``).  A stack-specific subclass overrides
what differs and registers itself with ``@register_integration``; the first one whose ``detect``
accepts the model and optimizer is used.

A ``View`` is what to measure: a tensor, and when that tensor is only this rank's shard of a
larger one, the process group to merge the shards' partials over and the full shape.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn as nn

from trainmon.core.hooks import Handle
from trainmon.core.naming import TrackedParam

__all__ = ["View", "Integration", "register_integration", "select_integration"]

_GRAD_OF = operator.attrgetter("param.grad")  # map() of it: each TrackedParam's grad, no frame each


@dataclass(frozen=True)
class View:
    tensor: torch.Tensor
    group: Any = None  # merge partials over this group: tensor is a shard
    shape: tuple[int, ...] | None = None  # full logical shape when tensor is a shard
    scale: Any = None  # tensor = scale x the values to report (fp16 loss scale)


class Integration:
    """Plain PyTorch (and torch DDP).

    ``tp_group`` (set from ``set_monitor(..., tp_group=)``): params with the Megatron-style
    attributes ``tensor_model_parallel=True`` and ``partition_dim`` are shards split over it and
    are merged into full-tensor stats; all other params are replicated over it and are reported
    as they are (never merged, so never counted once per TP rank).
    """

    name: ClassVar[str] = "torch"
    # Detection order of the stack-specific integrations (lower first).
    priority: ClassVar[int] = 100
    # True when stats need every rank's shard (a merge over a process group): then ranks outside
    # ``module_ranks`` still compute, they only do not write.
    needs_all_ranks: ClassVar[bool] = False
    # True when the stack reduces every micro-batch (pre-reduce rows then carry micro_step)
    reduces_every_micro_batch: bool = False
    tp_group: Any = None

    def __init__(self, chunks: Sequence[nn.Module], optimizer: Any, use_main_grad: bool):
        self.chunks = chunks
        self.optimizer = optimizer
        self.use_main_grad = use_main_grad

    @classmethod
    def detect(cls, chunks: Sequence[nn.Module], optimizer: Any) -> bool:
        return True

    # -- pre-reduce ----------------------------------------------------------------------------
    def pre_reduce_points(self, params: list[TrackedParam], emit: Callable[..., None]) -> list[Handle] | None:
        """Install hooks that call ``emit(params)`` when those grads are this rank's local,
        accumulated, not yet reduced grads, or ``emit(params, micro_step)`` when the stack
        reduces every micro-batch (the rows then carry ``micro_step``).  ``None``: use the
        generic per-param post-accumulate-grad hooks (right for plain torch and torch DDP)."""
        if self.use_main_grad:
            return []  # main_grad belongs to a framework; its integration knows the reduce point
        return None

    def local_grad(self, tp: TrackedParam) -> View | None:
        g = getattr(tp.param, "main_grad", None) if self.use_main_grad else tp.param.grad
        return None if g is None else self.tp_view(tp, g)

    def tp_view(self, tp: TrackedParam, tensor: torch.Tensor) -> View:
        """``tensor`` (the param, its grad or a moment) as a View: merged over ``tp_group`` when
        the param is tensor-parallel sharded."""
        if self.tp_group is None or not getattr(tp.param, "tensor_model_parallel", False):
            return View(tensor)
        import torch.distributed as dist

        dim = int(getattr(tp.param, "partition_dim", 0))
        shape = list(tensor.shape)
        shape[dim] *= dist.get_world_size(self.tp_group)
        return View(tensor, self.tp_group, tuple(shape))

    def display_params(self, params: list[TrackedParam], config: Any) -> list[TrackedParam]:
        """The params as they are named in the output (stacks may map local to global names)."""
        return params

    # -- at and after the optimizer step -----------------------------------------------------
    def applied_grad_points(
        self, params: list[TrackedParam], emit: Callable[[list[tuple[TrackedParam, View]]], None]
    ) -> list[Handle] | None:
        """Stacks whose ``step()`` changes the grads before applying them (clipping, unscaling)
        install hooks that call ``emit([(param, View of the grad the update uses), ...])`` right
        before the inner optimizer applies them (every rank the same rows, shards merged).
        ``None``: the grad at optimizer step entry is the one applied (``reduced_grad``)."""
        return None

    def reduced_grad(self, tp: TrackedParam) -> View | None:
        return self.local_grad(tp)

    def param(self, tp: TrackedParam) -> View:
        return self.tp_view(tp, tp.param.detach())

    def moments(self, tp: TrackedParam) -> dict[str, View]:
        """``{"exp_avg": View, "exp_avg_sq": View}`` (a subset, or {} if the optimizer has none)."""
        from trainmon.collectors.optimizer_state import adapter_for

        adapter = self._adapter = getattr(self, "_adapter", None) or adapter_for(self.optimizer)
        if adapter is None:
            return {}
        return {k: self.tp_view(tp, t) for k, t in adapter.moments(tp.param).items()}

    # -- whole families at once -------------------------------------------------------------
    def plain_views(self) -> bool:
        """True when every View of this integration is the tensor itself (no shard to merge, no
        loss scale, no reshaping): collectors then read a whole family with one list
        comprehension (``grads_of``, ``params_of``) instead of one View per param, which is most
        of a monitored step's host cost on a model of many small tensors."""
        cls = type(self)
        return self.tp_group is None and all(getattr(cls, m) is getattr(Integration, m) for m in _VIEW_METHODS)

    def grads_of(self, params: Sequence[TrackedParam]) -> list[torch.Tensor | None]:
        """The tensors of ``local_grad``/``reduced_grad`` (equal here) of ``params``, when
        ``plain_views()``."""
        if self.use_main_grad:
            return [getattr(tp.param, "main_grad", None) for tp in params]
        return list(map(_GRAD_OF, params))  # a loop in C: no Python frame

    def grad_getter(self) -> Callable[[TrackedParam], torch.Tensor | None] | None:
        """A C callable giving one param's ``grads_of`` entry, for ``map`` (no Python frame per
        param, none for the call either), or None where ``grads_of`` must be called."""
        return None if self.use_main_grad or type(self).grads_of is not Integration.grads_of else _GRAD_OF

    def has_moments(self) -> bool:
        from trainmon.collectors.optimizer_state import adapter_for

        return adapter_for(self.optimizer) is not None


# What a subclass overrides when its Views are not the plain tensors (``plain_views``).
_VIEW_METHODS = ("local_grad", "reduced_grad", "param", "tp_view", "moments")

_REGISTRY: list[type[Integration]] = []


def register_integration(cls: type[Integration]) -> type[Integration]:
    """Stack-specific integrations are tried by ``priority`` (lower first), then the plain torch one."""
    if cls not in _REGISTRY:
        _REGISTRY.append(cls)
        _REGISTRY.sort(key=lambda c: (c.priority, c.name))
    return cls


def select_integration(chunks: Sequence[nn.Module], optimizer: Any, use_main_grad: bool) -> Integration:
    for cls in _REGISTRY:
        if cls.detect(chunks, optimizer):
            return cls(chunks, optimizer, use_main_grad)
    return Integration(chunks, optimizer, use_main_grad)
