"""Dynamic mode, part 2: switching monitoring on and off at step boundaries, on every rank alike.

``TrainerMon`` in dynamic mode (``DYNAMIC_MONITOR=true``) hands the step boundary to a
``DynamicDriver``, which keeps one step-boundary wrapper for
its whole life and owns no hook besides it while idle.  At each boundary:

1. the ``Session`` that is collecting (if any) finishes its step; rank 0 stats the config file
   now and then (``ConfigWatcher.check_file``, rate-limited) for an edit no observer reported;
2. if that session reached ``collect_times`` it is closed (all its hooks go);
3. rank 0 of the monitor's group shares the staged version number (and its step number) with
   the other ranks: one broadcast of two int64 on a dedicated gloo group.  Only when the version
   differs from the applied one does rank 0 send the decision itself (``broadcast_object_list``);
4. a new version is applied by every rank at this same boundary: "off" closes the session; a
   config builds a new session from the next step, every rank votes that it could (one
   all-reduce), and only then is the old session replaced.  A failure anywhere leaves every
   rank as it was.

Switches the user caused by editing the file are logged at WARNING (:meth:`DynamicDriver._tell`),
so they reach stderr in scripts that configure no logging.

The group has its own timeout: if a peer never reaches the boundary, the collective fails after
``TRAINMON_DYNAMIC_TIMEOUT`` seconds and dynamic mode switches itself off on that rank instead of
blocking the training forever.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from trainmon.config import MonitorConfig
from trainmon.core import step_boundary
from trainmon.core.hooks import Handle
from trainmon.dynamic import ConfigStager, ConfigWatcher, Decision, WatchSettings
from trainmon.errors import ConfigError
from trainmon.runtime.agreement import Agreement
from trainmon.runtime.builder import SessionBuilder
from trainmon.runtime.forked import forget_in_forked_child
from trainmon.runtime.session import StepSession

__all__ = ["Agreement", "DynamicDriver", "describe"]

log = logging.getLogger(__name__)


def describe(cfg: MonitorConfig) -> str:
    """What a config collects, in one log line."""
    kinds = [
        k
        for k, on in (
            ("weight grads", cfg.wg_distribution),
            ("optimizer moments", cfg.mv_distribution),
            ("params", cfg.param_distribution),
            ("update ratio", cfg.ur_distribution),
        )
        if on
    ]
    times = "until switched off" if cfg.collect_times is None else f"{cfg.collect_times} time(s)"
    every = f"every {cfg.step_interval} steps" if cfg.step_interval > 1 else "every step"
    targets = ", ".join(cfg.targets) if cfg.targets else "all"
    return (
        f"{', '.join(kinds) or 'nothing'}; ops {', '.join(cfg.ops)}; targets {targets}; "
        f"from step {cfg.start_step} {every}, {times}; format {', '.join(cfg.format)}"
    )


class DynamicDriver:
    """Owns the step boundary of a dynamic-mode ``TrainerMon`` and the session of each period.

    ``initial`` is the config as loaded at start (used if the file cannot be read at once).
    """

    def __init__(
        self, builder: SessionBuilder, initial: MonitorConfig, settings: WatchSettings, start_iteration: int = 0
    ):
        self.builder = builder
        self.config_file: Path = builder.config_file
        self.step = start_iteration  # the step that runs next
        self.agreement = Agreement(builder.process_group, settings.timeout_s)
        builder.agreement = self.agreement  # escalations (runtime.escalation) agree over it too
        self.stager: ConfigStager | None = None
        self.watcher: ConfigWatcher | None = None
        self.session: StepSession | None = None
        self.config: MonitorConfig | None = None
        self.applied = 0  # version of the decision in force
        self.broken = False
        self._warned_steps = False
        if self.agreement.is_source:
            self.stager = ConfigStager(self.config_file, builder.validate_file, settings.settle_s)
            if settings.watch:  # started before the first read, so no edit falls between the two
                self.watcher = ConfigWatcher(self.stager, settings).start()
            self.stager.stage_now(fallback=initial)
            self._log(
                "watching %s (%s observer); a saved change applies at the next step boundary",
                self.config_file,
                self.watcher.kind if self.watcher else "no",
            )
        optimizer = builder.attachment.optimizer
        self._handle: Handle | None = None
        if optimizer is not None:
            self._handle = step_boundary.subscribe(optimizer, self.before_step, self.after_step, entry=self.step_entry)
        self._decide()
        forget_in_forked_child(self)

    def forget_parent(self) -> None:
        """In a forked child (``runtime.forked``): the watcher, gloo group and session are the
        parent's; decide, watch and record nothing."""
        self.broken, self.watcher, self.stager, self.session = True, None, None, None
        self.agreement.local, self.agreement.group = True, None

    # -- the step boundary ----------------------------------------------------------------------
    def step_entry(self) -> None:
        if self.session is not None:
            self.session.step_entry()

    def before_step(self) -> None:
        if self.session is not None:
            self.session.before_step()

    def after_step(self) -> None:
        session = self.session
        if session is not None:
            session.after_step()
        self.step += 1
        if self.watcher is not None:
            self._check_file(self.watcher)
        if session is not None and session.clock.finished:
            self._stop(f"collect_times ({session.ctx.config.collect_times}) reached")
        self._decide()

    def _check_file(self, watcher: ConfigWatcher) -> None:
        """The boundary's look for an edit no observer reported; a failure costs only that look
        (this runs inside the optimizer step: it must never raise into training)."""
        try:
            watcher.check_file(time.monotonic())
        except Exception:
            log.debug("trainmon: dynamic: checking %s at the step boundary failed", self.config_file, exc_info=True)

    def _decide(self) -> None:
        if self.broken:
            return
        staged = self.stager.decision if self.stager is not None else None
        try:
            version, source_step = self.agreement.version(staged.version if staged else 0, self.step)
            if source_step != self.step and not self._warned_steps:
                self._warned_steps = True
                log.warning(
                    "trainmon: dynamic: this rank is at step %d but rank 0 is at step %d; "
                    "switching follows rank 0's boundaries",
                    self.step,
                    source_step,
                )
            if version == self.applied:
                return
            decision: Decision = self.agreement.value(staged)
            self._apply(decision)
        except Exception as exc:
            self._give_up(exc)

    # -- switching --------------------------------------------------------------------------------
    def _apply(self, decision: Decision) -> None:
        self.applied = decision.version
        if not decision.on:
            if self.session is not None:
                self._stop(f"config version {decision.version} sets dynamic_on false")
            else:
                self._tell("step %d: config version %d has dynamic_on false: staying off", self.step, decision.version)
            return
        cfg = decision.config
        assert cfg is not None  # decision.on
        # collect_times counts from this switch; a start_step already passed means "from now".
        cfg = dataclasses.replace(cfg, start_step=max(cfg.start_step, self.step))
        new = self._build(cfg)
        if not self.agreement.all_true(new is not None):
            if new is not None:
                new.close()
            self._tell(
                "config version %d is NOT applied: it failed on some rank (see that rank's "
                "log); monitoring continues as it was",
                decision.version,
            )
            return
        assert new is not None  # all_true above: built on every rank, this one included
        if self.session is not None:
            self.session.close()
        self.session, self.config = new, cfg
        self._tell(
            "step %d: collecting with config version %d of %s: %s; into %s",
            self.step,
            decision.version,
            cfg.source or self.config_file,
            describe(cfg),
            self.builder.run_dir,
        )
        if new.clock.finished:
            self._stop("nothing to collect")

    def _build(self, cfg: MonitorConfig) -> StepSession | None:
        try:
            return self.builder.build(cfg, first_step=self.step)
        except ConfigError as exc:
            log.error("trainmon: dynamic: config not applied on this rank: %s", exc)
        except Exception:
            log.exception("trainmon: dynamic: starting monitoring failed on this rank")
        return None

    def _stop(self, reason: str) -> None:
        session, self.session = self.session, None
        if session is None:
            return
        collected = session.clock.collected
        session.close()
        self._tell(
            "step %d: monitoring stopped (%s) after %d collected step(s); idle until the config file changes",
            self.step,
            reason,
            collected,
        )

    def _give_up(self, exc: BaseException) -> None:
        self.broken = True
        log.error(
            "trainmon: dynamic: agreeing with the other ranks failed at step %d (%s: %s); "
            "dynamic monitoring is switched off on this rank, training continues",
            self.step,
            type(exc).__name__,
            exc,
        )
        self._stop("dynamic mode failed")
        self._stop_watching()

    def _log(self, msg: str, *args: Any) -> None:
        if self.agreement.is_source:
            log.info("trainmon: dynamic: " + msg, *args)

    def _tell(self, msg: str, *args: Any) -> None:
        """A switch the user asked for by editing the file: at WARNING, so it reaches stderr
        even in a script that configured no logging (Python's last-resort handler prints
        WARNING and above); once per change, on rank 0 only."""
        if self.agreement.is_source:
            log.warning("trainmon: dynamic: " + msg, *args)

    def _stop_watching(self) -> None:
        if self.watcher is not None:
            watcher, self.watcher = self.watcher, None
            watcher.stop()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._stop_watching()
        session, self.session = self.session, None
        if session is not None:
            session.close()
        self.agreement.close()
