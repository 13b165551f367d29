"""Sinks that wrap other sinks: an off-thread writer and a fan-out to several formats.

``AsyncSink`` takes formatting and file I/O off the training thread: ``write()`` only puts
the step's rows on a queue.  When the writer falls behind by ``max_pending_steps`` steps,
``write()`` waits for it instead of dropping data: recorded statistics are never thrown away
to keep up.  The queue is a C ``queue.SimpleQueue`` with the bound checked by its size before
each put: ``write()`` runs no Python frame but its own (``queue.Queue.put`` runs eight).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from trainmon.sinks.base import Sink, SinkOptions
from trainmon.stats.rows import StepRows

__all__ = ["AsyncSink", "FanoutSink"]

logger = logging.getLogger(__name__)

_WRITE, _FLUSH, _STOP = "write", "flush", "stop"
_ROOM_POLL_S = 0.001  # how often a write waiting for a full queue looks again


class _ErrorLog:
    """Logs the first failure of a sink with its traceback and counts the rest."""

    def __init__(self, what: str):
        self.what = what
        self.count = 0
        self._reported = 0

    def run(self, fn: Callable[..., None], *args: object) -> None:
        try:
            fn(*args)
        except Exception:
            self.count += 1
            if self.count == 1:
                logger.error(
                    "trainmon: %s failed; monitoring continues, later failures are counted and reported at close",
                    self.what,
                    exc_info=True,
                )

    def report(self) -> None:
        if self.count > self._reported:
            logger.warning("trainmon: %s failed %d time(s) in total", self.what, self.count)
            self._reported = self.count


class AsyncSink(Sink):
    """Runs ``inner``'s ``write`` on a daemon thread, in order, behind a bounded queue.

    ``flush()`` returns once everything handed over before it is written and ``inner`` is
    flushed.  ``close()`` (idempotent, also registered with ``atexit``) writes what is still
    queued, stops the thread and closes ``inner``.  Errors raised by ``inner`` are logged once
    with a traceback and never reach the caller.  The rows handed to ``write()`` must not be
    changed afterwards: they are formatted later, on the writer thread.

    In a process forked from the owner (a DataLoader worker) there is no writer thread and the
    files are the parent's: ``write``, ``flush`` and ``close`` do nothing there
    (:meth:`forget_parent`), so the child never waits on a thread or a lock it does not have
    nor writes rows into its parent's files.
    """

    def __init__(self, inner: Sink, max_pending_steps: int = 256, flush_interval_s: float | None = None):
        super().__init__(inner.options)
        if max_pending_steps < 1:
            raise ValueError(f"max_pending_steps must be >= 1, got {max_pending_steps!r}")
        self.inner = inner
        self._max_pending = int(max_pending_steps)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._flush_interval = flush_interval_s
        self._errors = _ErrorLog(f"monitor output ({type(inner).__name__})")
        self._lock = threading.RLock()  # re-entrant: close() may run in a signal handler
        self._closed = False
        self._warned_full = False
        self._owner_pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name="trainmon-writer", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def forget_parent(self) -> None:
        super().forget_parent()
        # the queue's own locks may have been held by the parent's writer thread at the fork
        self._queue = queue.SimpleQueue()
        self._closed = True

    # -- caller side ----------------------------------------------------------------------

    def write(self, rows: StepRows, step: int) -> None:
        # StepRows are immutable and are built on the writer thread.
        item = (_WRITE, rows, step)
        with self._lock:
            if os.getpid() != self._owner_pid:  # a forked child: the parent's files (forget_parent)
                return
            if self._closed:
                self._errors.run(self.inner.write, item[1], step)
                return
            if self._queue.qsize() >= self._max_pending:
                self._wait_for_room()
            self._queue.put(item)
            if self._closed:  # a signal handler closed us while put() waited: no thread now
                self._drain()

    def flush(self, timeout: float | None = None) -> None:
        """Wait until everything written so far is handed to ``inner``, then flush it."""
        done = threading.Event()
        with self._lock:  # so the marker cannot land behind close()'s stop marker
            if os.getpid() != self._owner_pid:
                return
            direct = self._closed
            if not direct:
                self._queue.put((_FLUSH, done))
        if direct:
            self._errors.run(self.inner.flush)
        elif not done.wait(timeout):
            logger.warning("trainmon: monitor output flush did not finish within %ss", timeout)

    def close(self, timeout: float | None = None) -> None:
        with self._lock:
            if self._closed or os.getpid() != self._owner_pid:
                return
            self._closed = True
        atexit.unregister(self.close)
        if self._thread.is_alive():
            self._queue.put((_STOP,))
            self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("trainmon: monitor writer still busy after %ss; closing without it", timeout)
        else:
            self._drain()
        self._errors.run(self.inner.close)
        self._errors.report()

    @property
    def pending_steps(self) -> int:
        """Steps handed over but not yet written (approximate)."""
        return self._queue.qsize()

    def _wait_for_room(self) -> None:
        if not self._warned_full:
            self._warned_full = True
            logger.warning(
                "trainmon: monitor writer is %d steps behind; training waits for it "
                "(raise max_pending_steps or record less)",
                self._max_pending,
            )
        # Polled: the writer thread then never has to signal anyone on its hot path.  Stops
        # waiting once the writer is gone (closed from a signal handler meanwhile): write()
        # then drains the queue itself.
        while self._queue.qsize() >= self._max_pending and self._thread.is_alive():
            time.sleep(_ROOM_POLL_S)

    # -- writer thread --------------------------------------------------------------------

    def _run(self) -> None:
        dirty = False
        while True:
            try:
                item = self._queue.get(timeout=self._flush_interval)
            except queue.Empty:  # only with a flush interval: the writer is idle
                if dirty:
                    self._errors.run(self.inner.flush)
                    dirty = False
                continue
            if item[0] == _STOP:
                return
            self._handle(item)
            dirty = item[0] == _WRITE

    def _handle(self, item: tuple) -> None:
        if item[0] == _WRITE:
            self._errors.run(self.inner.write, item[1], item[2])
        elif item[0] == _FLUSH:
            self._errors.run(self.inner.flush)
            item[1].set()

    def _drain(self) -> None:
        # Items that raced in after the stop marker (a write from a signal handler, say).
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item[0] != _STOP:
                self._handle(item)


class FanoutSink(Sink):
    """Hands every call to each of ``sinks`` (``format: ["csv", "tensorboard"]``).

    One sink failing does not starve the others: each sink's errors are logged once and
    counted separately.
    """

    def __init__(self, sinks: Sequence[Sink], options: SinkOptions | None = None):
        self.sinks = list(sinks)
        if options is None:
            options = self.sinks[0].options if self.sinks else SinkOptions(rank_dir=Path("."))
        super().__init__(options)
        self._errors = [_ErrorLog(f"monitor output ({type(s).__name__})") for s in self.sinks]

    def write(self, rows: StepRows, step: int) -> None:
        for sink, errors in zip(self.sinks, self._errors):
            errors.run(sink.write, rows, step)

    def flush(self) -> None:
        for sink, errors in zip(self.sinks, self._errors):
            errors.run(sink.flush)

    def close(self) -> None:
        for sink, errors in zip(self.sinks, self._errors):
            errors.run(sink.close)
            errors.report()
