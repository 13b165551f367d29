"""``TrainerMon``: the two-line front users know from msprobe.

    monitor = TrainerMon("monitor_config.json")
    monitor.set_monitor(model, grad_acc_steps=4, optimizer=optimizer)

Orchestration only: configuration and output are resolved here, the work happens in the
collectors, the stats engine and the sinks (see ``session``).
"""
from __future__ import annotations

import atexit
import logging
import os
import weakref
from pathlib import Path
from typing import Any, Callable, Sequence

import torch.nn as nn

from trainmon import _dist
from trainmon.collectors import CollectorContext
from trainmon.config import MonitorConfig, load_config
from trainmon.dynamic import WatchSettings, dynamic_requested
from trainmon.errors import ConfigError
from trainmon.features import unsupported_problems
from trainmon.integrations import select_integration
from trainmon.naming import TargetMatcher, module_names, tracked_params
from trainmon.output import create_run_dir, output_root, rank_dir
from trainmon.schedule import Schedule, StepClock
from trainmon.session import Session
from trainmon.sinks import create_sink
from trainmon.sinks.base import NullSink, Sink, SinkOptions
from trainmon.stats.engine import StatsEngine

__all__ = ["TrainerMon"]

log = logging.getLogger(__name__)


class TrainerMon:
    """Monitor of one training job.

    Args:
        config_file_path: the JSON config; a bad config raises ``ConfigError`` here.
        process_group: the group whose ranks share one run directory (default: world).
        params_have_main_grad: read ``param.main_grad`` (Megatron) instead of ``param.grad``;
            ``None`` detects it (every trainable param carries ``main_grad``).
    """

    def __init__(self, config_file_path: str | os.PathLike, process_group: Any = None,
                 params_have_main_grad: bool | None = None):
        self.config_file_path = Path(config_file_path)
        # DYNAMIC_MONITOR is read once, here (as msprobe does); see trainmon.dynamic_controller.
        self.dynamic = dynamic_requested()
        self.watch_settings = WatchSettings.from_env() if self.dynamic else None
        self.config: MonitorConfig = load_config(self.config_file_path)
        problems = unsupported_problems(self.config)
        if problems:
            raise ConfigError(str(self.config_file_path), problems)
        if self.config.dynamic_on and not self.dynamic:
            log.warning("trainmon: %s sets dynamic_on, which has an effect only with DYNAMIC_MONITOR=true "
                        "in the environment; monitoring with this config from the start",
                        self.config_file_path)
        self.process_group = process_group
        self.params_have_main_grad = params_have_main_grad
        self.run_dir: Path | None = None
        self._session: Session | None = None
        self._controller = None          # DynamicController in dynamic mode
        self._attach_args: tuple | None = None
        self._names: list[tuple[int, str]] = []
        self._watch_file = True          # tests of the switching logic drive the stager themselves
        self._output_resolved = False
        if _dist.initialized():
            self._resolve_output()
        _register_exit_close(self)

    # -- output ------------------------------------------------------------------------------
    def _resolve_output(self) -> None:
        if not self._output_resolved:
            meta = {"world_size": _dist.world_size(self.process_group),
                    "config_file": str(self.config_file_path.resolve())}
            self.run_dir = create_run_dir(output_root(), self.process_group, meta)
            self._output_resolved = True

    @property
    def rank(self) -> int:
        return _dist.rank()

    def _records_here(self, cfg: MonitorConfig, integration) -> bool:
        """Ranks outside ``module_ranks`` do no work at all, unless the stack's stats need every
        rank's shard (then they compute and merge, but do not write)."""
        ranks = cfg.module_ranks
        return not ranks or self.rank in ranks or integration.needs_all_ranks

    def _make_sink(self, cfg: MonitorConfig) -> Sink:
        if cfg.module_ranks and self.rank not in cfg.module_ranks:
            return NullSink()
        path = rank_dir(self.run_dir, self.rank) if self.run_dir is not None else None
        if path is None:
            return NullSink()
        options = SinkOptions(rank_dir=path, rank=self.rank, ndigits=cfg.ndigits,
                              step_count_per_record=cfg.step_count_per_record)
        return create_sink(cfg.format, options, extra_sinks=_alert_sinks(cfg, options))

    # -- public API ----------------------------------------------------------------------------
    def set_monitor(self, model: nn.Module | Sequence[nn.Module], grad_acc_steps: int | Callable[[], int] = 1,
                    optimizer: Any = None, dp_group: Any = None, tp_group: Any = None,
                    start_iteration: int = 0) -> "TrainerMon":
        """Attach to a model (or list of virtual-pipeline chunks) and its optimizer.

        The optimizer's ``step()`` is the step boundary; ``grad_acc_steps`` (an int, or a callable
        read once per step) says how many backward passes make one step.
        """
        self.close()
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        self._names = module_names(chunks) + [(p.vpp_stage, p.name) for p in tracked_params(chunks)]
        self._attach_args = (chunks, grad_acc_steps, optimizer, dp_group, tp_group)
        if not self.dynamic:
            self._check_targets(self.config, str(self.config_file_path))
        self._resolve_output()
        if optimizer is None:
            log.warning("trainmon: set_monitor got no optimizer: call monitor.step() after each "
                        "optimizer step, or nothing is recorded")
        if self.dynamic:
            from trainmon.dynamic_controller import DynamicController
            self._controller = DynamicController(self, start_iteration, watch=self._watch_file)
            return self
        self._session = self.new_session(self.config, start_iteration, step_optimizer=optimizer)
        if self.rank == 0:
            log.info("trainmon: monitoring %d params (%s) into %s", len(self._session.ctx.params),
                     ", ".join(c.name for c in self._session.collectors) or "nothing", self.run_dir)
        return self

    def _check_targets(self, cfg: MonitorConfig, source: str) -> TargetMatcher:
        matcher = TargetMatcher(cfg.targets)
        if not matcher.selects_all:
            matcher.check_all_used(self._names, source)
        return matcher

    def validate_file(self, path: Path) -> MonitorConfig:
        """The config in ``path`` if this monitor can run it on this model, else ``ConfigError``."""
        cfg = load_config(path)
        problems = unsupported_problems(cfg)
        if problems:
            raise ConfigError(str(path), problems)
        self._check_targets(cfg, str(path))
        return cfg

    def new_session(self, cfg: MonitorConfig, first_step: int, step_optimizer: Any = None) -> Session:
        """A session collecting ``cfg`` from step ``first_step`` on the model of ``set_monitor``.

        With ``step_optimizer`` the session wraps that optimizer's step itself; without, whoever
        owns the step boundary (``monitor.step()``, the dynamic controller) drives it.
        """
        chunks, grad_acc_steps, optimizer, dp_group, tp_group = self._attach_args
        matcher = self._check_targets(cfg, cfg.source or str(self.config_file_path))
        ctx = self._context(cfg, chunks, matcher, grad_acc_steps, optimizer, dp_group, tp_group, first_step)
        return Session(ctx, self._make_sink(cfg), step_optimizer,
                       collect=self._records_here(cfg, ctx.integration))

    def _context(self, cfg, chunks, matcher, grad_acc_steps, optimizer, dp_group, tp_group, start_iteration):
        params = [p for p in tracked_params(chunks) if matcher.matches(p.name, p.vpp_stage)]
        use_main_grad = self.params_have_main_grad
        if use_main_grad is None:
            use_main_grad = bool(params) and all(hasattr(p.param, "main_grad") for p in params)
        distributed = _dist.world_size(dp_group) > 1
        clock = StepClock(Schedule(cfg.start_step, cfg.step_interval, cfg.collect_times),
                          grad_acc_steps, first_step=start_iteration)
        integration = select_integration(chunks, optimizer, use_main_grad)
        params = integration.display_params(params, cfg)
        integration.tp_group = tp_group  # TP-sharded params merge over it (Integration.tp_view)
        return CollectorContext(config=cfg, chunks=chunks, params=params, matcher=matcher,
                                engine=StatsEngine(cfg.ops, cfg.eps), clock=clock, optimizer=optimizer,
                                use_main_grad=use_main_grad, distributed=distributed,
                                dp_group=dp_group, tp_group=tp_group, integration=integration,
                                run_dir=self.run_dir, rank=self.rank)

    def step(self) -> None:
        """Mark a step boundary by hand (only when no optimizer was given to ``set_monitor``)."""
        if self._controller is not None:
            self._controller.before_step()
            self._controller.after_step()
        elif self._session is not None:
            self._session.before_step()
            self._session.after_step()

    @property
    def current_step(self) -> int | None:
        if self._controller is not None:
            return self._controller.step
        return None if self._session is None else self._session.clock.step

    def close(self) -> None:
        """Flush everything and remove every hook and wrapper.  Idempotent."""
        if self._controller is not None:
            controller, self._controller = self._controller, None
            controller.close()
        if self._session is not None:
            session, self._session = self._session, None
            session.close()

    def __enter__(self) -> "TrainerMon":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _alert_sinks(cfg: MonitorConfig, options: SinkOptions) -> list[Sink]:
    if not cfg.alert.rules:
        return []
    from trainmon.sinks.alerts import AlertSettings, AlertSink

    return [AlertSink(options, AlertSettings.from_alert_config(cfg.alert))]


def _register_exit_close(monitor: TrainerMon) -> None:
    ref = weakref.ref(monitor)

    def close_at_exit() -> None:
        m = ref()
        if m is not None:
            m.close()

    atexit.register(close_at_exit)
