"""Escalation: after the first alert, record a richer config for K steps, then go back.

The alert sink runs on the writer thread and only *requests*; the monitor applies changes on
the training thread at a step boundary by calling ``poll(step)`` before the step's collection:

* ``"start"``: switch to the escalation config for steps ``step .. step + steps - 1``;
* ``"stop"``:  restore the config that was active before;
* ``None``:    nothing to do.

With several ranks the monitor must agree on the decision (e.g. all-reduce ``poll() == "start"``
as a MAX from rank 0's point of view) so every rank switches on the same step.
"""
from __future__ import annotations

import threading
from typing import Literal

__all__ = ["Escalation"]


class Escalation:
    """A thread-safe latch: ``request`` from any thread, ``poll`` from the training thread."""

    def __init__(self, steps: int, *, max_times: int = 1):
        if steps < 1 or max_times < 1:
            raise ValueError(f"escalation needs steps >= 1 and max_times >= 1, got {steps}, {max_times}")
        self.steps = steps
        self.max_times = max_times
        self._lock = threading.Lock()
        self._pending: int | None = None   # step of the alert that asked for it
        self._end: int | None = None       # first step after the escalated window
        self._used = 0
        self.history: list[tuple[int, int]] = []   # (first, last) escalated steps

    @property
    def active(self) -> bool:
        return self._end is not None

    @property
    def requested_at(self) -> int | None:
        return self._pending

    def request(self, alert_step: int) -> bool:
        """Ask for an escalation because of an alert at ``alert_step``; False if not granted."""
        with self._lock:
            if self._end is not None or self._pending is not None or self._used >= self.max_times:
                return False
            self._pending = alert_step
            return True

    def poll(self, step: int) -> Literal["start", "stop"] | None:
        with self._lock:
            if self._end is not None and step >= self._end:
                self.history.append((self._end - self.steps, self._end - 1))
                self._end = None
                return "stop"
            if self._end is None and self._pending is not None:
                self._pending = None
                self._used += 1
                self._end = step + self.steps
                return "start"
            return None
