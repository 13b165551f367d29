"""Weight gradients before and after the data-parallel reduce (``wg_distribution``).

Emits (one row per trainable, selected param with a grad, per collected step):

================ ============================================= =========================
family           when                                          value
================ ============================================= =========================
grad_unreduced   end of the last micro-batch's backward pass,  this rank's accumulated
                 before any data-parallel reduce               ``grad`` (or ``main_grad``)
grad_reduced     optimizer step entry                          the grad the step applies
================ ============================================= =========================

"Optimizer step entry" is when the update's grads are final: with ``step(closure)``, right after
the closure's first call (see ``core.hooks.wrap_optimizer_step``).

Config: ``{"wg_distribution": true}``; ``"monitor_mbs_grad": true`` (msprobe) makes the generic
route record ``grad_unreduced`` on every micro-batch (a ``micro_step`` column): each row is that
micro-batch's own local grad (a tensor hook on the param sees it before it is accumulated),
not the running sum msprobe wrote.

``grad_reduced`` is the grad the update uses.  Stacks that clip or unscale inside their
``step()`` (DeepSpeed ZeRO, Megatron's optimizers) offer an applied-grad point
(``Integration.applied_grad_points``): the grads are read there, after the clip and right
before the inner optimizer applies them; elsewhere they are read at optimizer step entry.
Row order of ``grad_unreduced`` is the order grads became
ready (backward order); ``grad_reduced`` is model parameter order.

In a single process nothing can reduce during backward, so ``grad_unreduced`` is every grad as
the last micro-batch's backward pass leaves it, read in one multi-tensor call at the end of that
pass (rows in model parameter order).  The pass is found by the grad hooks of a few *sentinel*
params (the first, middle and last selected ones): a few Python calls per backward instead of
one per param.  A last backward pass that reaches none of them (a loss through other params
only) is noticed at the optimizer step: that step has no grad_unreduced rows (its grads may have
been clipped since), one warning says so, and later steps use one hook per param.  When grads may be reduced
during backward (DDP, world size > 1) each param is measured inside its
``register_post_accumulate_grad_hook``, which fires before DDP's reducer sees the grad.  A framework
integration (``trainmon.integrations``) may provide its own pre-reduce point instead (Megatron's
bucket ``start_grad_sync``); ``main_grad`` without one records only ``grad_reduced``.  A stack
that reduces every micro-batch (DeepSpeed ZeRO-2/3) emits with a ``micro_step``: then
``grad_unreduced`` has one row per param per micro-batch, each that micro-batch's local grad.
"""

from __future__ import annotations

import functools
import logging

from trainmon.collectors.base import Collector, FamilyRows, capture_plain, capture_views, register_collector
from trainmon.core.hooks import Handle, post_accumulate_grad_hook
from trainmon.core.naming import TrackedParam
from trainmon.families import Family

__all__ = ["WeightGradCollector"]

log = logging.getLogger(__name__)

SENTINELS = 3  # params whose grad hooks find a single process's backward passes


def _spread(params: list[TrackedParam], k: int) -> list[TrackedParam]:
    """``k`` params spread over the model order, the first and the last among them."""
    if len(params) <= k:
        return list(params)
    return [params[round(i * (len(params) - 1) / (k - 1))] for i in range(k)]


