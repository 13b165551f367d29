"""Params that join the monitored set after ``set_monitor`` (gradual unfreezing, late modules).

A session tracks the trainable (``requires_grad``) params of the model that ``targets`` select,
as they are when it is built.  A param unfrozen later, or the params of a module added to the
model and handed to ``optimizer.add_param_group``, join that set at the first forward of the
next collected step (or at its optimizer step entry when no forward of a monitored chunk ran
before it): the collectors hook them then (``Collector.on_params_joined``), so they have rows
from that step on, and one INFO line names them.  A param frozen again stays in the set (its
rows go on while it has a grad or state).

Cost: on steps that are not collected, one flag check per chunk forward.  On collected steps:
the length of the optimizer's ``param_groups`` and of each group's params (at the first forward
and at step entry), and once ``requires_grad`` of the params that were frozen when the set was
last derived: nothing in a run that freezes nothing, about 60 ns per frozen tensor otherwise
(0.1 ms for 1,800 frozen tensors).  The model is walked again only when one of those changed.  What it
cannot see: a module added to the model whose params reach no optimizer and flip no flag.
"""

from __future__ import annotations

import functools
import logging
import operator
from collections.abc import Callable
from typing import Any

import torch.nn as nn

from trainmon.collectors.base import CollectorContext
from trainmon.core.hooks import Handle, outside_compiled_graphs
from trainmon.core.naming import TrackedParam, frozen_params, selected_params

__all__ = ["ParamWatch"]

log = logging.getLogger(__name__)

_NAMES_SHOWN = 5
_requires_grad = operator.attrgetter("requires_grad")  # map() of it: no Python frame per param
_params_of = operator.itemgetter("params")


def _optimizer_size(optimizer: Any) -> tuple[int, int] | None:
    """(param groups, params in them): changes when ``add_param_group`` ran."""
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list):
        return None
    # comprehensions, not a generator: one Python frame, not one per group
    return len(groups), sum([len(g.get("params", ())) for g in groups if isinstance(g, dict)])


class ParamWatch:
    """Adds params that became trainable (or joined the optimizer) to ``ctx.params``."""

    def __init__(self, ctx: CollectorContext, on_joined: Callable[[list[TrackedParam]], None]):
        self.ctx = ctx
        self._on_joined = on_joined
        self._checked_step: int | None = None
        self._broken = False
        self._frozen: list[nn.Parameter] = frozen_params(ctx.chunks)
        self._optimizer_size = _optimizer_size(ctx.optimizer)
        self.handles: list[Handle] = []
        for vpp, chunk in enumerate(ctx.chunks):
            hook = outside_compiled_graphs(functools.partial(self._before_forward, vpp))
            self.handles.append(Handle(chunk.register_forward_pre_hook(hook, prepend=True).remove))

    def _before_forward(self, vpp: int, module: nn.Module, _args: Any) -> None:
        clock = self.ctx.clock
        if not clock.collecting or self._checked_step == clock.step or module is not self.ctx.chunks[vpp]:
            return  # not collected, already looked this step, or a copy of the model (deepcopy)
        self._checked_step = clock.step
        if self._broken:
            return
        groups = getattr(self.ctx.optimizer, "param_groups", None)
        try:  # ``check``'s common case inline (nothing frozen, nothing added): every collected step
            if (
                not self._frozen
                and type(groups) is list
                and (len(groups), sum(map(len, map(_params_of, groups)))) == self._optimizer_size
            ):
                return
        except Exception:
            pass  # not torch's list of dicts: ``check`` looks
        try:
            self.check(True)
        except Exception:
            self._failed()

    def at_step_entry(self) -> None:
        """Optimizer step entry of a collected step: a late ``add_param_group`` is seen here (the
        flags were read at this step's forward, if a monitored chunk's forward ran)."""
        flags = self._checked_step != self.ctx.clock.step
        self._checked_step = self.ctx.clock.step
        groups = getattr(self.ctx.optimizer, "param_groups", None)
        if not flags and type(groups) is list and self._optimizer_size is not None:
            try:  # the common case of ``check`` inline: nothing joined (every collected step)
                if (len(groups), sum(map(len, map(_params_of, groups)))) == self._optimizer_size:
                    return
            except Exception:
                pass  # not torch's list of dicts: ``check`` looks
        if not self._broken:  # the guard inline: this runs every collected step
            try:
                self.check(flags)
            except Exception:
                self._failed()

    def _failed(self) -> None:
        """``check`` raised (the exception being handled): one line, and no more watching."""
        log.exception(
            "trainmon: step %d: looking for params that joined after set_monitor failed; params "
            "unfrozen or added to the optimizer from now on are not recorded; training continues",
            self.ctx.clock.step,
        )
        self._broken = True
        self.remove()

    def check(self, flags: bool = True) -> None:
        """Re-derive the tracked params if the optimizer's size or (``flags``) a frozen param's
        ``requires_grad`` changed."""
        groups = getattr(self.ctx.optimizer, "param_groups", None)
        try:  # ``_optimizer_size`` without a Python frame, for torch's own list of dicts
            size = (len(groups), sum(map(len, map(_params_of, groups)))) if type(groups) is list else None
        except Exception:
            size = _optimizer_size(self.ctx.optimizer)
        if size == self._optimizer_size and not (flags and any(map(_requires_grad, self._frozen))):
            return
        self._optimizer_size = size
        self._frozen = frozen_params(self.ctx.chunks)
        joined = self._join()
        if joined:
            names = ", ".join(tp.name for tp in joined[:_NAMES_SHOWN])
            more = f" and {len(joined) - _NAMES_SHOWN} more" if len(joined) > _NAMES_SHOWN else ""
            log.info(
                "trainmon: step %d: %d params joined the monitored set (unfrozen or added to the "
                "optimizer after set_monitor): %s%s; recorded from this step on",
                self.ctx.clock.step,
                len(joined),
                names,
                more,
            )
            self._on_joined(joined)

    def _join(self) -> list[TrackedParam]:
        """Put newly selected params into ``ctx.params`` (model order kept); the ones that joined."""
        ctx = self.ctx
        now = ctx.integration.display_params(selected_params(ctx.chunks, ctx.matcher), ctx.config)
        known = {id(tp.param): tp for tp in ctx.params}
        joined = [tp for tp in now if id(tp.param) not in known]
        if joined:
            ids_now = {id(tp.param) for tp in now}
            # The same list object: collectors hold ctx, not a copy of the list.
            ctx.params[:] = [known.get(id(tp.param), tp) for tp in now] + [
                tp for tp in ctx.params if id(tp.param) not in ids_now
            ]
        return joined

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
