"""``TrainerMon``: the two-line front users know from msprobe.

    monitor = TrainerMon("monitor_config.json")
    monitor.set_monitor(model, grad_acc_steps=4, optimizer=optimizer)

A thin facade: it loads the config, agrees on the run directory and hands the step boundary to
one step driver (``runtime.driver.StaticDriver``, or ``runtime.dynamic_driver.DynamicDriver``
with ``DYNAMIC_MONITOR=true``).  Sessions are built by ``runtime.builder.SessionBuilder``.
"""

from __future__ import annotations

import atexit
import logging
import os
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch.nn as nn

from trainmon.config import MonitorConfig, load_config
from trainmon.core import dist as _dist
from trainmon.core.hooks import step_optimizer
from trainmon.dynamic import WatchSettings, dynamic_requested
from trainmon.errors import ConfigError
from trainmon.runtime.builder import Attachment, SessionBuilder
from trainmon.runtime.driver import StaticDriver, StepDriver
from trainmon.runtime.dynamic_driver import DynamicDriver
from trainmon.runtime.features import unsupported_problems
from trainmon.runtime.run_dir import create_run_dir, first_step, output_root

__all__ = ["TrainerMon"]

log = logging.getLogger(__name__)


class TrainerMon:
    """Monitor of one training job.

    Args:
        config_file_path: the JSON config; a bad config raises ``ConfigError`` here.
        process_group: the group whose ranks share one run directory (default: world).
        params_have_main_grad: read ``param.main_grad`` (Megatron) instead of ``param.grad``;
            ``None`` detects it (every trainable param carries ``main_grad``).
        opt_ty: accepted for msprobe's four-argument call and ignored: the optimizer's kind
            is read from the optimizer itself (``docs/msprobe_migration.md``).
    """

    def __init__(
        self,
        config_file_path: str | os.PathLike[str],
        process_group: Any = None,
        params_have_main_grad: bool | None = None,
        opt_ty: str | None = None,
    ):
        self.config_file_path = Path(config_file_path)
        # DYNAMIC_MONITOR is read once, here (as msprobe does); see runtime.dynamic_driver.
        self.dynamic = dynamic_requested()
        self.watch_settings: WatchSettings | None = WatchSettings.from_env() if self.dynamic else None
        self.config: MonitorConfig = load_config(self.config_file_path)
        problems = unsupported_problems(self.config)
        if problems:
            raise ConfigError(str(self.config_file_path), problems)
        if self.config.dynamic_on and not self.dynamic:
            log.warning(
                "trainmon: %s sets dynamic_on, which has an effect only with DYNAMIC_MONITOR=true "
                "in the environment; monitoring with this config from the start",
                self.config_file_path,
            )
        self.process_group = process_group
        self.params_have_main_grad = params_have_main_grad
        self.run_dir: Path | None = None
        self._driver: StepDriver | None = None
        self._output_resolved = False
        # A sinks.summary.SummaryBoard set by a framework callback (forward_to_loggers) before set_monitor.
        self.summary: Any = None
        if _dist.initialized():
            self._resolve_output()
        _register_exit_close(self)

    def _resolve_output(self) -> None:
        if not self._output_resolved:
            meta = {
                "world_size": _dist.world_size(self.process_group),
                "config_file": str(self.config_file_path.resolve()),
            }
            self.run_dir = create_run_dir(output_root(), self.process_group, meta)
            self._output_resolved = True

    @property
    def rank(self) -> int:
        return _dist.rank()

    def set_monitor(
        self,
        model: nn.Module | Sequence[nn.Module],
        *positional: Any,
        grad_acc_steps: int | Callable[[], int] = 1,
        optimizer: Any = None,
        dp_group: Any = None,
        tp_group: Any = None,
        start_iteration: int | None = None,
    ) -> TrainerMon:
        """Attach to a model (or list of virtual-pipeline chunks) and its optimizer.

        The optimizer's ``step()`` is the step boundary (any object with a ``step()``: torch
        optimizers, accelerate's and Lightning's wrappers, DeepSpeed's and Megatron's optimizers;
        with a closure, grads are read after the closure's backward); ``grad_acc_steps`` (an int, or a callable
        read once per step) says how many backward passes make one step.

        Positional arguments after ``model`` follow msprobe's order, ``(optimizer,
        grad_acc_steps, tp_group, dp_group, start_iteration)``, when the first is an optimizer,
        else trainmon's earlier order ``(grad_acc_steps, optimizer, dp_group, tp_group,
        start_iteration)``; keywords mean the same either way.
        """
        if positional:
            named = {"grad_acc_steps": grad_acc_steps, "optimizer": optimizer, "dp_group": dp_group,
                     "tp_group": tp_group, "start_iteration": start_iteration}  # fmt: skip
            named.update(_positional_arguments(positional, named))
            grad_acc_steps, optimizer, dp_group, tp_group, start_iteration = named.values()
        self.close()
        if optimizer is not None:
            optimizer = step_optimizer(optimizer)  # accelerate's / Lightning's facades -> the torch optimizer
        chunks: list[nn.Module] = list(model) if isinstance(model, (list, tuple)) else [model]  # type: ignore[list-item]
        builder = SessionBuilder(
            Attachment(chunks, grad_acc_steps, optimizer, dp_group, tp_group),
            self.config_file_path,
            self.process_group,
            self.params_have_main_grad,
        )
        if not self.dynamic:
            builder.check_targets(self.config, str(self.config_file_path))
        self._resolve_output()
        builder.run_dir = self.run_dir
        builder.summary = self.summary
        start_iteration = first_step(self.run_dir, self.rank, start_iteration)  # resume: run_dir.first_step
        if optimizer is None:
            log.warning(
                "trainmon: set_monitor got no optimizer: call monitor.step() after each "
                "optimizer step, or nothing is recorded"
            )
        if self.dynamic:
            assert self.watch_settings is not None  # set with self.dynamic
            self._driver = DynamicDriver(builder, self.config, self.watch_settings, start_iteration)
            return self
        session = builder.build(self.config, start_iteration, step_optimizer=optimizer)
        self._driver = StaticDriver(session)
        if self.rank == 0:
            log.info(
                "trainmon: monitoring %d params (%s) into %s",
                len(session.ctx.params),
                ", ".join(c.name for c in session.collectors) or "nothing",
                self.run_dir,
            )
        return self

    def step(self) -> None:
        """Mark a step boundary by hand (only when no optimizer was given to ``set_monitor``)."""
        if self._driver is not None:
            self._driver.before_step()
            self._driver.after_step()

    def record_loss(self, loss: Any) -> None:
        """Record this micro-batch's (or step's) loss: a tensor or a number; no host sync.

        Family ``loss``, one row per call on collected steps (see ``trainmon.collectors.loss``).
        """
        session = None if self._driver is None else self._driver.session
        if session is not None:
            session.record_loss(loss)

    def collector(self, name: str) -> Any:
        """The active collector called ``name`` (``"comm"``, ``"actv"``, ...), else None."""
        session = None if self._driver is None else self._driver.session
        return None if session is None else next((c for c in session.collectors if c.name == name), None)

    @property
    def current_step(self) -> int | None:
        """The step that runs next (None before ``set_monitor``)."""
        return None if self._driver is None else self._driver.step

    def close(self) -> None:
        """Flush everything and remove every hook and wrapper.  Idempotent."""
        if self._driver is not None:
            driver, self._driver = self._driver, None
            driver.close()

    def __enter__(self) -> TrainerMon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_MSPROBE_ORDER = ("optimizer", "grad_acc_steps", "tp_group", "dp_group", "start_iteration")
