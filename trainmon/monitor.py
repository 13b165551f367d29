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
        self.config: MonitorConfig = load_config(self.config_file_path)
        problems = unsupported_problems(self.config)
        if problems:
            raise ConfigError(str(self.config_file_path), problems)
        self.process_group = process_group
        self.params_have_main_grad = params_have_main_grad
        self.run_dir: Path | None = None
        self._session: Session | None = None
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

    def _make_sink(self) -> Sink:
        cfg = self.config
        if cfg.module_ranks and self.rank not in cfg.module_ranks:
            return NullSink()
        path = rank_dir(self.run_dir, self.rank) if self.run_dir is not None else None
        if path is None:
            return NullSink()
        options = SinkOptions(rank_dir=path, rank=self.rank, ndigits=cfg.ndigits,
                              step_count_per_record=cfg.step_count_per_record)
        return create_sink(cfg.format, options)

    # -- public API ----------------------------------------------------------------------------
    def set_monitor(self, model: nn.Module | Sequence[nn.Module], grad_acc_steps: int | Callable[[], int] = 1,
                    optimizer: Any = None, dp_group: Any = None, tp_group: Any = None,
                    start_iteration: int = 0) -> "TrainerMon":
        """Attach to a model (or list of virtual-pipeline chunks) and its optimizer.

        The optimizer's ``step()`` is the step boundary; ``grad_acc_steps`` (an int, or a callable
        read once per step) says how many backward passes make one step.
        """
        if self._session is not None:
            self._session.close()
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        matcher = TargetMatcher(self.config.targets)
        if not matcher.selects_all:
            names = module_names(chunks) + [(p.vpp_stage, p.name) for p in tracked_params(chunks)]
            matcher.check_all_used(names, str(self.config_file_path))
        self._resolve_output()
        ctx = self._context(chunks, matcher, grad_acc_steps, optimizer, dp_group, tp_group, start_iteration)
        if optimizer is None:
            log.warning("trainmon: set_monitor got no optimizer: call monitor.step() after each "
                        "optimizer step, or nothing is recorded")
        self._session = Session(ctx, self._make_sink(), optimizer)
        if self.rank == 0:
            log.info("trainmon: monitoring %d params (%s) into %s", len(ctx.params),
                     ", ".join(c.name for c in self._session.collectors) or "nothing", self.run_dir)
        return self

    def _context(self, chunks, matcher, grad_acc_steps, optimizer, dp_group, tp_group, start_iteration):
        cfg = self.config
        params = [p for p in tracked_params(chunks) if matcher.matches(p.name, p.vpp_stage)]
        use_main_grad = self.params_have_main_grad
        if use_main_grad is None:
            use_main_grad = bool(params) and all(hasattr(p.param, "main_grad") for p in params)
        distributed = _dist.world_size(dp_group) > 1
        clock = StepClock(Schedule(cfg.start_step, cfg.step_interval, cfg.collect_times),
                          grad_acc_steps, first_step=start_iteration)
        integration = select_integration(chunks, optimizer, use_main_grad)
        integration.tp_group = tp_group  # TP-sharded params merge over it (Integration.tp_view)
        return CollectorContext(config=cfg, chunks=chunks, params=params, matcher=matcher,
                                engine=StatsEngine(cfg.ops, cfg.eps), clock=clock, optimizer=optimizer,
                                use_main_grad=use_main_grad, distributed=distributed,
                                dp_group=dp_group, tp_group=tp_group, integration=integration)

    def step(self) -> None:
        """Mark a step boundary by hand (only when no optimizer was given to ``set_monitor``)."""
        if self._session is not None:
            self._session.before_step()
            self._session.after_step()

    @property
    def current_step(self) -> int | None:
        return None if self._session is None else self._session.clock.step

    def close(self) -> None:
        """Flush everything and remove every hook and wrapper.  Idempotent."""
        if self._session is not None:
            session, self._session = self._session, None
            session.close()

    def __enter__(self) -> "TrainerMon":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _register_exit_close(monitor: TrainerMon) -> None:
    ref = weakref.ref(monitor)

    def close_at_exit() -> None:
        m = ref()
        if m is not None:
            m.close()

    atexit.register(close_at_exit)
