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
``on_train_end`` flushes and removes every hook.

A Trainer running DeepSpeed hands callbacks accelerate's ``DeepSpeedOptimizerWrapper`` (whose
``step`` is a no-op: the engine steps inside ``accelerator.backward``) and the bare model, never
the ``DeepSpeedEngine`` that owns ZeRO's partitions and clips inside its optimizer's step.  The
callback finds that engine (the one whose ``optimizer`` is the wrapper's) and attaches to it as
``set_monitor(engine, optimizer=engine.optimizer)`` does, so ``grad_reduced`` is the clipped fp32
grad DeepSpeed's inner optimizer applies and the moments are read from this rank's partitions.

``TrainerMonCallback(path, forward_to_loggers=True)`` also puts a small summary of the last recorded
step (``trainmon.sinks.summary``: by default each tensor's ``grad_reduced`` norm and ``update_ratio``
and the family totals) into the ``logs`` the Trainer hands its callbacks in ``on_log``, so that its
``report_to`` integrations (TensorBoard, W&B, MLflow, ...) log it with the Trainer's loss.  The
callback moves itself ahead of those integrations at train begin (the Trainer puts user callbacks
after them).  The summary is made on trainmon's writer thread; ``on_log`` waits at most
``summary_wait_s`` for the step just finished (then logs the newest finished one, its step in
``trainmon/step``).

transformers is not a dependency of trainmon; this module needs it (``pip install "trainmon[hf]"``)
and without it fails to import with one line saying so.
"""

from __future__ import annotations

import gc
import logging
import os
from typing import Any

from trainmon.core.schedule import EpochAccumulation
from trainmon.monitor import TrainerMon
from trainmon.sinks.summary import PREFIX, SummaryBoard, SummarySpec, summary_spec

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
        forward_to_loggers: also put a summary of the last recorded step into ``on_log``'s
            ``logs`` (for the ``report_to`` integrations): ``True`` (the default summary:
            ``grad_reduced`` norms and ``update_ratio``, per tensor and totals), a family name or a
            list of them (every statistic of those families), or a
            ``trainmon.sinks.summary.SummarySpec``.  Off (``False``) by default.
        summary_wait_s: how long ``on_log`` waits at most for the summary of the step just finished
            (made on the writer thread); after one timeout it stops waiting, with one warning.
        **monitor_kwargs: passed to ``TrainerMon`` (``process_group``, ``params_have_main_grad``).
    """

    def __init__(
        self,
        config_path: str | os.PathLike[str],
        forward_to_loggers: bool | str | list[str] | SummarySpec = False,
        summary_wait_s: float = 2.0,
        **monitor_kwargs: Any,
    ):
        spec = summary_spec(forward_to_loggers)  # a bad selection fails here, before training
        self.monitor = TrainerMon(config_path, **monitor_kwargs)
        self.summary = SummaryBoard(spec) if spec is not None else None
        self.monitor.summary = self.summary
        self.summary_wait_s: float | None = summary_wait_s

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
        if self.summary is not None:
            _run_before_integrations(self)
        if model is None or optimizer is None:
            log.warning(
                "trainmon: the Trainer gave the callback no %s; nothing is monitored",
                "model" if model is None else "optimizer",
            )
            return
        if _runs_deepspeed(optimizer):
            engine = _deepspeed_engine(optimizer)
            if engine is None:
                log.warning(
                    "trainmon: this Trainer runs DeepSpeed but its engine (the one stepping the Trainer's "
                    "optimizer) was not found; nothing is monitored. Attach TrainerMon to the engine instead "
                    "(see docs/frameworks.md)"
                )
                return
            model, optimizer = engine, engine.optimizer
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
        if self.summary is not None and logs is not None:
            self._add_summary(logs)
        loss = (logs or {}).get("loss")
        if isinstance(loss, (int, float)):
            self.monitor.record_loss(float(loss))

    def _add_summary(self, logs: dict) -> None:
        """The newest finished summary into ``logs`` (the integrations log them at the Trainer's
        ``global_step``, which is trainmon's step + 1 after that step, as for the Trainer's loss)."""
        assert self.summary is not None
        if self.summary_wait_s is not None and not self.summary.wait_for_submitted(self.summary_wait_s):
            log.warning(
                "trainmon: the summary for the Trainer's loggers was not ready within summary_wait_s=%ss; "
                "from now on the newest ready one is logged (its step in %s/step), without waiting",
                self.summary_wait_s,
                PREFIX,
            )
            self.summary_wait_s = None
        taken = self.summary.take()
        if taken:
            step, values = taken[-1]  # older ones are in the files; logs holds one value per key
            logs.update(values)
            logs[f"{PREFIX}/step"] = step

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.monitor.close()


def _run_before_integrations(callback: TrainerCallback) -> None:
    """Move ``callback`` ahead of the Trainer's ``report_to`` integrations in its callback list, so
    that what it adds to ``on_log``'s ``logs`` reaches them.  Callbacks are handed neither the
    Trainer nor its ``CallbackHandler``: the list is found among the callback's referrers (once,
    at train begin)."""
    for ref in gc.get_referrers(callback):
        if not isinstance(ref, list) or not all([isinstance(c, TrainerCallback) for c in ref]):
            continue
        integrations = [i for i, c in enumerate(ref) if type(c).__module__.startswith("transformers.integrations")]
        if integrations and ref.index(callback) > integrations[0]:
            ref.remove(callback)
            ref.insert(integrations[0], callback)


def _batches_per_epoch(dataloader: Any) -> int | None:
    try:
        return len(dataloader) if dataloader is not None else None
    except TypeError:  # an iterable dataset: the Trainer then never shortens a step
        return None


def _runs_deepspeed(optimizer: Any) -> bool:
    inner = getattr(optimizer, "optimizer", None)
    return type(optimizer).__name__ == "DeepSpeedOptimizerWrapper" or type(inner).__module__.startswith("deepspeed")


def _deepspeed_engine(optimizer: Any) -> Any:
    """The ``DeepSpeedEngine`` whose optimizer the Trainer's wrapper holds.

    Callbacks are handed neither the Trainer nor its ``model_wrapped``; the engine is reached
    from the optimizer it owns (``gc.get_referrers``, once at train begin).  Python 3.11+ may
    refer to attributes from the instance itself or from its ``__dict__``: both are followed.
    """
    inner = getattr(optimizer, "optimizer", None)
    if inner is None:
        return None
    for ref in gc.get_referrers(inner):
        for owner in [ref, *gc.get_referrers(ref)] if isinstance(ref, dict) else [ref]:
            if type(owner).__name__ == "DeepSpeedEngine" and getattr(owner, "optimizer", None) is inner:
                return owner
    return None
