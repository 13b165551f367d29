"""The model's input per micro-batch (``loss_alignment``): family ``model_input``.

The "sample data" stage of ``trainmon compare``: two runs fed different batches differ here,
before any activation.  One row per tensor passed to each chunk's ``forward`` (positional
``input.0``, ``input.1``, ...; keyword ``input.<key>``), with the config's ``ops``; integer
tensors (token ids) are measured as float64, their ``dtype`` column stays the tensor's own.
Recomputation forwards (activation checkpointing, inside backward) are skipped; ``micro_step``
is the n-th forward call of that chunk in the step.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn

from trainmon.collectors.base import Collector, register_collector
from trainmon.collectors.module_io import hook_fn, in_backward, uses_compile
from trainmon.core.hooks import Handle
from trainmon.families import Family

__all__ = ["ModelInputCollector", "input_tensors"]


def input_tensors(args: Any, kwargs: Any) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of a forward call's tensor arguments, in call order."""
    out = [(f"input.{i}", a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    out += [(f"input.{k}", v) for k, v in (kwargs or {}).items() if isinstance(v, torch.Tensor)]
    return [(n, t) for n, t in out if t.layout == torch.strided and not t.is_meta and not t.is_complex()]


@register_collector
class ModelInputCollector(Collector):
    name = "model_input"
    priority = 15

    @staticmethod
    def enabled(config) -> bool:
        return config.loss_alignment

    def attach(self) -> None:
        self._step, self._forwards = -1, 0  # forwards seen in ``_step``: the micro-batch index
        compiled = uses_compile(self.ctx.chunks)
        for vpp, chunk in enumerate(self.ctx.chunks):
            body = self.ctx.guard.gated(self, functools.partial(self._record, vpp), self.ctx.clock)
            h = chunk.register_forward_pre_hook(hook_fn(body, compiled), with_kwargs=True)
            self.handles.append(Handle(h.remove))

    def _record(self, vpp: int, _module: nn.Module, args: Any, kwargs: Any) -> None:
        if in_backward():
            return
        clock = self.ctx.clock
        if self._step != clock.step:
            self._step, self._forwards = clock.step, 0
        micro = self._forwards
        self._forwards += 1
        found = input_tensors(args, kwargs)
        if not found:
            return
        names = [n for n, _ in found]
        tensors = [t.detach() for _, t in found]
        measured = [t if t.is_floating_point() else t.double() for t in tensors]
        engine = self.ctx.engine
        rows = engine.partials(measured, no_sync=True)
        engine.capture_tensors(Family.MODEL_INPUT, vpp, names, tensors, rows, micro_step=micro)
