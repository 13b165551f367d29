"""Where the MLflow sink's calls run: in this process for a tracking server, in a child process for
a store that lives in this process otherwise.

With a local store (``sqlite:///...``, a folder, ``postgresql://...``) MLflow's client does the
database work itself: SQLAlchemy, ~90 µs of Python per metric, 0.15 s a step for 1,600 metrics,
all holding the GIL the training thread needs.  That work goes to a child process (``python -m
trainmon.sinks.mlflow_store``, never ``multiprocessing``, which would re-run the user's script),
driven over its stdin/stdout: this process only pickles ``(key, value, ms, step)`` tuples and
waits with the GIL released.  The child loads this one file, not the ``trainmon`` package (no
torch: it starts in the time ``import mlflow`` takes).  A tracking server (``http(s)://``, Databricks) already does the
database work in its own process: the client stays here.

Both stores answer the same four calls; a failure in the child arrives as a ``StoreError`` (the
sink's one warning), and a child that died as an ``EOFError``/``BrokenPipeError``.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
from typing import Any, BinaryIO

__all__ = ["StoreError", "InProcessStore", "ChildStore", "open_store", "runs_in_process"]

# The child runs this file alone, under a private module name.
_CHILD_MAIN = (
    "import importlib.util, sys; "
    "spec = importlib.util.spec_from_file_location('_trainmon_mlflow_store', sys.argv[1]); "
    "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); m._main(sys.argv[2])"
)

METRIC_ROW = tuple[str, float, int, int]  # key, value, timestamp (ms), step
_IN_PROCESS_SCHEMES = ("http", "https", "databricks", "databricks-uc", "uc")


class StoreError(RuntimeError):
    """A call that failed in the child process, with the child's ``Type: message``."""


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
    """``InProcessStore`` in a child process; each call waits for its answer (the sink's worker
    thread is the only caller, so calls never interleave)."""

    def __init__(self, tracking_uri: str):
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD_MAIN, os.path.abspath(__file__), tracking_uri],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # MLflow's own log lines; failures come back as answers
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        self.pid = self._proc.pid
        self._lock = threading.Lock()
        self._call("ready")  # MLflow imported and the store opened, or its error raised here

    def _call(self, name: str, *args: Any) -> Any:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        with self._lock:
            pickle.dump((name, args), self._proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self._proc.stdin.flush()
            ok, answer = pickle.load(self._proc.stdout)
        if not ok:
            raise StoreError(answer)
        return answer

    def experiment_id(self, name: str | None) -> str:
        return self._call("experiment_id", name)

    def create_run(self, experiment_id: str, run_name: str, tags: dict[str, str]) -> str:
        return self._call("create_run", experiment_id, run_name, tags)

    def log_batch(self, run_id: str, rows: list[METRIC_ROW]) -> None:
        self._call("log_batch", run_id, rows)

    def set_terminated(self, run_id: str) -> None:
        self._call("set_terminated", run_id)

    def close(self, timeout: float = 10.0) -> None:
        """Let the child finish its last call and exit; killed if it does not within ``timeout``."""
        try:
            if self._proc.stdin is not None:
                self._proc.stdin.close()  # end of input: the child's loop returns
            self._proc.wait(timeout)
        except (OSError, subprocess.TimeoutExpired):
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()


def open_store(tracking_uri: str | None) -> InProcessStore | ChildStore:
    """The store for ``tracking_uri`` (None: MLflow's own default, resolved here)."""
    import mlflow

    uri = tracking_uri or mlflow.get_tracking_uri()
    return InProcessStore(uri) if runs_in_process(uri) else ChildStore(uri)


def _serve(tracking_uri: str, requests: BinaryIO, answers: BinaryIO) -> None:
    store: InProcessStore | None = None
    while True:
        try:
            name, args = pickle.load(requests)
        except EOFError:  # the sink closed its end (or its process is gone)
            return
        try:
            if store is None:
                store = InProcessStore(tracking_uri)
            answer = None if name == "ready" else getattr(store, name)(*args)
            reply: tuple[bool, Any] = (True, answer)
        except Exception as exc:  # reported to the sink, which turns itself off with one warning
            reply = (False, f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
        pickle.dump(reply, answers, protocol=pickle.HIGHEST_PROTOCOL)
        answers.flush()


def _main(tracking_uri: str) -> None:
    # Background work: on a machine with no idle core, training gets the CPU first (the sink
    # skips steps, with its warning, if the store then cannot keep up).
    try:
        os.nice(10)
    except (AttributeError, OSError):  # no nice() (Windows) or not allowed: run as is
        pass
    # The protocol owns the real stdout; anything MLflow prints goes to stderr instead.
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    _serve(tracking_uri, sys.stdin.buffer, answers)
