"""Which steps are collected, and where the training loop is now (step, micro-batch)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["Schedule", "StepClock", "EpochAccumulation"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Schedule:
    """``start_step``, ``step_interval`` and ``collect_times`` from the config."""

    start_step: int = 0
    step_interval: int = 1
    collect_times: int | None = None

    def selects(self, step: int, collected: int) -> bool:
        # ``exhausted`` inlined: this runs at every step boundary
        if (self.collect_times is not None and collected >= self.collect_times) or step < self.start_step:
            return False
        return (step - self.start_step) % self.step_interval == 0

    def exhausted(self, collected: int) -> bool:
        return self.collect_times is not None and collected >= self.collect_times


class StepClock:
    """Step number, whether this step is collected, and the index of the running backward pass.

    Backward passes are counted with an autograd end-of-backward callback queued by the first
    monitor hook that fires in each pass, so counting costs nothing on steps that are not collected
    (no hook does any work then) and needs no cooperation from the training loop.
    """

    def __init__(self, schedule: Schedule, grad_acc_steps: int | Callable[[], int], first_step: int = 0):
        self.schedule = schedule
        self._grad_acc = grad_acc_steps
        self.step = first_step
        self.collected = 0
        self.collecting = schedule.selects(first_step, 0)
        self.last_collected: int | None = None  # the last collected step that finished
        self.backward_index = 0  # backward passes completed in this step
        self.acc_steps = self._read_acc()
        self._in_backward = False
        self._backward_end_callbacks: list[Callable[[], None]] = []
        self._warned_passes = False

    def _read_acc(self) -> int:
        value = self._grad_acc() if callable(self._grad_acc) else self._grad_acc
        return max(1, int(value))

    def on_backward_end(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once when the current backward pass finishes."""
        self._backward_end_callbacks.append(callback)

    def enter_backward(self) -> int:
        """Called from backward hooks; returns the 0-based micro-batch index of this pass."""
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        return self.backward_index

    def is_last_micro_batch(self, index: int) -> bool:
        return index == self.acc_steps - 1

    def _backward_done(self) -> None:
        callbacks, self._backward_end_callbacks = self._backward_end_callbacks, []
        self._in_backward = False
        self.backward_index += 1
        for cb in callbacks:
            cb()

    def advance(self) -> None:
        """Step boundary: the step just finished; decide whether the next one is collected."""
        if self.collecting:
            self.collected += 1
            self.last_collected = self.step
            if self.backward_index > self.acc_steps and not self._warned_passes:
                self._warned_passes = True
                log.warning(
                    "trainmon: step %d ran %d backward passes but grad_acc_steps is %d; "
                    "grad_unreduced holds the grad after pass %d (fix grad_acc_steps; an optimizer "
                    "that calls its closure several times, e.g. LBFGS, runs one pass per call: "
                    "then this is expected). Warned once",
                    self.step,
                    self.backward_index,
                    self.acc_steps,
                    self.acc_steps,
                )
        self.step += 1
        self.backward_index = 0
        acc = self._grad_acc
        self.acc_steps = self._read_acc() if callable(acc) or not isinstance(acc, int) or acc < 1 else acc
        self.collecting = self.schedule.selects(self.step, self.collected)

    @property
    def finished(self) -> bool:
        limit = self.schedule.collect_times  # ``Schedule.exhausted`` inlined (every step boundary)
        return limit is not None and self.collected >= limit


class EpochAccumulation:
    """``grad_acc_steps`` of a loop that ends each epoch with a shorter step.

    The transformers ``Trainer`` and Lightning step the optimizer after ``acc`` micro-batches, and
    also after the last micro-batch of an epoch: with ``batches_per_epoch`` not a multiple of
    ``acc`` the epoch's last step has the remainder.  A ``StepClock`` reads this callable once per
    step, after the step number moved on; ``next_step`` says that number (``None``: ``first_step``).
    Steps are counted from the start of training, so ``step % steps_per_epoch`` is the step's place
    in its epoch.
    """

    def __init__(
        self, acc: int, batches_per_epoch: int | None, next_step: Callable[[], int | None], first_step: int = 0
    ):
        self.acc = max(1, int(acc))
        self.batches = int(batches_per_epoch) if batches_per_epoch else 0
        self._next_step = next_step
        self._first_step = first_step

    def __call__(self) -> int:
        step = self._next_step()
        step = self._first_step if step is None else step
        if self.batches <= 0:
            return self.acc
        per_epoch = -(-self.batches // self.acc)
        if step % per_epoch == per_epoch - 1:
            return self.batches - self.acc * (per_epoch - 1)
        return self.acc
