"""Where the MLflow sink's calls run: in a child process, for every tracking URI.

MLflow's client spends Python per metric holding the GIL the training thread needs: with a local
store (``sqlite:///...``, a folder, ``postgresql://...``) it does the database work itself
(SQLAlchemy, ~90 µs a metric: 0.15 s a step for 1,600 metrics); with a tracking server
(``http(s)://``, Databricks) it builds and serialises each request (30-48 ms a step for 1,590
metrics, measured).  ``ChildStore`` builds an ``InProcessStore`` in a child process
(``child_calls.ChildObject``, which loads this one file there: it imports only the standard
library at the top): this process only pickles ``(key, value, ms, step)`` tuples (0.3-0.5 ms a
step) and waits with the GIL released.  The child gets this process's environment (credentials,
``MLFLOW_*``) and the tracking URI resolved here.

Into a SQLite store the metrics go in one SQL transaction per call (``SqliteMetricWriter``):
MLflow's own ``log_batch`` builds an ORM object per metric and per latest value, ~0.1 ms of CPU
a metric (a 2-core machine's second core, fully, for 1,600 metrics a step); two bulk statements
against MLflow's own table definitions write the same rows in a sixth of that.  Any other store,
and rows MLflow's rules would treat specially (a row already stored, a run not active, a table
MLflow changed), take MLflow's ``log_batch``: from then on, for the rest of the run.

Both stores answer the same four calls; a failure in the child arrives as a
``child_calls.ChildError`` (the sink's one warning), and a child that died as an
``EOFError``/``BrokenPipeError``.
"""

from __future__ import annotations

import math
import os

__all__ = ["InProcessStore", "ChildStore", "SqliteMetricWriter", "open_store"]

METRIC_ROW = tuple[str, float, int, int]  # key, value, timestamp (ms), step
BATCH = 1000  # MLflow's MAX_METRICS_PER_BATCH: the most metrics one log_batch takes
FLOAT64_MAX = 1.7976931348623157e308  # what MLflow's SQL store keeps for +-inf


class InProcessStore:
    """The four calls the sink makes, on an ``MlflowClient`` in this process."""

    def __init__(self, tracking_uri: str | None):
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.pid = os.getpid()
        self.bulk = SqliteMetricWriter.of(self.client)

    def experiment_id(self, name: str | None) -> str:
        name = name or os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if name:
            found = self.client.get_experiment_by_name(name)
            return found.experiment_id if found is not None else self.client.create_experiment(name)
        return os.environ.get("MLFLOW_EXPERIMENT_ID") or "0"

    def create_run(self, experiment_id: str, run_name: str, tags: dict[str, str]) -> str:
        return self.client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id

    def log_batch(self, run_id: str, rows: list[METRIC_ROW]) -> None:
        """Stores ``rows`` (any number): in one transaction into SQLite, else in MLflow's chunks."""
        if self.bulk is not None:
            if self.bulk.write(run_id, rows):
                return
            self.bulk = None  # something MLflow's own rules handle: its log_batch from now on
        from mlflow.entities import Metric

        metrics = [Metric(key, value, ms, step) for key, value, ms, step in rows]
        for i in range(0, len(metrics), BATCH):
            self.client.log_batch(run_id, metrics=metrics[i : i + BATCH])

    def set_terminated(self, run_id: str) -> None:
        self.client.set_terminated(run_id)

    def close(self) -> None:
        pass


class SqliteMetricWriter:
    """Metrics into an MLflow SQLite store as MLflow's ``log_batch`` stores them, in bulk.

    The rows MLflow would write: one ``metrics`` row per metric (NaN kept as value 0 with
    ``is_nan``, +-inf as +-``FLOAT64_MAX``), and per key the ``latest_metrics`` row replaced only
    by a newer ``(step, timestamp, value)``.  The tables are MLflow's own definitions (its ORM
    models' ``__table__``), so a schema change in MLflow changes these statements with it.
    """

    def __init__(self, engine, metrics_table, latest_table, runs_table):
        from sqlalchemy import bindparam, insert, select, tuple_
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        self.engine = engine  # the statements are built once: each send only binds its rows
        self.stage = select(runs_table.c.lifecycle_stage).where(runs_table.c.run_uuid == bindparam("run_uuid"))
        self.insert = insert(metrics_table)
        latest = sqlite_insert(latest_table)
        new, old = latest.excluded, latest_table.c
        self.upsert = latest.on_conflict_do_update(
            index_elements=[old.key, old.run_uuid],
            set_={"value": new.value, "timestamp": new.timestamp, "step": new.step, "is_nan": new.is_nan},
            where=tuple_(new.step, new.timestamp, new.value) > tuple_(old.step, old.timestamp, old.value),
        )

    @classmethod
    def of(cls, client) -> SqliteMetricWriter | None:
        """The writer for ``client``'s store, or None where it is not a SQLite database."""
        try:
            from mlflow.store.tracking.dbmodels.models import SqlLatestMetric, SqlMetric, SqlRun
            from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

            store = client._tracking_client.store  # MLflow's store for the URI (a private attribute)
            if not isinstance(store, SqlAlchemyStore) or store.engine.dialect.name != "sqlite":
                return None
            return cls(store.engine, SqlMetric.__table__, SqlLatestMetric.__table__, SqlRun.__table__)
        except Exception:  # an MLflow without these names: its own log_batch
            return None

    def write(self, run_id: str, rows: list[METRIC_ROW]) -> bool:
        """Stores ``rows``; False (nothing stored) where the run is not an active one or a row is
        already in the table: MLflow's own ``log_batch`` then refuses the run, or skips the
        duplicates, as it always does."""
        from sqlalchemy.exc import IntegrityError

        if not rows:
            return True
        records = [_metric_record(run_id, *row) for row in rows]
        newest: dict[str, dict] = {}  # per key, the row MLflow keeps as its latest value

        def order(r: dict) -> tuple:
            return r["step"], r["timestamp"], r["value"]

        for r in records:
            seen = newest.get(r["key"])
            if seen is None or order(r) > order(seen):
                newest[r["key"]] = r
        try:
            with self.engine.begin() as conn:  # one transaction: all rows or none
                if conn.execute(self.stage, {"run_uuid": run_id}).scalar() != "active":
                    return False
                conn.execute(self.insert, records)
                conn.execute(self.upsert, list(newest.values()))
        except IntegrityError:
            return False
        return True


def _metric_record(run_id: str, key: str, value: float, ms: int, step: int) -> dict:
    """One ``metrics`` row, its value kept as MLflow's SQL store keeps it."""
    is_nan = value != value
    if is_nan:
        value = 0.0
    elif value in (math.inf, -math.inf):
        value = math.copysign(FLOAT64_MAX, value)
    return {"key": key, "value": value, "timestamp": ms, "step": step, "is_nan": is_nan, "run_uuid": run_id}


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


def open_store(tracking_uri: str | None) -> ChildStore:
    """The store for ``tracking_uri`` (None: MLflow's own default, resolved here, where
    ``mlflow.set_tracking_uri`` may have set it), in a child process."""
    import mlflow

    return ChildStore(tracking_uri or mlflow.get_tracking_uri())
