"""Escalation: on a run-time alert, every rank records more for a few steps, then goes back.

A config with ``on_anomaly`` is run by an :class:`EscalatingSession`, which both step drivers
treat as their session (``SessionBuilder.build`` returns one).  It holds

* the *base* session (the config as written), whose alert sink feeds an ``AlertLatch``;
* an optional *flight recorder*: a session recording, every step, the families that
  ``on_anomaly.config`` switches on and the base config does not, into a ring of the last
  ``history_steps`` + 1 steps held in memory (``sinks.ring.RingSink``);
* during an escalation, the *window* session: base config merged with ``on_anomaly.config``,
  every step for ``steps`` steps.

At the boundary after step ``s`` (training thread): if the base session recorded ``s``, wait until
its alert sink has judged ``s`` (the writer thread is at most one step's rows behind, see
docs/escalation.md for the cost); then one all-reduce (MAX of one int64) tells every rank the
earliest alert of any rank.  If there is one and fewer than ``max_times`` escalations ran, every
rank, at this same boundary: writes the recorder's held steps ``s - history_steps .. s``, builds
the window session from step ``s + 1``, and holds the base session and the recorder for the
window's steps (their schedules still count them).  Rank 0 logs the escalation and appends it to
``run.json``.  After step ``s + steps`` the window session closes and the base session resumes.
The agreement is the dynamic driver's gloo group in dynamic mode, a group of its own otherwise
(single process: none).  Training is never changed: only statistics are read.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from trainmon.config import AlertConfig, CommConfig, MonitorConfig
from trainmon.core import dist as _dist
from trainmon.core import step_boundary
from trainmon.core.hooks import Handle
from trainmon.output.layout import RUN_ESCALATIONS
from trainmon.runtime.agreement import Agreement
from trainmon.runtime.alert_latch import AlertLatch, Trigger
from trainmon.runtime.forked import forget_in_forked_child
from trainmon.runtime.run_dir import append_to_meta
from trainmon.runtime.session import Session

if TYPE_CHECKING:
    from trainmon.collectors import Collector, CollectorContext
    from trainmon.core.schedule import StepClock
    from trainmon.runtime.builder import SessionBuilder

__all__ = ["EscalatingSession", "recorder_config", "window_config"]

log = logging.getLogger(__name__)

_STEP_CODE = 1 << 40  # alert steps are encoded as (_STEP_CODE - step) * size + (size - 1 - rank)
_FLAGS = ("wg_distribution", "mv_distribution", "param_distribution", "ur_distribution", "xy_distribution")


def window_config(cfg: MonitorConfig, first_step: int) -> MonitorConfig:
    """What an escalation window records: ``cfg`` merged with ``on_anomaly.config``, every step of it."""
    assert cfg.on_anomaly is not None
    return dataclasses.replace(
        cfg.escalated(), start_step=first_step, step_interval=1, collect_times=cfg.on_anomaly.steps, print_struct=False
    )


def recorder_config(cfg: MonitorConfig, first_step: int) -> MonitorConfig | None:
    """The flight recorder's config: the families the window adds to the base config, every step
    (with the window's ops and targets, so its rows are the window's rows); None if it adds none."""
    spec = cfg.on_anomaly
    if spec is None or spec.history_steps == 0:
        return None
    merged = cfg.escalated()
    off: dict[str, Any] = {flag: False for flag in _FLAGS if getattr(cfg, flag)}
    comm = CommConfig() if cfg.cc_distribution.enable else merged.cc_distribution
    rec = dataclasses.replace(
        merged,
        **off,
        cc_distribution=comm,
        alert=AlertConfig(),
        print_struct=False,
        start_step=first_step,
        step_interval=1,
        collect_times=None,
    )
    if not any(getattr(rec, flag) for flag in _FLAGS) and not rec.cc_distribution.enable:
        return None
    return rec


class _Hold:
    """Keeps a session from recording the coming step while its schedule still counts it."""

    def __init__(self, session: Session):
        self.session = session
        self.would_collect = session.clock.collecting
        session.clock.collecting = False

    def release(self, hold_again: bool) -> None:
        """After the held step: advance its clock as if it had run (and hold the next one)."""
        clock = self.session.clock
        clock.collecting = self.would_collect
        clock.advance()
        if clock.finished and self.session.collectors:
            self.session.go_idle()
        self.would_collect = clock.collecting
        if hold_again:
            clock.collecting = False


class EscalatingSession:
    """See the module docstring.  Looks like a ``Session`` to the drivers (``clock``, ``ctx``,
    ``collectors``, ``before_step``, ``after_step``, ``close``)."""

    wait_timeout_s = 60.0  # longest wait for the writer to judge a step (then: no more waiting)

    def __init__(self, builder: SessionBuilder, cfg: MonitorConfig, first_step: int, step_optimizer: Any = None):
        assert cfg.on_anomaly is not None
        self.builder = builder
        self.cfg = cfg
        self.spec = cfg.on_anomaly
        source = cfg.source or str(builder.config_file)
        builder.check_targets(window_config(cfg, first_step), f"{source} (on_anomaly.config)")
        self.latch = AlertLatch()
        self._own_agreement = builder.agreement is None
        self.agreement: Agreement = builder.agreement or Agreement(builder.process_group, _timeout_s())
        self.base = builder.build_session(cfg, first_step, latch=self.latch)
        self.recorder: Session | None = None
        self.ring: Any = None
        rec_cfg = recorder_config(cfg, first_step)
        if rec_cfg is not None:
            self.recorder = builder.build_session(rec_cfg, first_step, wrap_sink=self._ring_of)
        elif self.spec.history_steps:
            log.warning(
                "trainmon: on_anomaly.history_steps: on_anomaly.config switches on no family the base "
                "config does not record, so the flight recorder has nothing to keep"
            )
        self.window: Session | None = None
        self.window_end: int | None = None  # first step after the window
        self.times = 0
        self.history: list[dict[str, object]] = []  # this run's escalations, as in run.json
        self._held: list[_Hold] = []
        self._wait = True
        self._broken = False
        self._handle: Handle | None = None
        if step_optimizer is not None:
            self._handle = step_boundary.subscribe(
                step_optimizer, self.before_step, self.after_step, entry=self.step_entry
            )
        forget_in_forked_child(self)

    def forget_parent(self) -> None:
        """In a forked child (``runtime.forked``): no agreement, no window (its sessions forget too)."""
        self._broken = True
        if self._own_agreement:
            self.agreement.local, self.agreement.group = True, None

    def _ring_of(self, sink: Any) -> Any:
        from trainmon.sinks.ring import RingSink

        self.ring = RingSink(sink, self.spec.history_steps + 1)
        return self.ring

    # -- what the drivers read -------------------------------------------------------------------
    @property
    def clock(self) -> StepClock:
        return self.base.clock

    @property
    def ctx(self) -> CollectorContext:
        return self.base.ctx

    @property
    def collectors(self) -> list[Collector]:
        return self.window.collectors if self.window is not None else self.base.collectors

    def _live(self) -> list[Session]:
        return [s for s in (self.base, self.recorder, self.window) if s is not None]

    def record_loss(self, loss: Any) -> None:
        """To the session recording this step: the window while one is open, else the base."""
        (self.window or self.base).record_loss(loss)

    # -- the step boundary -----------------------------------------------------------------------
    def step_entry(self) -> None:
        for s in self._live():
            s.step_entry()

    def before_step(self) -> None:
        for s in self._live():
            s.before_step()

    def after_step(self) -> None:
        step = self.base.clock.step
        recorded = self.base.clock.collecting  # False while held: the window recorded the step
        held = {id(h.session) for h in self._held}
        for s in self._live():
            if id(s) not in held:
                s.after_step()
        in_window = self.window is not None and step + 1 < (self.window_end or 0)
        for h in self._held:
            h.release(hold_again=in_window)
        if self.window is not None and not in_window:
            self._end_window(step + 1)
        if self.window is None and not self._broken and self.times < self.spec.max_times:
            self._consult(step, recorded and not in_window)

    def _consult(self, step: int, recorded: bool) -> None:
        if recorded and self._wait and self.latch.attached and not self.latch.wait_checked(step, self.wait_timeout_s):
            self._wait = False
            log.warning(
                "trainmon: the alert writer did not judge step %d within %.0f s; escalations now "
                "start at the first boundary after an alert is judged",
                step,
                self.wait_timeout_s,
            )
        try:
            trigger = self._agree(self.latch.first)
            if trigger is not None:
                self._start(trigger, step + 1)
        except Exception as exc:
            self._broken = True
            log.error(
                "trainmon: escalation: agreeing with the other ranks failed at step %d (%s: %s); "
                "no more escalations on this rank, monitoring continues",
                step,
                type(exc).__name__,
                exc,
            )

    def _agree(self, mine: Trigger | None) -> Trigger | None:
        """The earliest alert of any rank (ties: the lowest rank), the same on every rank."""
        size, rank = self.agreement.size, self.agreement.group_rank
        code = 0 if mine is None else (_STEP_CODE - mine.step) * size + (size - 1 - rank)
        best = self.agreement.max(code)
        if best == 0:
            return None
        source = size - 1 - best % size
        trigger = self.agreement.value_from(mine, source)
        return trigger

    def _start(self, trigger: Trigger, first: int) -> None:
        self.times += 1
        last = first + self.spec.steps - 1
        window = self._build_window(first)
        if not self.agreement.all_true(window is not None):  # every rank escalates, or none does
            if window is not None:
                window.close()
            log.error(
                "trainmon: escalation %d/%d for the alert at step %d is NOT applied: building it failed "
                "on some rank (see that rank's log)",
                self.times,
                self.spec.max_times,
                trigger.step,
            )
            return
        kept = self.ring.dump() if self.ring is not None else []
        self.window = window
        self.window_end = last + 1
        self._held = [_Hold(s) for s in (self.base, self.recorder) if s is not None]
        entry = {
            "trigger": trigger.to_json(),
            "first_step": first,
            "last_step": last,
            "times": self.times,
            "max_times": self.spec.max_times,
            "history": [kept[0], kept[-1]] if kept else None,
            "config": dict(self.cfg.to_dict()["on_anomaly"]["config"]),  # type: ignore[index]
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        self.history.append(entry)
        if self.agreement.is_source:
            log.warning(
                "trainmon: escalation %d/%d: %s alert on rank %d at step %d (%s %s, %s); recording "
                "on_anomaly.config on every rank for steps %d..%d%s",
                self.times,
                self.spec.max_times,
                trigger.rule,
                trigger.rank,
                trigger.step,
                trigger.kind,
                trigger.name,
                trigger.op,
                first,
                last,
                f"; flight recorder wrote steps {kept[0]}..{kept[-1]}" if kept else "",
            )
            if self.builder.run_dir is not None and _dist.rank(self.builder.process_group) == 0:
                append_to_meta(self.builder.run_dir, RUN_ESCALATIONS, entry)

    def _build_window(self, first: int) -> Session | None:
        try:
            return self.builder.build_session(window_config(self.cfg, first), first)
        except Exception:
            log.exception("trainmon: escalation: building the escalation window failed on this rank")
            return None

    def _end_window(self, next_step: int) -> None:
        window, self.window, self.window_end = self.window, None, None
        self._held = []
        assert window is not None
        window.close()
        self.latch.clear()  # alerts of before the window were handled by it
        if self.agreement.is_source:
            log.warning(
                "trainmon: escalation %d/%d ended; back to the base config from step %d",
                self.times,
                self.spec.max_times,
                next_step,
            )

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        for s in self._live():
            s.close()
        self.window = None
        if self._own_agreement:
            self.agreement.close()

    def go_idle(self) -> None:
        for s in self._live():
            s.go_idle()


def _timeout_s() -> float:
    # The one parser of dynamic mode's settings; a bad value never stops training here, it is said.
    from trainmon.dynamic import _env_seconds
    from trainmon.errors import ConfigError

    try:
        return _env_seconds(os.environ, "TRAINMON_DYNAMIC_TIMEOUT", 1800.0)
    except ConfigError as err:
        log.warning("trainmon: %s; escalation waits the default 1800 s", str(err).splitlines()[-1].strip())
        return 1800.0