@register_collector
class WeightGradCollector(Collector):
    name = "weight_grads"
    priority = 60

    @staticmethod
    def enabled(config) -> bool:
        return config.wg_distribution

    def attach(self) -> None:
        self._plain = self.ctx.integration.plain_views()
        self._grad_getter = self.ctx.integration.grad_getter() if self._plain else None
        self._rows = {str(f): FamilyRows(self.ctx.engine, f) for f in (Family.GRAD_UNREDUCED, Family.GRAD_REDUCED)}
        self._by_sentinels = False
        self._ready: list[TrackedParam] = []
        self._captured: set[int] = set()
        self._attach_applied()
        integration = self.ctx.integration
        points = integration.pre_reduce_points(self.ctx.params, self.ctx.guard.wrap(self, self._emit))
        if self.ctx.config.monitor_mbs_grad and points is not None and not integration.reduces_every_micro_batch:
            log.warning(
                "trainmon: monitor_mbs_grad: under '%s' grad_unreduced is read at the stack's own "
                "pre-reduce point (grads accumulated over the micro-batches), so it has no "
                "per-micro-batch rows",
                integration.name,
            )
        if points is not None:
            self.handles.extend(points)
            self._generic = False
            if not points:
                log.warning(
                    "trainmon: integration '%s' knows no pre-reduce point for these params "
                    "(e.g. main_grad without a framework integration, FSDP2 without the opt-in); "
                    "grad_unreduced is not recorded",
                    self.ctx.integration.name,
                )
            return
        self._generic = True
        if self._plain and not self.ctx.distributed and not self.ctx.config.monitor_mbs_grad:
            self._hook_sentinels()
        else:
            self._hook_params(self.ctx.params)

    def _hook_sentinels(self) -> None:
        """Single process: find each backward pass from the grad hooks of a few params (see the
        module docstring): a few Python calls per backward instead of one per param."""
        self._by_sentinels = True
        self._pass_seen: tuple[int, int] | None = None
        self._end_seen = False
        body = self.ctx.guard.gated(self, self._on_sentinel, self.ctx.clock)
        for tp in _spread(self.ctx.params, SENTINELS):
            self.handles.append(post_accumulate_grad_hook(tp.param, body))

    def _on_sentinel(self, _param: object = None) -> None:
        clock = self.ctx.clock
        this_pass = (clock.step, clock.backward_index)  # backward_index moves when the pass ends
        if this_pass == self._pass_seen or not self._by_sentinels:
            return  # another sentinel of this pass came first, or replaced by per-param hooks
        self._pass_seen = this_pass
        if clock.is_last_micro_batch(clock.enter_backward()):
            clock.on_backward_end(self._capture_at_backward_end)

    def _capture_at_backward_end(self) -> None:
        self._end_seen = True
        try:  # ``Guard.run`` inline: a frame less per step
            if self.name not in self.ctx.guard.failed:
                self._capture_family(Family.GRAD_UNREDUCED, self.ctx.params)
        except Exception:
            self.ctx.guard.fail(self)

    def _capture_family(self, family: str, params: list[TrackedParam]) -> None:
        """Every grad of ``params`` as one family capture."""
        getter = self._grad_getter
        grads = list(map(getter, params)) if getter is not None else self.ctx.integration.grads_of(params)
        if not self._rows[family].capture(params, grads):  # complex grads: by modulus
            capture_plain(self.ctx, family, params, grads)

    def _hook_params(self, params: list[TrackedParam]) -> None:
        """The generic route's per-param grad hooks."""
        guard = self.ctx.guard
        mbs = self.ctx.config.monitor_mbs_grad
        for tp in params:
            if mbs:
                body = guard.wrap(self, lambda g, tp=tp: self._on_micro_grad(tp, g))
                self.handles.append(Handle(tp.param.register_hook(body).remove))
            else:  # one frame per param per backward on collected steps, one flag check otherwise
                body = guard.gated(self, functools.partial(self._on_grad_ready, tp), self.ctx.clock)
                self.handles.append(post_accumulate_grad_hook(tp.param, body))

    def on_params_joined(self, params: list[TrackedParam]) -> None:
        # Joined at step entry, their grads of this step went by unseen: not "missed" grads.
        self._captured.update(id(tp.param) for tp in params)
        if self._by_sentinels:
            return  # every grad of ctx.params is read at backward end, these included
        if self._generic:
            self._hook_params(params)
            if self._at_entry:
                return
        if not getattr(self, "_warned_joined", False):
            self._warned_joined = True
            missing = ("" if self._generic else "grad_unreduced") + ("" if self._at_entry else " grad_reduced")
            log.warning(
                "trainmon: integration '%s' reads %s at points set up at set_monitor; the %d params "
                "that joined later (e.g. %s) have none of those rows until the next set_monitor",
                self.ctx.integration.name,
                " and ".join(missing.split()),
                len(params),
                params[0].name,
            )

    def _attach_applied(self) -> None:
        """Read grad_reduced where the stack applies it (after its clip), if it says where."""
        self._applied_seen = False
        points = self.ctx.integration.applied_grad_points(self.ctx.params, self.ctx.guard.wrap(self, self._applied))
        self._at_entry = points is None
        self.handles.extend(points or [])

    def _applied(self, pairs: list) -> None:
        if self.ctx.clock.collecting:
            self._applied_seen = True
            capture_views(self.ctx, Family.GRAD_REDUCED, pairs)

    def _on_micro_grad(self, tp: TrackedParam, grad) -> None:
        """monitor_mbs_grad: this micro-batch's own grad of ``tp``, before it is accumulated."""
        clock = self.ctx.clock
        if not clock.collecting or grad is None:
            return
        index = clock.enter_backward()
        self._captured.add(id(tp.param))
        capture_views(self.ctx, Family.GRAD_UNREDUCED, [(tp, self.ctx.integration.tp_view(tp, grad))], micro_step=index)

    def _emit(self, params: list[TrackedParam], micro_step: int | None = None) -> None:
        """Called by an integration at its pre-reduce point (``micro_step`` when the stack
        reduces every micro-batch, e.g. DeepSpeed ZeRO-2/3)."""
        if self.ctx.clock.collecting:
            self._capture(params, micro_step)

    def _on_grad_ready(self, tp: TrackedParam, _param: object = None) -> None:
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

    def _capture(self, params: list[TrackedParam], micro_step: int | None = None) -> None:
        local = self.ctx.integration.local_grad
        capture_views(
            self.ctx,
            Family.GRAD_UNREDUCED,
            [(tp, v) for tp in params if (v := local(tp)) is not None],
            micro_step=micro_step,
        )

    def on_step_begin(self) -> None:
        self._applied_seen = False
        if self._by_sentinels:
            if self._end_seen:  # the common case inline (a frame less per step)
                self._end_seen = False
            else:
                self._check_backward_seen()
        if self._plain and self._at_entry:  # ``_capture_family`` inline (every collected step)
            params, getter = self.ctx.params, self._grad_getter
            grads = list(map(getter, params)) if getter is not None else self.ctx.integration.grads_of(params)
            if not self._rows[Family.GRAD_REDUCED].capture(params, grads):  # complex grads: by modulus
                capture_plain(self.ctx, Family.GRAD_REDUCED, params, grads)
            return
        reduced = self.ctx.integration.reduced_grad
        pairs = [(tp, v) for tp in self.ctx.params if (v := reduced(tp)) is not None] if self._at_entry else []
        capture_views(self.ctx, Family.GRAD_REDUCED, pairs)
        if self._generic and not self._by_sentinels and len(self._captured) < len(self.ctx.params):
            with_grad = (
                [tp for tp, _ in pairs] if self._at_entry else [tp for tp in self.ctx.params if reduced(tp) is not None]
            )
            self._warn_missed([tp.name for tp in with_grad if id(tp.param) not in self._captured])
        self._captured.clear()

    def _check_backward_seen(self) -> None:
        """A collected step with grads whose last backward pass reached no sentinel: its grads
        as backward left them are gone (maybe clipped since), so this step has no grad_unreduced
        rows; from now on one hook per param sees every pass."""
        seen, self._end_seen = self._end_seen, False
        if seen or not any([g is not None for g in self.ctx.integration.grads_of(self.ctx.params)]):
            return  # seen, or a step without grads (no backward): nothing was missed
        self._by_sentinels = False
        self._hook_params(self.ctx.params)
        self._captured.update(id(tp.param) for tp in self.ctx.params)  # this step: warned here
        log.warning(
            "trainmon: step %d: its last backward pass reached none of the params trainmon watches "
            "to find backward passes, so this step has no grad_unreduced rows; later steps are "
            "recorded with one hook per param (slower)",
            self.ctx.clock.step,
        )

    def quiet_hooks(self) -> tuple[str, ...]:
        return ("on_step_end",) if self._at_entry else ()  # it only warns about applied-grad points

    def on_step_end(self) -> None:
        if not self._at_entry and not self._applied_seen and not getattr(self, "_warned_skip", False):
            self._warned_skip = True
            log.warning(
                "trainmon: step %d: the optimizer applied no update (e.g. an fp16 overflow skipped "
                "it), so grad_reduced has no rows for that step (said once)",
                self.ctx.clock.step,
            )

    def _warn_missed(self, missed: list[str]) -> None:
        if missed and not getattr(self, "_warned_missed", False):
            self._warned_missed = True
            clock = self.ctx.clock
            log.warning(
                "trainmon: step %d: %d params had a grad at optimizer step but none was seen "
                "on the last micro-batch (%d backward passes seen, grad_acc_steps=%d), e.g. %s; "
                "their grad_unreduced rows are missing",
                clock.step,
                len(missed),
                clock.backward_index,
                clock.acc_steps,
                missed[0],
            )
