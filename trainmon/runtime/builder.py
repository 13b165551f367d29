"""Building a :class:`Session` for a config on the model that ``set_monitor`` attached.

The static driver builds one session at ``set_monitor``; the dynamic driver builds one each time
the config file switches monitoring on.  Both go through :class:`SessionBuilder`, so a session
is built the same way whoever asks for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.nn as nn

from trainmon.collectors import CollectorContext
from trainmon.config import MonitorConfig, load_config
from trainmon.core import dist as _dist
from trainmon.core.naming import TargetMatcher, module_names, selected_params, tracked_params
from trainmon.core.schedule import Schedule, StepClock
from trainmon.errors import ConfigError
from trainmon.families import FAMILIES, Family
from trainmon.integrations import select_integration
from trainmon.runtime.features import sink_settings, unsupported_problems
from trainmon.runtime.run_dir import rank_dir
from trainmon.runtime.session import Session, StepSession
from trainmon.sinks import create_sink
from trainmon.sinks.base import NullSink, Sink, SinkOptions
from trainmon.stats.engine import StatsEngine

if TYPE_CHECKING:
    from trainmon.runtime.agreement import Agreement
    from trainmon.sinks.alerts import AlertListener

__all__ = ["Attachment", "SessionBuilder"]

log = logging.getLogger(__name__)

# Equal on every rank by construction under plain DDP: the averaged grad and everything the
# optimizer computes from it (``FamilyInfo.replicated``).
REPLICATED_UNDER_DDP: frozenset[str] = frozenset(
    {str(Family.GRAD_REDUCED)} | {str(f) for f, info in FAMILIES.items() if info.replicated}
)


@dataclass(frozen=True)
class Attachment:
    """What ``set_monitor`` was given."""

    chunks: Sequence[nn.Module]
    grad_acc_steps: int | Callable[[], int]
    optimizer: Any
    dp_group: Any
    tp_group: Any


class SessionBuilder:
    """Sessions for one attachment, one config file and one run directory."""

    def __init__(
        self,
        attachment: Attachment,
        config_file: Path,
        process_group: Any = None,
        params_have_main_grad: bool | None = None,
    ):
        self.attachment = attachment
        self.config_file = config_file
        self.process_group = process_group
        self.params_have_main_grad = params_have_main_grad
        self.run_dir: Path | None = None
        self.agreement: Agreement | None = None  # the dynamic driver's Agreement, shared with escalations
        self.summary: Any = None  # a sinks.summary.SummaryBoard: the framework callbacks' forward_to_loggers
        chunks = attachment.chunks
        self._names = module_names(chunks) + [(p.vpp_stage, p.name) for p in tracked_params(chunks)]

    @property
    def rank(self) -> int:
        return _dist.rank()

    def check_targets(self, cfg: MonitorConfig, source: str) -> TargetMatcher:
        """The config's target matcher; ``ConfigError`` naming ``source`` if a target matches nothing."""
        matcher = TargetMatcher(cfg.targets)
        if not matcher.selects_all:
            matcher.check_all_used(self._names, source)
        if cfg.grad_probe is not None and cfg.grad_probe.param_list:
            # names and their module prefixes: did-you-mean offers both
            params = sorted(
                {
                    (p.vpp_stage, ".".join(p.name.split(".")[:k]))
                    for p in tracked_params(self.attachment.chunks)
                    if matcher.matches(p.name, p.vpp_stage)
                    for k in range(1, p.name.count(".") + 2)
                }
            )
            TargetMatcher(cfg.grad_probe.param_list).check_all_used(
                params, source, key="grad_probe.param_list", what="trainable parameter (selected by targets)"
            )
        return matcher

    def validate_file(self, path: Path) -> MonitorConfig:
        """The config in ``path`` if a session can run it on this model, else ``ConfigError``."""
        cfg = load_config(path)
        problems = unsupported_problems(cfg)
        if problems:
            raise ConfigError(str(path), problems)
        self.check_targets(cfg, str(path))
        return cfg

    def build(self, cfg: MonitorConfig, first_step: int, step_optimizer: Any = None) -> StepSession:
        """A session collecting ``cfg`` from step ``first_step``.

        With ``step_optimizer`` the session wraps that optimizer's step itself; without, whoever
        owns the step boundary (``monitor.step()``, the dynamic driver) drives it.  A config with
        ``on_anomaly`` gets an ``EscalatingSession`` (``runtime.escalation``), which looks like one.
        """
        if cfg.on_anomaly is not None:
            from trainmon.runtime.escalation import EscalatingSession

            return EscalatingSession(self, cfg, first_step, step_optimizer)
        return self.build_session(cfg, first_step, step_optimizer)

    def build_session(
        self,
        cfg: MonitorConfig,
        first_step: int,
        step_optimizer: Any = None,
        *,
        latch: AlertListener | None = None,
        wrap_sink: Callable[[Sink], Sink] | None = None,
    ) -> Session:
        """One plain session; ``latch`` (``runtime.alert_latch.AlertLatch``) is fed by its alert sink, ``wrap_sink``
        wraps its sink (the flight recorder's ring)."""
        matcher = self.check_targets(cfg, cfg.source or str(self.config_file))
        self._warn_unrecorded(cfg)
        ctx = self._context(cfg, matcher, first_step)
        sink = self._make_sink(cfg, ctx.integration, latch)
        if self.summary is not None and not isinstance(sink, NullSink):
            sink = self.summary.watch(sink)  # summarized on the writer thread, for the trainer's loggers
        return Session(
            ctx,
            wrap_sink(sink) if wrap_sink is not None else sink,
            step_optimizer,
            collect=self._records_here(cfg, ctx.integration),
        )

    def _warn_unrecorded(self, cfg: MonitorConfig) -> None:
        """msprobe's L2 features load (so its configs run unchanged) but are not built: say so once."""
        keys = cfg.unrecorded_keys()
        if keys and keys != getattr(self, "_warned_unrecorded", None):
            self._warned_unrecorded = keys
            log.warning(
                "trainmon: %s (msprobe's L2 attention/linear features) accepted but not recorded: "
                "no attention-score or linear-hook statistics are written for them; every other "
                "key of %s is honoured",
                ", ".join(keys),
                cfg.source or self.config_file,
            )

    def _context(self, cfg: MonitorConfig, matcher: TargetMatcher, first_step: int) -> CollectorContext:
        a = self.attachment
        params = selected_params(a.chunks, matcher)  # runtime.param_watch adds those joining later
        use_main_grad = self.params_have_main_grad
        if use_main_grad is None:
            use_main_grad = bool(params) and all(hasattr(p.param, "main_grad") for p in params)
        clock = StepClock(
            Schedule(cfg.start_step, cfg.step_interval, cfg.collect_times), a.grad_acc_steps, first_step=first_step
        )
        integration = select_integration(a.chunks, a.optimizer, use_main_grad)
        params = integration.display_params(params, cfg)
        integration.tp_group = a.tp_group  # TP-sharded params merge over it (Integration.tp_view)
        return CollectorContext(
            config=cfg,
            chunks=a.chunks,
            params=params,
            matcher=matcher,
            engine=StatsEngine(cfg.ops, cfg.eps),
            clock=clock,
            optimizer=a.optimizer,
            use_main_grad=use_main_grad,
            distributed=_dist.world_size(a.dp_group) > 1,
            dp_group=a.dp_group,
            tp_group=a.tp_group,
            integration=integration,
            run_dir=self.run_dir,
            rank=self.rank,
        )

    def _records_here(self, cfg: MonitorConfig, integration: Any) -> bool:
        """Ranks outside ``module_ranks`` do no work at all, unless the stack's stats need every
        rank's shard (then they compute and merge, but do not write)."""
        ranks = cfg.module_ranks
        return not ranks or self.rank in ranks or integration.needs_all_ranks

    def _replicated_elsewhere(self, cfg: MonitorConfig, integration: Any) -> frozenset[str]:
        """Families this rank leaves to data-parallel rank 0 under ``replicated_once``."""
        group = self.attachment.dp_group
        if not cfg.replicated_once or _dist.world_size(group) < 2 or _dist.rank(group) == 0:
            return frozenset()
        if getattr(integration, "name", "") != "torch_ddp":
            log.warning(
                "trainmon: replicated_once applies to plain torch DDP only (here: %s); every rank writes every family",
                getattr(integration, "name", "no data-parallel wrapper"),
            )
            return frozenset()
        return REPLICATED_UNDER_DDP

    def _make_sink(self, cfg: MonitorConfig, integration: Any = None, latch: AlertListener | None = None) -> Sink:
        if cfg.module_ranks and self.rank not in cfg.module_ranks:
            return NullSink()
        path = rank_dir(self.run_dir, self.rank) if self.run_dir is not None else None
        if path is None:
            return NullSink()
        options = SinkOptions(
            rank_dir=path, rank=self.rank, ndigits=cfg.ndigits, step_count_per_record=cfg.step_count_per_record
        )
        return create_sink(
            cfg.format,
            options,
            extra_sinks=_alert_sinks(cfg, options, latch),
            drop_families=self._replicated_elsewhere(cfg, integration),
            settings=sink_settings(cfg),  # each sink's own config block, checked by its schema
        )


def _alert_sinks(cfg: MonitorConfig, options: SinkOptions, latch: AlertListener | None = None) -> list[Sink]:
    if not cfg.alert.rules:
        return []
    from trainmon.sinks.alerts import AlertSettings, AlertSink

    return [AlertSink(options, AlertSettings.from_alert_config(cfg.alert), latch=latch)]
