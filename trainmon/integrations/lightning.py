"""Lightning: one callback instead of the two lines.

    from trainmon.integrations.lightning import TrainerMonCallback
    trainer = L.Trainer(..., callbacks=[TrainerMonCallback("monitor.json")])

The callback attaches in ``on_train_start`` (the strategy has set up the optimizers and the train
data by then) to the ``LightningModule`` and its optimizer.  Both kinds of optimization work:

* automatic: Lightning runs forward and backward *inside* ``optimizer.step(closure)``; trainmon
  reads ``grad_reduced`` and ``param_origin`` after that closure (after Lightning's
  ``gradient_clip_val`` clipping, which runs in it), before the update.  ``grad_acc_steps`` is
  ``accumulate_grad_batches``, with the shorter last step of an epoch counted right.
* manual (``automatic_optimization = False``): your ``opt.step()`` is the boundary; if you
  accumulate yourself, say how many backward passes make a step: ``TrainerMonCallback(path,
  grad_acc_steps=4)``.

Steps are Lightning's ``global_step`` numbers.  ``on_train_end`` (and ``on_exception``) flushes and
removes every hook.

``TrainerMonCallback(path, forward_to_loggers=True)`` also hands a small summary of each recorded
step (``trainmon.sinks.summary``: by default each tensor's ``grad_reduced`` norm and
``update_ratio`` and the family totals) to every logger of ``trainer.loggers`` (``log_metrics``
with trainmon's step).  The summary is made on trainmon's writer thread; ``on_train_batch_end``
only takes the finished ones (a lock and a list swap), so a step's values reach the loggers at the
next batch end or at ``on_train_end``.

Lightning is not a dependency of trainmon (``pip install "trainmon[lightning]"``); both ``lightning``
and the older ``pytorch_lightning`` package are accepted.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

from trainmon.core.schedule import EpochAccumulation
from trainmon.monitor import TrainerMon
from trainmon.sinks.summary import SummaryBoard, SummarySpec, summary_spec

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # pragma: no cover - exercised only without lightning
    try:
        from pytorch_lightning.callbacks import Callback  # type: ignore[assignment]  # lightning's old package name
    except ImportError as exc:
        raise ImportError("trainmon.integrations.lightning needs lightning: pip install 'trainmon[lightning]'") from exc

__all__ = ["TrainerMonCallback"]

log = logging.getLogger(__name__)


def _announce_mlflow_run(trainer: Any) -> bool:
    """``"format": ["mlflow"]`` logs into the run of the Trainer's ``MLFlowLogger``: Lightning makes
    it with ``MlflowClient.create_run``, so it is not MLflow's active run.  True if one was found
    (on global rank 0: the logger has no run elsewhere)."""
    for logger in trainer.loggers:
        if type(logger).__name__ != "MLFlowLogger":  # lightning's and pytorch_lightning's alike
            continue
        try:
            run_id = logger.run_id  # made here if Lightning has not yet
            uri = logger.experiment.tracking_uri
        except Exception:  # the logger's own failure (an unreachable server) is Lightning's to report
            return False
        if run_id:
            from trainmon.sinks.mlflow import use_trainer_run

            use_trainer_run(run_id, uri)
            return True
    return False


class TrainerMonCallback(Callback):
    """Monitors a Lightning ``Trainer.fit`` with the config at ``config_path``.

    Args:
        config_path: the JSON config (a bad config raises ``ConfigError`` here, before training).
        grad_acc_steps: backward passes per optimizer step; ``None`` (default) takes the Trainer's
            ``accumulate_grad_batches`` (set it yourself with manual optimization and accumulation).
        optimizer_index: which of ``configure_optimizers``' optimizers is the step boundary.
        forward_to_loggers: also log a summary of each recorded step to ``trainer.loggers``:
            ``True`` (the default summary: ``grad_reduced`` norms and ``update_ratio``, per tensor
            and totals), a family name or a list of them (every statistic of those families), or a
            ``trainmon.sinks.summary.SummarySpec`` (families, stats, names, per_tensor, totals).
            Off (``False``) by default.
        **monitor_kwargs: passed to ``TrainerMon`` (``process_group``, ``params_have_main_grad``).
    """

    def __init__(
        self,
        config_path: str | os.PathLike[str],
        grad_acc_steps: int | None = None,
        optimizer_index: int = 0,
        forward_to_loggers: bool | str | list[str] | SummarySpec = False,
        **monitor_kwargs: Any,
    ):
        spec = summary_spec(forward_to_loggers)  # a bad selection fails here, before training
        self.monitor = TrainerMon(config_path, **monitor_kwargs)
        self.grad_acc_steps = grad_acc_steps
        self.optimizer_index = optimizer_index
        self.summary = SummaryBoard(spec) if spec is not None else None
        self.monitor.summary = self.summary
        self._logger_failed = False
        self._mlflow_run = False  # a run of the Trainer's MLFlowLogger announced to the MLflow output

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        optimizers = list(trainer.optimizers)
        if not optimizers:
            log.warning("trainmon: the LightningModule configured no optimizer; nothing is monitored")
            return
        if self.optimizer_index >= len(optimizers):
            log.warning(
                "trainmon: optimizer_index=%d but configure_optimizers returned %d optimizer(s); nothing is monitored",
                self.optimizer_index,
                len(optimizers),
            )
            return
        if len(optimizers) > 1:
            log.warning(
                "trainmon: %d optimizers; the step boundary is optimizer %d (%s) "
                "(choose with TrainerMonCallback(..., optimizer_index=))",
                len(optimizers),
                self.optimizer_index,
                type(optimizers[self.optimizer_index]).__name__,
            )
        self._mlflow_run = _announce_mlflow_run(trainer) if "mlflow" in self.monitor.config.format else False
        start = int(trainer.global_step)
        self.monitor.set_monitor(
            pl_module,
            grad_acc_steps=self._acc(trainer, pl_module, start),
            optimizer=optimizers[self.optimizer_index],
            start_iteration=start,
        )

    def _acc(self, trainer: Any, pl_module: Any, start: int) -> Any:
        if self.grad_acc_steps is not None:
            return self.grad_acc_steps
        if not pl_module.automatic_optimization:
            return 1
        batches = trainer.num_training_batches
        batches = int(batches) if isinstance(batches, (int, float)) and math.isfinite(batches) else None
        return EpochAccumulation(
            trainer.accumulate_grad_batches, batches, lambda: self.monitor.current_step, first_step=start
        )

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        # Before each micro-batch's backward, so inside the step it belongs to (Lightning calls
        # training_step, not the module's forward, so the loss collector cannot tell by forwards).
        # Automatic optimization backpropagates training_step's loss divided by the accumulation:
        # undo that so the row is the loss training_step returned.  Manual optimization: the loss
        # given to manual_backward, as given.
        if pl_module.automatic_optimization:
            loss = loss.detach() * trainer.accumulate_grad_batches
        self.monitor.record_loss(loss.detach() if hasattr(loss, "detach") else loss)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.summary is not None:
            self._forward(trainer)

    def _forward(self, trainer: Any) -> None:
        """Hand the finished summaries to the Trainer's loggers, each under its own step."""
        assert self.summary is not None
        for step, metrics in self.summary.take():
            for logger in trainer.loggers:
                try:
                    logger.log_metrics(metrics, step=step)
                except Exception as exc:  # a logger's failure must not end the training run
                    if not self._logger_failed:
                        self._logger_failed = True
                        log.warning(
                            "trainmon: %s.log_metrics failed (%s: %s); trainmon's summary may be missing from "
                            "it, the monitor files are unaffected",
                            type(logger).__name__,
                            type(exc).__name__,
                            exc,
                        )

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.monitor.close()  # the writer thread finishes: every summary is made
        self._forget_mlflow_run()
        if self.summary is not None:
            self._forward(trainer)  # before Lightning finalizes its loggers (teardown)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.monitor.close()  # keep what was recorded up to the failure
        self._forget_mlflow_run()

    def _forget_mlflow_run(self) -> None:
        if self._mlflow_run:
            from trainmon.sinks.mlflow import use_trainer_run

            use_trainer_run(None)
            self._mlflow_run = False
