"""Adam moments after the optimizer step (``mv_distribution``).

Emits (one row per selected param that has state, per collected step):

=========== ============== ===============================================================
family      when           value
=========== ============== ===============================================================
exp_avg     after the step first moment the step just produced (step 0 has it)
exp_avg_sq  after the step second moment the step just produced
=========== ============== ===============================================================

Config: ``{"mv_distribution": true}``.  Moments are found through the session's integration, which
by default asks a ``MomentAdapter``: torch optimizers that keep ``exp_avg``/``exp_avg_sq`` in
``optimizer.state`` (Adam, AdamW, NAdam,
RAdam, ...) work as they are; framework wrappers register their own adapter with
``register_moment_adapter``.  An optimizer no adapter understands gets one warning, not a crash.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

import torch

from trainmon.collectors.base import Collector, capture_views, register_collector
from trainmon.families import MOMENTS

__all__ = [
    "OptimizerStateCollector",
    "MomentAdapter",
    "TorchStateAdapter",
    "register_moment_adapter",
    "MOMENT_FAMILIES",
]

log = logging.getLogger(__name__)

MOMENT_FAMILIES = tuple(str(f) for f in MOMENTS)


class MomentAdapter(Protocol):
    def moments(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{"exp_avg": t, "exp_avg_sq": t}`` for a model param (a subset, or {} if none yet)."""


class TorchStateAdapter:
    """``optimizer.state[param]`` of a ``torch.optim.Optimizer``."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def moments(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        state = self.optimizer.state.get(param, {})
        return {k: state[k] for k in MOMENT_FAMILIES if isinstance(state.get(k), torch.Tensor)}


# Factories tried in order; each returns an adapter or None if it does not know the optimizer.
_ADAPTER_FACTORIES: list[Callable[[Any], MomentAdapter | None]] = [
    lambda opt: TorchStateAdapter(opt) if isinstance(opt, torch.optim.Optimizer) else None,
]


def register_moment_adapter(factory: Callable[[Any], MomentAdapter | None], *, first: bool = True) -> None:
    """Teach trainmon where an optimizer type keeps its moments."""
    if first:
        _ADAPTER_FACTORIES.insert(0, factory)
    else:
        _ADAPTER_FACTORIES.append(factory)


def adapter_for(optimizer: Any) -> MomentAdapter | None:
    for factory in _ADAPTER_FACTORIES:
        adapter = factory(optimizer)
        if adapter is not None:
            return adapter
    return None


@register_collector
class OptimizerStateCollector(Collector):
    name = "optimizer_state"
    priority = 30
    runs_on_skipped_steps = False

    @staticmethod
    def enabled(config) -> bool:
        return config.mv_distribution

    def attach(self) -> None:
        self._warned = False
        if not self.ctx.integration.has_moments():
            self._warned = True
            log.warning(
                "trainmon: mv_distribution: no moment adapter for optimizer type %s "
                "(built in: torch optimizers with exp_avg/exp_avg_sq state); exp_avg* not "
                "recorded",
                type(self.ctx.optimizer).__name__,
            )

    def on_step_end(self) -> None:
        found: dict[str, list] = {k: [] for k in MOMENT_FAMILIES}
        for tp in self.ctx.params:
            for family, view in self.ctx.integration.moments(tp).items():
                # Reported under the param's shape (a moment without its own logical shape); the
                # common case, a moment shaped like its param, needs no new View.
                if not view.shape and not (view.shape is None and view.tensor.shape == tp.param.shape):
                    view = replace(view, shape=tuple(tp.param.shape))
                found[family].append((tp, view))
        for family, pairs in found.items():
            capture_views(self.ctx, family, pairs)
        if self.ctx.params and not any(found.values()) and not self._warned:  # no params: nothing to look for
            self._warned = True
            log.warning(
                "trainmon: mv_distribution: optimizer %s has no exp_avg/exp_avg_sq state "
                "after step %d (not an Adam-like optimizer?); nothing recorded",
                type(self.ctx.optimizer).__name__,
                self.ctx.clock.step,
            )
