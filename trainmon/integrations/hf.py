"""The transformers ``Trainer``: one callback instead of the two lines.

    from trainmon.integrations.hf import TrainerMonCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[TrainerMonCallback("monitor.json")])

The callback attaches in ``on_train_begin``: by then the ``Trainer`` has created its optimizer
and scheduler and run ``accelerator.prepare``, and the callback is handed the model and the
optimizer (accelerate's ``AcceleratedOptimizer``, whose inner torch optimizer is the step
boundary: it steps once per ``gradient_accumulation_steps`` micro-batches, after the Trainer's
``max_grad_norm`` clipping, so ``grad_reduced`` is the clipped grad the update uses and
``grad_unreduced`` the accumulated grad before clipping).  Steps are the Trainer's
``global_step`` numbers (also when resuming); an epoch's shorter last step is counted right.
``on_train_end`` flushes and removes every hook.  A Trainer running DeepSpeed does not give
callbacks the engine that owns ZeRO's partitions: the callback then records nothing and says so
(attach ``TrainerMon`` to the engine instead).

transformers is not a dependency of trainmon; this module needs it (``pip install "trainmon[hf]"``)
and without it fails to import with one line saying so.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from trainmon.core.schedule import EpochAccumulation
from trainmon.monitor import TrainerMon

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError("trainmon.integrations.hf needs transformers: pip install 'trainmon[hf]'") from exc

__all__ = ["TrainerMonCallback"]

log = logging.getLogger(__name__)


class TrainerMonCallback(TrainerCallback):
    """Monitors a ``transformers.Trainer`` run with the config at ``config_path``.

    Args:
        config_path: the JSON config (a bad config raises ``ConfigError`` here, before training).
        **monitor_kwargs: passed to ``TrainerMon`` (``process_group``, ``params_have_main_grad``).
    """

    def __init__(self, config_path: str | os.PathLike[str], **monitor_kwargs: Any):
        self.monitor = TrainerMon(config_path, **monitor_kwargs)

    def on_train_begin(
        self,
        args: Any,
        state: Any,
        control: Any,
        model: Any = None,
        optimizer: Any = None,
        train_dataloader: Any = None,
        **kwargs: Any,
    ) -> None:
        if model is None or optimizer is None:
            log.warning(
                "trainmon: the Trainer gave the callback no %s; nothing is monitored",
                "model" if model is None else "optimizer",
            )
            return
        if _runs_deepspeed(optimizer):
            return
        acc = EpochAccumulation(
            args.gradient_accumulation_steps,
            _batches_per_epoch(train_dataloader),
            lambda: self.monitor.current_step,
            first_step=state.global_step,
        )
        self.monitor.set_monitor(model, grad_acc_steps=acc, optimizer=optimizer, start_iteration=state.global_step)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        # The Trainer hands callbacks no per-step loss: ``logs["loss"]`` is its mean over the last
        # ``logging_steps`` steps (per step with ``logging_steps=1``).  on_log runs after the step,
        # so record_loss files it under the step just finished.
        loss = (logs or {}).get("loss")
        if isinstance(loss, (int, float)):
            self.monitor.record_loss(float(loss))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.monitor.close()


def _batches_per_epoch(dataloader: Any) -> int | None:
    try:
        return len(dataloader) if dataloader is not None else None
    except TypeError:  # an iterable dataset: the Trainer then never shortens a step
        return None


def _runs_deepspeed(optimizer: Any) -> bool:
    inner = getattr(optimizer, "optimizer", None)
    if type(optimizer).__name__ != "DeepSpeedOptimizerWrapper" and not type(inner).__module__.startswith("deepspeed"):
        return False
    log.warning(
        "trainmon: this Trainer runs DeepSpeed and callbacks are not given its engine, without which "
        "ZeRO's sharded grads and moments cannot be read right; nothing is monitored. Attach "
        "TrainerMon to the engine instead (see docs/frameworks.md)"
    )
    return True
