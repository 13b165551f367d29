"""Optimizer state after the optimizer step (``mv_distribution``).

Emits (one row per selected param that has that state, per collected step), each the tensor the
step just produced (step 0 has it):

==================== ===================================== =====================================
family               ``optimizer.state[param]`` key        kept by (``torch.optim``)
==================== ===================================== =====================================
exp_avg              ``exp_avg``                           Adam, AdamW, Adamax, NAdam, RAdam,
                                                           SparseAdam
exp_avg_sq           ``exp_avg_sq``                        Adam, AdamW, NAdam, RAdam, SparseAdam
max_exp_avg_sq       ``max_exp_avg_sq``                    Adam, AdamW with ``amsgrad=True``
exp_inf              ``exp_inf``                           Adamax
momentum_buffer      ``momentum_buffer``                   SGD (momentum > 0), RMSprop
                                                           (momentum > 0), Muon
square_avg           ``square_avg``                        RMSprop, Adadelta
grad_avg             ``grad_avg``                          RMSprop with ``centered=True``
acc_delta            ``acc_delta``                         Adadelta
adagrad_sum          ``sum``                               Adagrad
rprop_prev           ``prev``                              Rprop
rprop_step_size      ``step_size``                         Rprop
asgd_ax              ``ax``                                ASGD
adafactor_variance   ``variance``                          Adafactor (params of < 2 dims)
==================== ===================================== =====================================

Config: ``{"mv_distribution": true}``.  State is found through the session's integration, which
by default asks a ``MomentAdapter``: torch optimizers keep it in ``optimizer.state`` and work as
they are; framework wrappers register their own adapter with ``register_moment_adapter``
(Megatron's and DeepSpeed's give ``exp_avg``/``exp_avg_sq``).  Not recorded: scalar state
(``step``, NAdam's ``mu_product``, ASGD's ``eta``/``mu``), Adafactor's factored ``row_var`` /
``col_var`` (a row and a column vector, not the param's shape) and the keys of optimizers outside
``torch.optim`` (one INFO line names the param-shaped ones).  An optimizer no adapter
understands gets one warning, not a crash.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

import torch

from trainmon.collectors.base import Collector, FamilyRows, capture_plain, capture_views, register_collector
from trainmon.families import FAMILIES, OPTIMIZER_STATE

__all__ = [
    "OptimizerStateCollector",
    "MomentAdapter",
    "TorchStateAdapter",
    "register_moment_adapter",
    "MOMENT_FAMILIES",
]

log = logging.getLogger(__name__)

# Every family an adapter may return, in training-flow order.
MOMENT_FAMILIES = tuple(str(f) for f in OPTIMIZER_STATE)
# torch.optim's per-param state key -> the family recording it.
_FAMILY_OF_KEY: dict[str, str] = {FAMILIES[f].state_key or str(f): str(f) for f in OPTIMIZER_STATE}


class MomentAdapter(Protocol):
    def moments(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{family: t}`` for a model param, families of ``MOMENT_FAMILIES`` (e.g. ``{"exp_avg": t,
        "exp_avg_sq": t}``; a subset, or {} if none yet)."""


