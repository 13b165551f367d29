"""The optimizer's settings at each collected step (``loss_alignment``): family ``hyperparams``.

One row per setting per param group, taken at optimizer step entry, so ``lr`` is the one this
step applies (the scheduler has already moved it for this step and moves it again after):

=========== ===== ======================================================================
name        group value
=========== ===== ======================================================================
lr, eps,    0, 1  every non-tensor setting of ``optimizer.param_groups[group]``: numbers
momentum,         as they are, booleans as 1/0, ``betas`` as ``betas[0]``, ``betas[1]``;
betas[0]...       a one-element tensor (a tensor ``lr``) as its value; ``None`` and text
                  settings are left out
clip_grad   -1    the grad-clip norm, where the optimizer knows it (Megatron's
                  ``config.clip_grad``, DeepSpeed's ``gradient_clipping()``)
loss_scale  -1    the loss scale, where it knows it (``get_loss_scale()``, ``cur_scale``,
                  ``loss_scale``)
=========== ===== ======================================================================

Columns: ``vpp_stage,name,step,group,value,shape,dtype`` (``dtype`` is the setting's Python
type: ``float``, ``int``, ``bool``, or the tensor's dtype).  No host sync: a tensor setting is
copied to the host with the step's other rows.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator
from typing import Any

import torch

from trainmon.collectors.base import Collector, register_collector
from trainmon.families import Family
from trainmon.stats.engine import Meta

__all__ = ["HyperparamsCollector", "group_settings", "optimizer_settings"]

_COLUMNS = ("value",)


def _flatten(key: str, value: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            yield key, value
    elif isinstance(value, (bool, numbers.Real)):
        yield key, value
    elif isinstance(value, (tuple, list)) and all(isinstance(v, (bool, numbers.Real)) for v in value):
        for i, v in enumerate(value):
            yield f"{key}[{i}]", v


def group_settings(group: dict) -> list[tuple[str, Any]]:
    """The recordable settings of one param group, in the group's key order."""
    return [kv for key, value in group.items() if key != "params" for kv in _flatten(str(key), value)]


def _call(obj: Any, name: str) -> Any:
    fn = getattr(obj, name, None)
    try:
        return fn() if callable(fn) else None
    except Exception:
        return None


def optimizer_settings(optimizer: Any) -> list[tuple[str, Any]]:
    """Grad-clip norm and loss scale where the framework keeps them (else nothing)."""
    out: list[tuple[str, Any]] = []
    config = getattr(optimizer, "config", None)
    clip = getattr(config, "clip_grad", None)
    if clip is None:
        clip = _call(optimizer, "gradient_clipping")
    if clip is None:
        clip = getattr(optimizer, "clip_grad", None)
    scale = _call(optimizer, "get_loss_scale")
    for attr in ("cur_scale", "loss_scale"):
        if scale is None:
            scale = getattr(optimizer, attr, None)
    for key, value in (("clip_grad", clip), ("loss_scale", scale)):
        out.extend(_flatten(key, value))
    return out


def _type_name(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return str(value.dtype)
    return "bool" if isinstance(value, bool) else "int" if isinstance(value, numbers.Integral) else "float"


def _value(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(1).double()
    return torch.tensor([float(value)], dtype=torch.float64)


@register_collector
class HyperparamsCollector(Collector):
    name = "hyperparams"
    priority = 20

    @staticmethod
    def enabled(config) -> bool:
        return config.loss_alignment

    def on_step_begin(self) -> None:
        optimizer = self.ctx.optimizer
        groups = getattr(optimizer, "param_groups", None) or []
        for g, group in enumerate(groups):
            self._capture(g, group_settings(group))
        self._capture(-1, optimizer_settings(optimizer))

    def _capture(self, group: int, settings: list[tuple[str, Any]]) -> None:
        if not settings:
            return
        extra = {"group": group}
        metas = [Meta(Family.HYPERPARAMS, key, 0, (), _type_name(v), extra=extra) for key, v in settings]
        self.ctx.engine.capture_values(Family.HYPERPARAMS, metas, [_value(v) for _, v in settings], _COLUMNS)
