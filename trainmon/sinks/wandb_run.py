"""The W&B sink's own run, in a child process: W&B's Python work per metric off the training process.

``run.log`` costs W&B ~3 µs of Python per key plus ~1 ms a call (its history record is built in
Python), 4.3-5.3 ms of CPU a step for 1,590 keys, holding the GIL the training thread needs.  A run
the sink starts itself (no user run to reuse) lives in a child process instead
(``child_calls.ChildObject`` loads this file there: only the standard library is imported at the
top): this process pickles each piece of a step's row and waits with the GIL released.  A user's
run (``wandb.run``: their ``wandb.init``, the HF/Lightning integration's) is an object of the
user's process and stays there.
"""

from __future__ import annotations

from typing import Any

__all__ = ["OwnRun", "ChildRun"]


class OwnRun:
    """(In the child) ``wandb.init(**init_args)`` and the three calls the sink makes on it."""

    def __init__(self, init_args: dict[str, Any]):
        import wandb

        self.run = wandb.init(**init_args, settings=wandb.Settings(console="off", silent=True))

    def define_metric(self, name: str, step_metric: str | None = None) -> None:
        self.run.define_metric(name, step_metric=step_metric)  # its Metric is not sent back

    def log(self, row: dict[str, float], step: int) -> None:
        self.run.log(row, step=step)

    def finish(self) -> None:
        self.run.finish()


class ChildRun:
    """``OwnRun`` in a child process, with the calls of a ``wandb`` run the sink uses."""

    def __init__(self, init_args: dict[str, Any], timeout_s: float):
        from trainmon.sinks.child_calls import ChildObject  # not at the top: the child loads this file

        self._child = ChildObject(__file__, "OwnRun", init_args)
        self.process, self.pid = self._child.process, self._child.pid
        self._timeout_s = timeout_s

    def define_metric(self, name: str, step_metric: str | None = None) -> None:
        self._child.call("define_metric", name, step_metric)

    def log(self, row: dict[str, float], step: int) -> None:
        self._child.call("log", row, step)

    def finish(self) -> None:
        """Finish the run and wait for the child to exit: W&B writes the run out in its exit hooks."""
        try:
            self._child.call("finish")
        finally:
            self._child.close(self._timeout_s)