_OWN_ORDER = ("grad_acc_steps", "optimizer", "dp_group", "tp_group", "start_iteration")


_DEFAULTS: dict[str, Any] = {"grad_acc_steps": 1, "optimizer": None, "dp_group": None, "tp_group": None,
                              "start_iteration": None}  # fmt: skip


def _positional_arguments(values: tuple[Any, ...], keywords: dict[str, Any]) -> dict[str, Any]:
    """``set_monitor``'s positional arguments by name: msprobe's order when the first is an
    optimizer (``set_monitor(model, optimizer, 8)``), else trainmon's own earlier order."""
    order = _MSPROBE_ORDER if _is_optimizer(values[0]) else _OWN_ORDER
    if len(values) > len(order):
        raise TypeError(f"set_monitor() takes at most {len(order) + 1} positional arguments ({len(values) + 1} given)")
    given = dict(zip(order, values))
    for name in given:
        default = _DEFAULTS[name]
        if keywords[name] is not default and not (default is not None and keywords[name] == default):
            raise TypeError(f"set_monitor() got multiple values for argument '{name}'")
    return given


def _is_optimizer(value: Any) -> bool:
    """An optimizer in ``grad_acc_steps``' place (msprobe's argument order), never an int or a
    callable returning one.  Torch, DeepSpeed and Megatron optimizers have ``step`` and are not
    callable."""
    if value is None or isinstance(value, int):
        return False
    return callable(getattr(value, "step", None)) and (hasattr(value, "param_groups") or not callable(value))


def _register_exit_close(monitor: TrainerMon) -> None:
    ref = weakref.ref(monitor)

    def close_at_exit() -> None:
        m = ref()
        if m is not None:
            m.close()

    atexit.register(close_at_exit)
