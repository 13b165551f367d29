"""The loss, as the training loop hands it over: ``monitor.record_loss(loss)`` -> family ``loss``.

One row per call on a collected step: ``vpp_stage,name,step,micro_step,loss,shape,dtype`` with
name ``loss`` and ``micro_step`` the n-th call in that step (call it once per micro-batch, or
once per step).  The value is the mean of the tensor (a scalar loss: itself) in float64; a
Python number is taken as is.

No host sync: the tensor is kept and reaches the host with the step's other rows.  The step a
call belongs to is the one whose forward ran last: a call after ``optimizer.step()`` (before the
next forward) still belongs to the step just finished, whose rows were already handed to the
sink, so its row is written on its own and its value read on the writer thread.  To know which
forward ran last, a forward pre-hook on the first model chunk counts forward calls (a counter
increment per forward; no tensor is touched).  The hook is installed by the first
``record_loss`` call: a loop that never records its loss runs nothing for it.  That first call
cannot know yet whether a forward ran since the last optimizer step, so (unless no step has
passed since ``set_monitor``) its value waits for the next event: a forward first means the call
came after the step (the row is the finished step's), the step boundary first means it came
within the step; a monitor closed before either files it under the finished step (what the HF
and Lightning callbacks do).
"""

from __future__ import annotations

import functools
import logging
import numbers
from typing import Any

import torch
import torch.nn as nn

from trainmon.collectors.base import Collector, register_collector
from trainmon.collectors.module_io import hook_fn, in_backward, uses_compile
from trainmon.core.hooks import Handle
from trainmon.families import Family
from trainmon.stats.engine import Meta
from trainmon.stats.rows import RowBlock, StepRows

__all__ = ["LossCollector"]

_COLUMNS = ("loss",)

log = logging.getLogger(__name__)


def _as_tensor(loss: Any) -> torch.Tensor | None:
    if isinstance(loss, torch.Tensor) and loss.numel() and not loss.is_complex():
        return loss.detach().double().mean().reshape(1)  # a new tensor: later in-place ops cannot reach it
    if isinstance(loss, numbers.Real) and not isinstance(loss, bool):
        return torch.tensor([float(loss)], dtype=torch.float64)
    return None


@register_collector
class LossCollector(Collector):
    name = "loss"
    priority = 25

    @staticmethod
    def enabled(config) -> bool:
        return True  # nothing runs until record_loss is called

    def attach(self) -> None:
        self._forward_step: int | None = None  # step of the last forward
        self._calls: dict[int, int] = {}  # step -> record_loss calls so far
        self._warned = False
        self._hooked = False
        self._attached_at = self.ctx.clock.step
        self._waiting: list[tuple[int, torch.Tensor, tuple, str]] = []  # (clock step, value, shape, dtype)
        self.write_late: Any = None  # set by the session: writes a finished step's rows
        self.replan: Any = None  # set by the session: asks it to call quiet_hooks again

    def _hook_forward(self) -> None:
        self._hooked = True
        if self.replan is not None:  # on_step_end is no longer quiet
            self.replan()
        chunk = self.ctx.chunks[0] if self.ctx.chunks else None
        if isinstance(chunk, nn.Module):
            hook = hook_fn(self.ctx.guard.wrap(self, self._on_forward), uses_compile([chunk]))
            self.handles.append(Handle(chunk.register_forward_pre_hook(hook).remove))

    def _on_forward(self, _module: nn.Module, _args: Any) -> None:
        if not in_backward():
            if self._waiting:
                self._resolve_waiting(late=True)
            self._forward_step = self.ctx.clock.step

    def quiet_hooks(self) -> tuple[str, ...]:
        return () if self._hooked else ("on_step_end",)  # record_loss not called yet

    def on_step_end(self) -> None:
        if self._waiting:
            self._resolve_waiting(late=False)

    def detach(self) -> None:
        if self._waiting:
            self._resolve_waiting(late=True)
        super().detach()

    def _resolve_waiting(self, late: bool) -> None:
        """The first calls' values, now that a forward (``late``) or a step end came first."""
        waiting, self._waiting = self._waiting, []
        for at, value, shape, dtype in waiting:
            if at != self.ctx.clock.step:  # a boundary of a step that was not collected passed: within it
                continue
            rows = self._file(value, shape, dtype, late)
            if rows is not None and self.write_late is not None:
                self.write_late(*rows)

    def record(self, loss: Any) -> tuple[StepRows, int] | None:
        """Capture ``loss`` for its step; rows to write at once (a late call), else None."""
        clock = self.ctx.clock
        value = _as_tensor(loss)
        if value is None:
            if not self._warned:
                self._warned = True
                log.warning(
                    "trainmon: record_loss takes a non-empty real tensor or a number, got %s; not recorded",
                    type(loss).__name__,
                )
            return None
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else ()
        dtype = str(loss.dtype) if isinstance(loss, torch.Tensor) else type(loss).__name__
        if not self._hooked:
            self._hook_forward()
            if clock.step != self._attached_at:  # a step passed: which step is this? (docstring)
                self._waiting.append((clock.step, value, shape, dtype))
                return None
        if self._waiting:  # more calls before the first one's step is known: they share it
            if self._waiting[0][0] == clock.step:
                self._waiting.append((clock.step, value, shape, dtype))
                return None
            self._waiting = []  # from a step that was not collected
        return self._file(value, shape, dtype, self._forward_step is not None and self._forward_step < clock.step)

    def _file(self, value: torch.Tensor, shape: tuple, dtype: str, late: bool) -> tuple[StepRows, int] | None:
        clock = self.ctx.clock
        step = clock.step - 1 if late else clock.step
        micro = self._calls.get(step, 0)
        self._calls = {step: micro + 1}
        if not late:
            if clock.collecting:
                meta = Meta(Family.LOSS, "loss", 0, shape, dtype, micro_step=micro)
                self.ctx.engine.capture_values(Family.LOSS, [meta], [value], _COLUMNS)
            return None
        if self.ctx.clock.last_collected != step:  # that step was not collected
            return None
        build = functools.partial(_late_block, step, micro, shape, dtype, value)
        return StepRows(build), step


def _late_block(step: int, micro: int, shape: tuple, dtype: str, value: torch.Tensor) -> list[RowBlock]:
    """Runs on the sink's writer thread: the one place this value is read on the host."""
    return [
        RowBlock(Family.LOSS, step, micro, None, _COLUMNS, ["loss"], [0], [shape], [dtype], [[float(value.item())]])
    ]
