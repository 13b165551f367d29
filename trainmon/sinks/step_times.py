"""``rank<R>/step_times.tsv``: when each recorded step was recorded (the output contract's clock).

The CSV and Parquet sinks each hold a :class:`StepTimes` of their rank directory; both share one
appender per file (a run writing both formats records every step once).  A line is
``<step>\\t<wall time>`` (``trainmon.output.layout.step_time_line``), the time the step's rows
were made on the training thread (``StepRows.wall_time``), appended with one ``os.write`` on an
``O_APPEND`` fd like the CSV rows, so a killed run keeps every time it wrote.  ``trainmon csv2tb``
stamps the events of a step with it.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from trainmon.output.layout import STEP_TIMES_FILE, step_time_line

__all__ = ["StepTimes"]

logger = logging.getLogger(__name__)

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)


class _Appender:
    """The ``step_times.tsv`` of a rank directory in this process.  The file is opened for each
    line (one short append per step) so that it holds no descriptor between steps: the CSV sink
    bounds its open files."""

    def __init__(self, path: Path):
        self.path = path
        self.users = 0
        self.last_step: int | None = None
        self.written = False
        self.failed = False

    def record(self, step: int, wall_time: float) -> None:
        if self.failed or step == self.last_step:  # a step's late rows (record_loss) come as a second write
            return
        self.last_step = step
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, _FLAGS, 0o644)
            try:
                os.write(fd, step_time_line(step, wall_time).encode())  # one short line: one write
            finally:
                os.close(fd)
            self.written = True
        except OSError as exc:
            self.failed = True
            # A rank directory that cannot be written at all is already one warning of the sink's own
            # (nothing of the rank is recorded); only a failure of this file alone is news.
            alone = self.path.parent.is_dir() and os.access(self.path.parent, os.W_OK)
            logger.log(
                logging.WARNING if alone else logging.DEBUG,
                "trainmon: cannot write step times to %s (%s); csv2tb will stamp this run's events with "
                "the conversion time, training continues",
                self.path,
                exc,
            )

    def close(self) -> None:
        if not self.written:
            return
        try:  # durable with the family files, which their sinks fsync at close
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            pass


_LOCK = threading.Lock()
_OPEN: dict[Path, _Appender] = {}


def _forget_parent() -> None:
    # A forked child (a DataLoader worker) records nothing through its parent's sinks, and must not
    # wait on a lock the parent's writer thread held at the fork if it ever builds a sink itself.
    global _LOCK
    _LOCK = threading.Lock()
    _OPEN.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_parent)


class StepTimes:
    """A sink's handle on its rank directory's step times (shared, reference counted)."""

    def __init__(self, rank_dir: str | Path):
        path = Path(rank_dir) / STEP_TIMES_FILE
        with _LOCK:
            self._appender = _OPEN.get(path) or _OPEN.setdefault(path, _Appender(path))
            self._appender.users += 1
        self._closed = False

    def record(self, step: int, wall_time: float) -> None:
        with _LOCK:
            if not self._closed:
                self._appender.record(step, wall_time)

    def close(self) -> None:
        with _LOCK:
            if self._closed:
                return
            self._closed = True
            appender = self._appender
            appender.users -= 1
            if appender.users == 0:
                _OPEN.pop(appender.path, None)
                appender.close()
