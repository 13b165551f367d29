"""One monitoring session: the collectors, clock, engine and sink of one ``set_monitor`` call.

Step flow (collected steps only; other steps cost a flag check):
optimizer step entry -> collectors' ``on_step_entry`` -> (``step(closure)``: the closure's first
call) -> ``on_step_begin`` -> the update -> ``on_step_end`` ->
``engine.finish_step`` (one device->host copy) -> ``sink.write`` (returns at once: a writer
thread does the I/O) -> clock advances.  When ``collect_times`` is reached every hook goes.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from trainmon.collectors import Collector, CollectorContext, collector_classes
from trainmon.collectors.base import Guard
from trainmon.core import step_boundary
from trainmon.core.hooks import Handle
from trainmon.core.naming import TrackedParam
from trainmon.core.schedule import Schedule, StepClock
from trainmon.families import FAMILIES, Family, Phase
from trainmon.runtime.forked import forget_in_forked_child
from trainmon.runtime.param_watch import ParamWatch
from trainmon.runtime.run_dir import record_stats_path
from trainmon.sinks.base import NullSink, Sink
from trainmon.stats.engine import Meta
from trainmon.stats.rows import RowBlock, StepRows

if TYPE_CHECKING:
    from trainmon.collectors.loss import LossCollector

__all__ = ["Session", "StepSession"]

log = logging.getLogger(__name__)


class StepSession(Protocol):
    """What the step drivers use of a session: a ``Session``, or an ``EscalatingSession``
    (``runtime.escalation``) that runs a base session and escalation windows behind the same
    calls."""

    @property
    def ctx(self) -> CollectorContext: ...

    @property
    def clock(self) -> StepClock: ...

    @property
    def collectors(self) -> list[Collector]: ...

    def step_entry(self) -> None: ...

    def before_step(self) -> None: ...

    def after_step(self) -> None: ...

    def record_loss(self, loss: Any) -> None: ...

    def go_idle(self) -> None: ...

    def close(self) -> None: ...


class Session:
    def __init__(self, ctx: CollectorContext, sink: Sink, optimizer: Any, collect: bool = True):
        self.ctx = ctx
        self.sink = sink
        ctx.guard = Guard(self._drop_collector)
        self.collectors: list[Collector] = [
            cls(ctx) for cls in collector_classes() if collect and cls.enabled(ctx.config)
        ]
        self._step_handle: Handle | None = None
        self._entered = False  # on_step_entry ran for the running step
        self._paths_recorded: dict[str, str] = {}
        self._scale: Any = None  # loss scale at step entry (core.step_boundary)
        self._inherited = False  # a forked child's copy (forget_parent)
        # (step method, skipped) -> [(collector, bound method)]: who runs at each step boundary,
        # worked out once (collectors whose method is a no-op for their config are left out)
        self._plans: dict[tuple[str, bool], list[tuple[Collector, Any]]] = {}
        self._skipping = False  # step_boundary.skipping() at this boundary's step entry
        forget_in_forked_child(self)
        for c in list(self.collectors):
            ctx.guard.run(c, c.attach)
            if c.name == "loss":
                c.write_late = self._write_late  # type: ignore[attr-defined]
                c.replan = self._plans.clear  # type: ignore[attr-defined]  # its quiet_hooks changed
        # params unfrozen or added to the optimizer later join ctx.params (runtime.param_watch)
        self._watch = ParamWatch(ctx, self._params_joined) if self.collectors else None
        if optimizer is not None:
            self._step_handle = step_boundary.subscribe(
                optimizer, self.before_step, self.after_step, entry=self.step_entry
            )
        if ctx.clock.finished:
            self.go_idle()

    @property
    def clock(self) -> StepClock:
        return self.ctx.clock

    def _overriding(self, method: str, skipped: bool) -> list[Collector]:
        """The collectors whose ``method`` does something (the base's is a no-op, and a collector
        may say that its own is one for its config: ``Collector.quiet_hooks``)."""
        base = getattr(Collector, method)
        return [
            c
            for c in self.collectors
            if getattr(type(c), method) is not base
            and (c.runs_on_skipped_steps or not skipped)
            and method not in c.quiet_hooks()
        ]

    def _plan(self, method: str, skipped: bool) -> list[tuple[Collector, Any]]:
        """``_overriding`` with the bound methods, kept until the collectors change."""
        plan = self._plans[(method, skipped)] = [(c, getattr(c, method)) for c in self._overriding(method, skipped)]
        return plan

    def _run_plan(self, plan: list[tuple[Collector, Any]]) -> None:
        """Each planned step method under the guard (``Guard.run`` inlined: a frame less per
        collector and step)."""
        guard = self.ctx.guard
        failed = guard.failed
        for c, fn in plan:
            if c.name not in failed:
                try:
                    fn()
                except Exception:
                    guard.fail(c)

    def forget_parent(self) -> None:
        """In a forked child (``runtime.forked``): collect nothing from now on, so every hook
        returns at its ``collecting`` check and the next step boundary removes them; the parent's
        sink, run.json and pending captures are never touched here."""
        self._inherited = True
        self.sink = NullSink(self.sink.options)
        self.ctx.run_dir = None
        self.clock.schedule = Schedule(collect_times=0)  # exhausted: advance() keeps it off
        self.clock.collecting = False

    def step_entry(self) -> None:
        """``optimizer.step()`` was entered: no param has changed yet."""
        self._entered = True
        if self.ctx.clock.collecting:
            if self._watch is not None:
                self._watch.at_step_entry()
            self._skipping = step_boundary.skipping()  # read once per boundary: before_step reuses it
            key = ("on_step_entry", self._skipping)
            plan = self._plans.get(key)
            if plan is None:
                plan = self._plan(*key)
            if plan:
                self._run_plan(plan)

    def before_step(self) -> None:
        """The update's grads are final (after the closure, when ``step`` was given one)."""
        if not self._entered:  # a boundary without an entry point (monitor.step(), dynamic driver)
            self.step_entry()
        clock = self.ctx.clock
        if clock.collecting:
            # the scale this iteration ran with, before the scaler updates it (a device tensor)
            scale = step_boundary.current_scale(self.ctx.optimizer) if self.ctx.optimizer is not None else None
            self._scale = None if scale is None else scale.detach().reshape(-1)[:1].clone()
            key = ("on_step_begin", self._skipping)
            plan = self._plans.get(key)
            if plan is None:
                plan = self._plan(*key)
            if plan:
                self._run_plan(plan)

    def after_step(self) -> None:
        self._entered = False
        clock = self.ctx.clock
        if clock.collecting:
            skipped = step_boundary.skipped(self.ctx.optimizer)
            plan = self._plans.get(("on_step_end", skipped))
            if plan is None:
                plan = self._plan("on_step_end", skipped)
            if plan:
                self._run_plan(plan)
            if self._scale is not None:
                self._capture_step_row(skipped)
            self._emit(clock.step, skipped)
        clock.advance()
        if self.collectors and clock.finished:
            self.go_idle()

    def record_loss(self, loss: Any) -> None:
        """Hand ``loss`` to the loss collector; a call after the step's rows went out is written
        on its own (``collectors.loss``)."""
        collector = next((c for c in self.collectors if c.name == "loss"), None)
        if collector is None:
            return
        loss_collector = cast("LossCollector", collector)  # the collector named "loss"
        late = self.ctx.guard.run(collector, loss_collector.record, loss)
        if late is not None:
            self.sink.write(*late)

    def _write_late(self, rows: StepRows, step: int) -> None:
        """A finished step's rows found after its write (the loss collector's first call)."""
        if not self._inherited:
            self.sink.write(rows, step)

    def _capture_step_row(self, skipped: bool) -> None:
        """The ``steps`` row of a loss-scaled step (no host sync: copied with the step's stats)."""
        scale, self._scale = self._scale, None
        if scale is None or not self.collectors:
            return
        scale = scale.double()
        flag = torch.ones_like(scale) if skipped else torch.zeros_like(scale)
        self.ctx.engine.capture_values(
            Family.STEPS,
            [Meta(Family.STEPS, "optimizer", 0, (), "")],
            [torch.cat([flag, scale])],
            ("skipped", "loss_scale"),
            integers=("skipped",),
        )

    def _emit(self, step: int, skipped: bool = False) -> None:
        try:
            rows = self.ctx.engine.finish_step(step)
        except Exception:
            log.exception("trainmon: computing the stats of step %d failed; that step is not recorded", step)
            self.ctx.engine.discard()
            return
        if skipped:  # captured before the step was known to be skipped (Megatron): not written
            rows = StepRows(functools.partial(_without_optimizer_rows, rows), rows.wall_time)
        self.sink.write(rows, step)
        paths = self.ctx.engine.stats_paths
        if paths != self._paths_recorded and self.ctx.rank == 0 and self.ctx.run_dir is not None:
            self._paths_recorded = dict(paths)
            record_stats_path(self.ctx.run_dir, self._paths_recorded)

    def _params_joined(self, params: list[TrackedParam]) -> None:
        for c in list(self.collectors):
            self.ctx.guard.run(c, c.on_params_joined, params)
        self._plans.clear()

    def _drop_collector(self, collector: Collector) -> None:
        collector.detach()
        if collector in self.collectors:
            self.collectors.remove(collector)
        self._plans.clear()

    def go_idle(self) -> None:
        """Remove every hook (``collect_times`` reached); the files stay open for flushing."""
        for c in self.collectors:
            c.detach()
        self.collectors.clear()
        self._plans.clear()
        if self._watch is not None:
            self._watch.remove()
            self._watch = None
        if self._step_handle is not None:
            self._step_handle.remove()
            self._step_handle = None
        self.sink.flush()

    def close(self) -> None:
        self.go_idle()
        if self._inherited:  # the pending rows are the parent's to write
            return
        # Rows captured after the last optimizer step (comm calls at the end of a run) are
        # written; sharded rows of a step that never reached the optimizer are not, since their
        # merge is a collective and the other ranks may not be closing at the same point.
        self.ctx.engine.discard_sharded()
        if self.ctx.engine.has_pending():
            self._emit(self.clock.step)
        self.sink.close()


_OPTIMIZER_FAMILIES = frozenset(str(f) for f, info in FAMILIES.items() if info.phase == Phase.OPTIMIZER) - {
    str(Family.STEPS)
}


def _without_optimizer_rows(rows: StepRows) -> list[RowBlock]:
    """The blocks of a skipped step, less what the optimizer step would have changed."""
    return [b for b in rows.blocks() if b.family not in _OPTIMIZER_FAMILIES]
