"""``"format": ["mlflow"]``: each collected step's rows as MLflow metrics.

Keys, selection, ranks and failure handling: :mod:`trainmon.sinks.metrics` (docs/loggers.md).
MLflow specifics:

* **Which run.** The user's active run when there is one at the first collected step
  (``mlflow.start_run`` on the thread that attached the monitor, e.g. by the HF/Lightning
  integration, or ``MLFLOW_RUN_ID``); else a run of this sink's own under the tracking URI
  (``"mlflow": {"tracking_uri": ...}``, else ``MLFLOW_TRACKING_URI``, else MLflow's default), in
  ``experiment`` (else ``MLFLOW_EXPERIMENT_NAME`` / ``MLFLOW_EXPERIMENT_ID``, else MLflow's
  default experiment), named after trainmon's run id (``<run id>-rank<R>`` with ``all_ranks``) and
  tagged ``trainmon.run_id`` / ``trainmon.rank``.  Only a run this sink started is ended at close.
* **Writes.** ``MlflowClient.log_batch`` per step, in chunks of 1,000 metrics (MLflow's limit per
  request), each metric with the training step and the step's recorded wall time (ms).  With a
  local store (SQLite file, folder, a database URI) the client runs in a child process
  (:mod:`trainmon.sinks.mlflow_store`): its database work would otherwise hold this process's GIL.
* **Keys.** Characters MLflow rejects become ``_`` (:func:`~trainmon.sinks.metrics.mlflow_key`).
* **Values.** float64 as they are; NaN reads back as NaN; MLflow's SQL stores keep +-inf as
  +-1.7976931348623157e308 (the largest float64).
* ``mlflow`` is imported on the sink's worker thread at the first collected step, never on import.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from dataclasses import dataclass
from typing import ClassVar

from trainmon.sinks.base import SinkOptions, register_sink

if importlib.util.find_spec("mlflow") is None:  # "format": ["mlflow"] without it: a config error at attach
    raise ImportError("No module named 'mlflow'")
from trainmon.sinks.metrics import MetricSettings, MetricSink, mlflow_key
from trainmon.sinks.mlflow_store import ChildStore, InProcessStore, open_store

__all__ = ["MlflowSink", "MlflowSettings", "BATCH"]

BATCH = 1000  # MLflow's MAX_METRICS_PER_BATCH


@dataclass(frozen=True)
class MlflowSettings(MetricSettings):
    """The ``"mlflow"`` config block: ``tracking_uri`` and ``experiment`` (a name, made if missing)
    apply to a run the sink starts; None leaves them to MLflow's environment variables."""

    block: ClassVar[str] = "mlflow"

    tracking_uri: str | None = None
    experiment: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("tracking_uri", "experiment"):
            value = getattr(self, key)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"mlflow.{key}: {value!r} is not a non-empty string")


@register_sink("mlflow")
class MlflowSink(MetricSink):
    """Logs ``<family>/<stat>/<name>`` metrics to MLflow (see the module docstring)."""

    what = "MLflow"
    package = "mlflow"
    settings_schema = MlflowSettings

    def __init__(self, options: SinkOptions, settings: MlflowSettings | None = None):
        super().__init__(options, settings)
        # MLflow's active run is per thread: the one that attaches the monitor is the training thread.
        self._owner_thread = threading.get_ident()
        self.store: InProcessStore | ChildStore | None = None
        self.mlflow_run_id: str | None = None
        self.own_run = False

    def _rewrite_key(self):
        return mlflow_key

    def _open(self) -> None:
        s = self.settings
        assert isinstance(s, MlflowSettings)
        active = self._active_run_id()
        self.store = open_store(None if active else s.tracking_uri)
        if active:
            self.mlflow_run_id = active
            return
        self.mlflow_run_id = self.store.create_run(
            self.store.experiment_id(s.experiment),
            self.run_name,
            {"trainmon.run_id": self.run_id, "trainmon.rank": str(self.rank)},
        )
        self.own_run = True

    def _active_run_id(self) -> str | None:
        """The run ``mlflow.start_run`` made active on the thread that attached the monitor (MLflow
        keeps one stack per thread; this runs on the sink's worker), else ``MLFLOW_RUN_ID``."""
        try:
            from mlflow.tracking import fluent

            found = fluent._active_run_stack
            # recent MLflow: one stack per thread (ThreadLocalVariable); older: one list per process
            stack = found if isinstance(found, list) else found.get_all_thread_values().get(self._owner_thread)
        except Exception:  # a private detail of MLflow: without it, only the environment tells
            stack = None
        if stack:
            return stack[-1].info.run_id
        return os.environ.get("MLFLOW_RUN_ID") or None

    def _log(self, step: int, wall_time: float, metrics: dict[str, float]) -> None:
        assert self.store is not None and self.mlflow_run_id is not None
        ms = int(wall_time * 1000)
        batch = [(key, value, ms, step) for key, value in metrics.items()]
        for i in range(0, len(batch), BATCH):
            self.store.log_batch(self.mlflow_run_id, batch[i : i + BATCH])

    def _end(self) -> None:
        if self.store is None:
            return
        try:
            if self.own_run and self.mlflow_run_id is not None:
                self.store.set_terminated(self.mlflow_run_id)
        finally:
            self.store.close()
