"""``"format": ["mlflow"]``: each collected step's rows as MLflow metrics.

Keys, selection, ranks and failure handling: :mod:`trainmon.sinks.metrics` (docs/loggers.md).
MLflow specifics:

* **Which run.** The user's active run when there is one at the first collected step
  (``mlflow.start_run`` on the thread that attached the monitor, e.g. by the HF Trainer's MLflow
  callback; the run of Lightning's ``MLFlowLogger``, announced by trainmon's Lightning callback
  with ``use_trainer_run``; or ``MLFLOW_RUN_ID``); else a run of this sink's own under the tracking URI
  (``"mlflow": {"tracking_uri": ...}``, else ``MLFLOW_TRACKING_URI``, else MLflow's default), in
  ``experiment`` (else ``MLFLOW_EXPERIMENT_NAME`` / ``MLFLOW_EXPERIMENT_ID``, else MLflow's
  default experiment), named after trainmon's run id (``<run id>-rank<R>`` with ``all_ranks``) and
  tagged ``trainmon.run_id`` / ``trainmon.rank``.  Only a run this sink started is ended at close.
* **Writes.** ``MlflowClient.log_batch`` in chunks of 1,000 metrics (MLflow's limit per request),
  each metric with the training step and the step's recorded wall time (ms); the steps collected
  within ``send_every_s`` (1 s) go together, so a SQLite store commits (and syncs its file) once a
  second, not once a step.  MLflow's client runs in a child process
  (:mod:`trainmon.sinks.mlflow_store`): its per-metric Python (a local store's database work, a
  tracking server's requests) would otherwise hold this process's GIL; a SQLite store gets each
  send in one bulk transaction there.
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
from trainmon.sinks.mlflow_store import ChildStore, open_store

__all__ = ["MlflowSink", "MlflowSettings", "use_trainer_run"]

# thread id -> (run id, tracking URI) of a run a trainer's own MLflow logger made with
# ``MlflowClient.create_run`` (Lightning's ``MLFlowLogger``): not an active run, so it is announced
_TRAINER_RUNS: dict[int, tuple[str, str | None]] = {}


def use_trainer_run(run_id: str | None, tracking_uri: str | None = None) -> None:
    """Makes the run ``run_id`` (under ``tracking_uri``) the user's run for a monitor attached on
    this thread, as ``mlflow.start_run`` would; ``None`` forgets it.  For trainer integrations whose
    MLflow logger does not start an active run."""
    if run_id is None:
        _TRAINER_RUNS.pop(threading.get_ident(), None)
    else:
        _TRAINER_RUNS[threading.get_ident()] = (run_id, tracking_uri)


@dataclass(frozen=True)
class MlflowSettings(MetricSettings):
    """The ``"mlflow"`` config block: ``tracking_uri`` and ``experiment`` (a name, made if missing)
    apply to a run the sink starts; None leaves them to MLflow's environment variables.
    ``send_every_s``: how long a step may wait to be sent with the next ones (0: each at once)."""

    block: ClassVar[str] = "mlflow"

    tracking_uri: str | None = None
    experiment: str | None = None
    send_every_s: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        value = self.send_every_s
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 3600:
            raise ValueError(f"mlflow.send_every_s: {value!r} is not a number of seconds from 0 to 3600")
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
        self.store: ChildStore | None = None
        self.mlflow_run_id: str | None = None
        self.own_run = False
        s = self.settings
        self.hold_s = float(s.send_every_s) if isinstance(s, MlflowSettings) else 1.0

    def _rewrite_key(self):
        return mlflow_key

    def _open(self) -> None:
        s = self.settings
        assert isinstance(s, MlflowSettings)
        active, active_uri = self._active_run()
        self.store = open_store(active_uri if active else s.tracking_uri)
        if active:
            self.mlflow_run_id = active
            return
        self.mlflow_run_id = self.store.create_run(
            self.store.experiment_id(s.experiment),
            self.run_name,
            {"trainmon.run_id": self.run_id, "trainmon.rank": str(self.rank)},
        )
        self.own_run = True

    def _active_run(self) -> tuple[str | None, str | None]:
        """(run id, its tracking URI or None for MLflow's current one) of the user's run: the one
        ``mlflow.start_run`` made active on the thread that attached the monitor (MLflow keeps one
        stack per thread; this runs on the sink's worker), else one a trainer integration
        announced there (``use_trainer_run``), else ``MLFLOW_RUN_ID``."""
        try:
            from mlflow.tracking import fluent

            found = fluent._active_run_stack
            # recent MLflow: one stack per thread (ThreadLocalVariable); older: one list per process
            stack = found if isinstance(found, list) else found.get_all_thread_values().get(self._owner_thread)
        except Exception:  # a private detail of MLflow: without it, only the environment tells
            stack = None
        if stack:
            return stack[-1].info.run_id, None
        if self._owner_thread in _TRAINER_RUNS:
            return _TRAINER_RUNS[self._owner_thread]
        return os.environ.get("MLFLOW_RUN_ID") or None, None

    def _log_steps(self, steps: list[tuple[int, float, dict[str, float]]]) -> None:
        """The steps held for ``send_every_s`` in one store call: one transaction into SQLite."""
        assert self.store is not None and self.mlflow_run_id is not None
        rows = []
        for step, wall_time, metrics in steps:
            ms = int(wall_time * 1000)
            rows += [(key, value, ms, step) for key, value in metrics.items()]
        self.store.log_batch(self.mlflow_run_id, rows)

    def _end(self) -> None:
        if self.store is None:
            return
        try:
            if self.own_run and self.mlflow_run_id is not None:
                self.store.set_terminated(self.mlflow_run_id)
        finally:
            self.store.close()
