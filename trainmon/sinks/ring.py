"""The flight recorder's sink: the last steps' rows held in memory, written only when asked.

``write`` keeps a step's ``StepRows`` (unbuilt: the host values of the step's statistics, no
formatting) in a ring of ``steps`` entries, on the training thread; nothing reaches the disk.
``dump`` hands every held step to ``inner`` (normally the async CSV/TensorBoard writer) in step
order and empties the ring: the escalator calls it when an alert fires, so the rows recorded
*before* the anomaly exist too.  Rows still held at ``close`` were never needed and are dropped.
"""

from __future__ import annotations

from collections import deque

from trainmon.sinks.base import Sink
from trainmon.stats.rows import StepRows

__all__ = ["RingSink"]


class RingSink(Sink):
    def __init__(self, inner: Sink, steps: int):
        super().__init__(inner.options)
        if steps < 1:
            raise ValueError(f"a ring needs steps >= 1, got {steps}")
        self.inner = inner
        self._held: deque[tuple[StepRows, int]] = deque(maxlen=steps)

    @property
    def held_steps(self) -> list[int]:
        return [step for _, step in self._held]

    def write(self, rows: StepRows, step: int) -> None:
        self._held.append((rows, step))

    def dump(self) -> list[int]:
        """Write every held step to ``inner``; the steps written."""
        steps = self.held_steps
        while self._held:
            rows, step = self._held.popleft()
            self.inner.write(rows, step)
        return steps

    def discard(self) -> None:
        self._held.clear()

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:
        self._held.clear()
        self.inner.close()
