"""The alert latch: how the alert sink (writer thread) tells the training thread that an alert fired.

The alert sink judges a step's rows on the writer thread, after the step.  It can only *record*
here; the step driver's escalator (``trainmon.runtime.escalation``) reads the latch at a step
boundary on the training thread, agrees with the other ranks and switches the recording.

``checked(step)`` is called for every step the sink has judged, alert or not, so the boundary can
wait until the step that just ran has been judged (``wait_checked``): that makes the escalation
start at the step right after the alert's, on every rank, however far behind the writer is.

The sink sees this class only through ``sinks.alerts.AlertListener`` (plain values in, nothing
out), so ``sinks`` never imports ``runtime``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["AlertLatch", "Trigger"]


@dataclass(frozen=True)
class Trigger:
    """The first alert of a rank since the latch was last cleared."""

    step: int
    rank: int
    rule: str
    kind: str
    name: str
    op: str

    def to_json(self) -> dict[str, object]:
        return {
            "step": self.step,
            "rank": self.rank,
            "rule": self.rule,
            "kind": self.kind,
            "name": self.name,
            "op": self.op,
        }


class AlertLatch:
    """Thread-safe: ``fire``/``checked`` from the writer thread, the rest from the training thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._first: Trigger | None = None
        self._checked = -1  # highest step the sink has judged
        self.attached = False  # an alert sink feeds this latch (this rank writes)

    def fire(self, *, step: int, rank: int, rule: str, kind: str, name: str, op: str) -> bool:
        """Record an alert; True if it is the first since the last ``clear``."""
        with self._cond:
            if self._first is not None:
                return False
            self._first = Trigger(step=step, rank=rank, rule=rule, kind=kind, name=name, op=op)
            return True

    def checked(self, step: int) -> None:
        with self._cond:
            if step > self._checked:
                self._checked = step
                self._cond.notify_all()

    def wait_checked(self, step: int, timeout_s: float) -> bool:
        """Block until the rows of ``step`` are judged; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._checked >= step, timeout_s)

    @property
    def first(self) -> Trigger | None:
        with self._cond:
            return self._first

    def clear(self) -> None:
        with self._cond:
            self._first = None