class TorchStateAdapter:
    """``optimizer.state[param]`` of a ``torch.optim.Optimizer``."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def moments(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        state = self.optimizer.state.get(param, {})
        # the state's few keys, not every family: this runs once per param per collected step
        return {
            family: value
            for key, value in state.items()
            if (family := _FAMILY_OF_KEY.get(key)) is not None and isinstance(value, torch.Tensor)
        }

    def unrecorded_keys(self, param: torch.Tensor) -> list[str]:
        """Keys of ``param``'s state holding a tensor of its shape that no family records."""
        state = self.optimizer.state.get(param, {})
        return sorted(
            k
            for k, v in state.items()
            if k not in _FAMILY_OF_KEY and isinstance(v, torch.Tensor) and v.shape == param.shape and v.dim() > 0
        )


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
        self._listed = False
        self._rows: dict[str, FamilyRows] = {}
        adapter = adapter_for(self.ctx.optimizer)
        self._state_table = (
            _StateTable(adapter.optimizer)
            if isinstance(adapter, TorchStateAdapter) and self.ctx.integration.plain_views()
            else None
        )
        if not self.ctx.integration.has_moments():
            self._warned = True
            log.warning(
                "trainmon: mv_distribution: no moment adapter for optimizer type %s "
                "(built in: torch.optim optimizers' state); no optimizer state is recorded",
                type(self.ctx.optimizer).__name__,
            )

    def on_step_end(self) -> None:
        if self._state_table is not None:
            found_any = self._capture_from_state()
        else:
            found_any = self._capture_from_adapter()
        if self.ctx.params and not found_any and not self._warned:  # no params: nothing to look for
            self._warned = True
            log.warning(
                "trainmon: mv_distribution: optimizer %s has no exp_avg/exp_avg_sq state nor other "
                "recorded state (momentum_buffer, square_avg, adagrad_sum, ...) after step %d "
                "(e.g. SGD without momentum); nothing recorded",
                type(self.ctx.optimizer).__name__,
                self.ctx.clock.step,
            )
        if not self._listed:
            self._list_unrecorded()

    def _capture_from_state(self) -> bool:
        """torch.optim state under a plain integration: each family is one capture of
        ``[state[p][key] for p in params]`` (a step does no Python work per param)."""
        params = self.ctx.params
        table = self._state_table
        states, keys = table.states(params)  # type: ignore[union-attr]
        found = False
        for key, family in keys:
            tensors = [v if isinstance(v := s.get(key), torch.Tensor) else None for s in states]
            if not any([t is not None for t in tensors]):
                continue
            found = True
            rows = self._rows.get(family)
            if rows is None:
                rows = self._rows[family] = FamilyRows(self.ctx.engine, family)
            if not rows.capture(params, tensors):  # complex state: by modulus
                capture_plain(self.ctx, family, params, tensors)
        return found

    def _capture_from_adapter(self) -> bool:
        found: dict[str, list] = {k: [] for k in MOMENT_FAMILIES}
        for tp in self.ctx.params:
            for family, view in self.ctx.integration.moments(tp).items():
                # Reported under the param's shape (a moment without its own logical shape); the
                # common case, a moment shaped like its param, needs no new View.
                if not view.shape and not (view.shape is None and view.tensor.shape == tp.param.shape):
                    view = replace(view, shape=tuple(tp.param.shape))
                found.setdefault(family, []).append((tp, view))
        for family, pairs in found.items():
            if pairs:
                capture_views(self.ctx, family, pairs)
        return any(found.values())

    def _list_unrecorded(self) -> None:
        """One INFO line naming param-shaped state keys no family records (optimizers outside
        torch.optim), once the optimizer has state."""
        adapter = adapter_for(self.ctx.optimizer)
        if not isinstance(adapter, TorchStateAdapter):
            self._listed = True  # a framework adapter: its optimizer's state is its own business
            return
        tp = next((tp for tp in self.ctx.params if adapter.optimizer.state.get(tp.param)), None)
        if tp is None:
            return  # no state yet: look again after the next step
        self._listed = True
        keys = adapter.unrecorded_keys(tp.param)
        if keys:
            log.info(
                "trainmon: mv_distribution: optimizer %s keeps per-param state %s that no trainmon "
                "family records (docs/output_files.md lists them); not recorded",
                type(self.ctx.optimizer).__name__,
                ", ".join(repr(k) for k in keys),
            )


class _StateTable:
    """Each selected param's ``optimizer.state`` dict and the recorded keys they hold, looked up
    once (a lookup hashes the param in Python) and again only when the state changes size or is
    replaced (``load_state_dict``) or params join."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self._key: tuple[Any, ...] | None = None
        self._state: Any = None  # held, so its id cannot be reused while it is the key
        self._states: list[dict] = []
        self._keys: list[tuple[str, str]] = []

    def states(self, params: list) -> tuple[list[dict], list[tuple[str, str]]]:
        state = self.optimizer.state
        key = (id(state), len(state), id(params), len(params))
        if key != self._key:
            self._state, self._key = state, key
            self._states = [state.get(tp.param) or {} for tp in params]
            present = {k for s in self._states for k in s}
            self._keys = [(k, f) for k, f in _FAMILY_OF_KEY.items() if k in present]
            self._keys.sort(key=lambda kf: MOMENT_FAMILIES.index(kf[1]))
        return self._states, self._keys
