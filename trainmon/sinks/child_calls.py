"""Calls to an object that lives in a child process: where the trackers' Python work goes.

A tracker client (W&B's ``run.log``, MLflow's SQL store) spends microseconds of Python per metric,
thousands of metrics a step, holding the GIL that the training thread needs.  ``ChildObject``
builds the client in a child process instead and calls its methods there: this process only
pickles the arguments and waits with the GIL released.

The child is ``python -c`` loading this file and then the file that defines the object's factory
by path, never ``multiprocessing`` (which would re-run the user's script) and never the
``trainmon`` package (no torch: it starts in the time the tracker's own import takes).  So this
file and the factories' files import only the standard library at the top.

Each call waits for its answer (the sink's worker thread is the only caller, so calls never
interleave).  A failure in the child comes back as a ``ChildError`` with the child's ``Type:
message``; a child that died as an ``EOFError`` / ``BrokenPipeError``.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
from typing import Any, BinaryIO

__all__ = ["ChildError", "ChildObject"]

# Loads this file under a private name, then serves the factory of argv[2] named argv[3].
_CHILD_MAIN = (
    "import importlib.util, sys; "
    "spec = importlib.util.spec_from_file_location('_trainmon_child_calls', sys.argv[1]); "
    "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); m._main(sys.argv[2], sys.argv[3])"
)


class ChildError(RuntimeError):
    """A call that failed in the child process, with the child's ``Type: message``."""


class ChildObject:
    """``factory(*args)`` of the file ``module_file``, built and called in a child process."""

    def __init__(self, module_file: str, factory: str, *args: Any, env: dict[str, str] | None = None):
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD_MAIN, os.path.abspath(__file__), os.path.abspath(module_file), factory],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # the tracker's own log lines; failures come back as answers
            env=dict(env if env is not None else os.environ, PYTHONUNBUFFERED="1"),
        )
        self.process, self.pid = self._proc, self._proc.pid  # for waiting on it, or killing it
        self._lock = threading.Lock()
        self.call("__init__", *args)  # the tracker imported and the object built, or its error raised here

    def call(self, name: str, *args: Any) -> Any:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        with self._lock:
            pickle.dump((name, args), self._proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self._proc.stdin.flush()
            ok, answer = pickle.load(self._proc.stdout)
        if not ok:
            raise ChildError(answer)
        return answer

    def close(self, timeout: float = 10.0) -> None:
        """Let the child finish its last call and exit (the tracker's exit hooks included); killed
        if it does not within ``timeout`` seconds."""
        try:
            if self._proc.stdin is not None:
                self._proc.stdin.close()  # end of input: the child's loop returns
            self._proc.wait(timeout)
        except (OSError, subprocess.TimeoutExpired):
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()


def _serve(factory: Any, requests: BinaryIO, answers: BinaryIO) -> None:
    obj: Any = None
    while True:
        try:
            name, args = pickle.load(requests)
        except EOFError:  # the parent closed its end (or its process is gone)
            return
        try:
            if name == "__init__":
                obj = factory(*args)
                answer = None
            else:
                answer = getattr(obj, name)(*args)
            reply: tuple[bool, Any] = (True, answer)
        except Exception as exc:  # reported to the sink, which turns itself off with one warning
            reply = (False, f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
        pickle.dump(reply, answers, protocol=pickle.HIGHEST_PROTOCOL)
        answers.flush()


def _main(module_file: str, factory: str) -> None:
    import importlib.util

    # Background work: on a machine with no idle core, training gets the CPU first (the sink
    # skips steps, with its warning, if the tracker then cannot keep up).
    try:
        os.nice(10)
    except (AttributeError, OSError):  # no nice() (Windows) or not allowed: run as is
        pass
    # The protocol owns the real stdout; anything the tracker prints goes to stderr instead.
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    spec = importlib.util.spec_from_file_location("_trainmon_child_object", module_file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _serve(getattr(module, factory), sys.stdin.buffer, answers)
