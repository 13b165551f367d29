"""Thin wrappers that install hooks and give back handles.  No math, no I/O here."""
from __future__ import annotations

import types
from typing import Any, Callable

import torch

__all__ = ["Handle", "wrap_optimizer_step", "post_accumulate_grad_hook"]


class Handle:
    """Something that can be undone exactly once."""

    def __init__(self, undo: Callable[[], None]):
        self._undo: Callable[[], None] | None = undo

    def remove(self) -> None:
        if self._undo is not None:
            undo, self._undo = self._undo, None
            undo()


def wrap_optimizer_step(optimizer: Any, before: Callable[[], None], after: Callable[[], None]) -> Handle:
    """Call ``before``/``after`` around every ``optimizer.step()``.

    torch optimizers get the official step pre/post hooks (so LR schedulers, which re-wrap
    ``optimizer.step``, keep working); wrapper objects such as Megatron's get their ``step``
    replaced on the instance only, restored on ``remove``.
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        pre = optimizer.register_step_pre_hook(lambda *_: before())
        post = optimizer.register_step_post_hook(lambda *_: after())
        return Handle(lambda: (pre.remove(), post.remove()))
    had_own = "step" in vars(optimizer)
    original = vars(optimizer).get("step")
    inner = optimizer.step

    def step(self, *args, **kwargs):
        before()
        result = inner(*args, **kwargs)
        after()
        return result

    optimizer.step = types.MethodType(step, optimizer)

    def undo() -> None:
        if had_own:
            optimizer.step = original
        else:
            del optimizer.step

    return Handle(undo)


def post_accumulate_grad_hook(param: torch.Tensor, fn: Callable[[torch.Tensor], None]) -> Handle:
    h = param.register_post_accumulate_grad_hook(fn)
    return Handle(h.remove)
