"""Weight gradients before and after the data-parallel reduce (``wg_distribution``).

Emits (one row per trainable, selected param with a grad, per collected step):

================ ============================================= =========================
family           when                                          value
================ ============================================= =========================
grad_unreduced   end of the last micro-batch's backward pass,  this rank's accumulated
                 before any data-parallel reduce               ``grad`` (or ``main_grad``)
grad_reduced     optimizer step entry                          the grad the step applies
================ ============================================= =========================

Config: ``{"wg_distribution": true}``.  Row order of ``grad_unreduced`` is the order grads became
ready (backward order); ``grad_reduced`` is model parameter order.

Pre-reduce capture uses ``register_post_accumulate_grad_hook``, which fires before DDP's reducer
sees the grad.  In a single process nothing can reduce during backward, so the ready params are
batched and measured once at the end of the backward pass; when grads may be reduced during
backward (DDP, world size > 1) each param is measured inside its hook.  With
``params_have_main_grad`` the pre-reduce point belongs to the framework integration (Megatron's
bucket ``start_grad_sync``); without one only ``grad_reduced`` is recorded.
"""
from __future__ import annotations

import logging

from trainmon.collectors.base import Collector, register_collector
from trainmon.hooks import post_accumulate_grad_hook
from trainmon.naming import TrackedParam
from trainmon.stats.engine import Tracked

__all__ = ["WeightGradCollector"]

log = logging.getLogger(__name__)


@register_collector
class WeightGradCollector(Collector):
    name = "weight_grads"

    @staticmethod
    def enabled(config) -> bool:
        return config.wg_distribution

    def attach(self) -> None:
        self._ready: list[TrackedParam] = []
        self._captured: set[int] = set()
        if self.ctx.use_main_grad:
            log.warning("trainmon: params carry main_grad and no framework integration provides a "
                        "pre-reduce point; grad_unreduced is not recorded (grad_reduced is)")
            return
        guard = self.ctx.guard
        for tp in self.ctx.params:
            body = guard.wrap(self, lambda _p, tp=tp: self._on_grad_ready(tp))
            self.handles.append(post_accumulate_grad_hook(tp.param, body))

    def _on_grad_ready(self, tp: TrackedParam) -> None:
        clock = self.ctx.clock
        if not clock.collecting:
            return
        index = clock.enter_backward()
        if not clock.is_last_micro_batch(index):
            return
        self._captured.add(id(tp.param))
        if self.ctx.distributed:
            self._capture([tp])
            return
        if not self._ready:
            clock.on_backward_end(self._flush_ready)
        self._ready.append(tp)

    def _flush_ready(self) -> None:
        ready, self._ready = self._ready, []
        self.ctx.guard.run(self, self._capture, ready)

    def _capture(self, params: list[TrackedParam]) -> None:
        items = [Tracked(tp.name, g, tp.vpp_stage) for tp in params
                 if (g := tp.param.grad) is not None]
        self.ctx.engine.capture("grad_unreduced", items)

    def on_step_begin(self) -> None:
        items, missed = [], []
        for tp in self.ctx.params:
            g = self.ctx.grad_of(tp)
            if g is None:
                continue
            items.append(Tracked(tp.name, g, tp.vpp_stage))
            if not self.ctx.use_main_grad and id(tp.param) not in self._captured:
                missed.append(tp.name)
        self.ctx.engine.capture("grad_reduced", items)
        self._warn_missed(missed)
        self._captured.clear()

    def _warn_missed(self, missed: list[str]) -> None:
        if missed and not getattr(self, "_warned_missed", False):
            self._warned_missed = True
            clock = self.ctx.clock
            log.warning("trainmon: step %d: %d params had a grad at optimizer step but none was seen "
                        "on the last micro-batch (%d backward passes seen, grad_acc_steps=%d), e.g. %s; "
                        "their grad_unreduced rows are missing", clock.step, len(missed),
                        clock.backward_index, clock.acc_steps, missed[0])
