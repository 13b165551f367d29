"""Where the MLflow sink's calls run: in this process for a tracking server, in a child process for
a store that lives in this process otherwise.

With a local store (``sqlite:///...``, a folder, ``postgresql://...``) MLflow's client does the
database work itself: SQLAlchemy, ~90 µs of Python per metric, 0.15 s a step for 1,600 metrics,
all holding the GIL the training thread needs.  That work goes to a child process
(``child_calls.ChildObject``, which loads this one file there: it imports only the standard library
at the top): this process only pickles ``(key, value, ms, step)`` tuples and waits with the GIL
released.  A tracking server (``http(s)://``, Databricks) already does the
database work in its own process: the client stays here.

Both stores answer the same four calls; a failure in the child arrives as a
``child_calls.ChildError`` (the sink's one warning), and a child that died as an
``EOFError``/``BrokenPipeError``.
"""

from __future__ import annotations

import os

__all__ = ["InProcessStore", "ChildStore", "open_store", "runs_in_process"]

METRIC_ROW = tuple[str, float, int, int]  # key, value, timestamp (ms), step
_IN_PROCESS_SCHEMES = ("http", "https", "databricks", "databricks-uc", "uc")


def runs_in_process(tracking_uri: str) -> bool:
    """True for a tracking server (its database work is in the server's process)."""
    scheme = tracking_uri.split(":", 1)[0].lower() if "://" in tracking_uri else ""
    return scheme in _IN_PROCESS_SCHEMES


class InProcessStore:
    """The four calls the sink makes, on an ``MlflowClient`` in this process."""

    def __init__(self, tracking_uri: str | None):
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.pid = os.getpid()

    def experiment_id(self, name: str | None) -> str:
        name = name or os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if name:
            found = self.client.get_experiment_by_name(name)
            return found.experiment_id if found is not None else self.client.create_experiment(name)
        return os.environ.get("MLFLOW_EXPERIMENT_ID") or "0"

    def create_run(self, experiment_id: str, run_name: str, tags: dict[str, str]) -> str:
        return self.client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id

    def log_batch(self, run_id: str, rows: list[METRIC_ROW]) -> None:
        from mlflow.entities import Metric

        self.client.log_batch(run_id, metrics=[Metric(key, value, ms, step) for key, value, ms, step in rows])

    def set_terminated(self, run_id: str) -> None:
        self.client.set_terminated(run_id)

    def close(self) -> None:
        pass


class ChildStore:
    """``InProcessStore`` in a child process (``child_calls``)."""

    def __init__(self, tracking_uri: str):
        from trainmon.sinks.child_calls import ChildObject  # not at the top: the child loads this file

        self._child = ChildObject(__file__, "InProcessStore", tracking_uri)
        self.process, self.pid = self._child.process, self._child.pid

    def experiment_id(self, name: str | None) -> str:
        return self._child.call("experiment_id", name)

    def create_run(self, experiment_id: str, run_name: str, tags: dict[str, str]) -> str:
        return self._child.call("create_run", experiment_id, run_name, tags)

    def log_batch(self, run_id: str, rows: list[METRIC_ROW]) -> None:
        self._child.call("log_batch", run_id, rows)

    def set_terminated(self, run_id: str) -> None:
        self._child.call("set_terminated", run_id)

    def close(self, timeout: float = 10.0) -> None:
        self._child.close(timeout)


def open_store(tracking_uri: str | None) -> InProcessStore | ChildStore:
    """The store for ``tracking_uri`` (None: MLflow's own default, resolved here)."""
    import mlflow

    uri = tracking_uri or mlflow.get_tracking_uri()
    return InProcessStore(uri) if runs_in_process(uri) else ChildStore(uri)
