"""Loss-scaled (AMP) training: steps that ``torch.amp.GradScaler`` skips are steps too.

``scaler.step(optimizer)`` calls ``optimizer.step()`` only when the unscaled grads are finite; on
an Inf/NaN it skips it, so a step boundary bound to ``optimizer.step()`` alone would silently merge
the skipped iteration into the next one.  :func:`wrap_step_with_scaler` binds the boundary to both:
``optimizer.step()`` as before, and a ``GradScaler.step`` that skipped (then ``before``/``after``
run with :func:`skipping` true, right after the skip).  The session records a skipped step's grads
under its own step number, no param/moment rows, and one row of the ``steps`` family
(``skipped``, ``loss_scale``: the scale the iteration ran with).

``GradScaler.step`` is patched on the class once, while some monitored optimizer exists, and
only looks at optimizers registered here; the patch costs a dict lookup per ``scaler.step``.
Megatron's mixed-precision optimizers (a leaf with a ``grad_scaler``) do the found-inf test inside
their own ``step()`` and return ``(False, None, None)`` when they skip: their ``step`` is wrapped
(inside the monitor's own wrapper) to note that, so the boundary's ``after`` half knows the step
was skipped (:func:`skipped`); the ``before`` half has run by then, so the session drops the
optimizer-phase rows of such a step when it writes it.

Not covered: optimizers that do the inf check themselves (``_step_supports_amp_scaling``, the
fused/capturable ones): ``GradScaler`` always calls their ``step()``, so their skipped steps are
recorded as normal ones.  DeepSpeed's ZeRO optimizers (stages 1-3) skip the same way and say so
in their ``overflow`` attribute: their ``step`` is wrapped likewise.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable
from typing import Any

import torch

from trainmon.core.hooks import Handle, wrap_optimizer_step

__all__ = ["wrap_step_with_scaler", "skipping", "skipped", "current_scale"]

_lock = threading.Lock()
_watchers: dict[int, list[tuple[Callable[[], None], Callable[[], None]]]] = {}
_state = threading.local()  # .scalers: {id(optimizer): scaler} during scaler.step; .skipping
_original: Callable | None = None
_own_skipped: set[int] = set()  # optimizers whose own scaler skipped the last step
_own_scales: dict[int, Callable[[], torch.Tensor]] = {}  # id(optimizer) -> its get_loss_scale


def skipping() -> bool:
    """True while the boundary of a step the GradScaler skipped runs."""
    return getattr(_state, "skipping", False)


def skipped(optimizer: Any) -> bool:
    """After ``optimizer``'s step: True when a loss scaler (GradScaler or its own) skipped it."""
    return skipping() or id(optimizer) in _own_skipped


def current_scale(optimizer: Any) -> torch.Tensor | None:
    """The loss scale (a 1-element tensor, not synced) of the loss scaler stepping ``optimizer``."""
    scaler = getattr(_state, "scalers", {}).get(id(optimizer))
    if scaler is not None:
        return getattr(scaler, "_scale", None)
    own = _own_scales.get(id(optimizer))
    return None if own is None else own()


def wrap_step_with_scaler(
    optimizer: Any, before: Callable[[], None], after: Callable[[], None], *, entry: Callable[[], None] | None = None
) -> Handle:
    """``core.hooks.wrap_optimizer_step``, plus the boundary of steps a loss scaler skips (a step
    the scaler skips never enters ``optimizer.step()``: its boundary calls ``before``/``after``)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        own = _watch_own_scaler(optimizer) if _has_own_scaler(optimizer) else None
        wrapped = wrap_optimizer_step(optimizer, before, after, entry=entry)
        if own is None:
            return wrapped

        def undo_both() -> None:
            wrapped.remove()
            own.remove()

        return Handle(undo_both)
    step = wrap_optimizer_step(optimizer, before, after, entry=entry)
    key, watcher = id(optimizer), (before, after)
    with _lock:
        _watchers.setdefault(key, []).append(watcher)
        _install()

    def undo() -> None:
        step.remove()
        with _lock:
            entries = _watchers.get(key, [])
            if watcher in entries:
                entries.remove(watcher)
            if not entries:
                _watchers.pop(key, None)
            if not _watchers:
                _uninstall()

    return Handle(undo)


def _leaves(optimizer: Any):
    inner = getattr(optimizer, "chained_optimizers", None)
    if inner is None:
        yield optimizer
        return
    for o in inner:
        yield from _leaves(o)


def _has_own_scaler(optimizer: Any) -> bool:
    """A Megatron-style optimizer with a loss scaler (``get_loss_scale()`` and a leaf ``grad_scaler``),
    or a DeepSpeed ZeRO one (``overflow``, set by its ``step()``, and ``loss_scale``)."""
    megatron = callable(getattr(optimizer, "get_loss_scale", None)) and any(
        getattr(o, "grad_scaler", None) is not None for o in _leaves(optimizer)
    )
    return megatron or _is_deepspeed(optimizer)


def _is_deepspeed(optimizer: Any) -> bool:
    return (
        hasattr(optimizer, "overflow")
        and hasattr(optimizer, "loss_scale")
        and type(optimizer).__module__.startswith("deepspeed.")
    )


def _skip_of(optimizer: Any, result: Any) -> bool:
    """Megatron returns ``(False, None, None)`` on a skip; DeepSpeed sets ``overflow``."""
    if isinstance(result, tuple) and result and result[0] is False:
        return True
    return _is_deepspeed(optimizer) and getattr(optimizer, "overflow", False) is True


def _loss_scale_of(optimizer: Any) -> Callable[[], torch.Tensor]:
    if callable(getattr(optimizer, "get_loss_scale", None)):
        return optimizer.get_loss_scale
    return lambda: torch.tensor([float(optimizer.loss_scale)])


def _watch_own_scaler(optimizer: Any) -> Handle:
    """Wrap ``optimizer.step`` (on the instance) to note a skip (``_skip_of``)."""
    key = id(optimizer)
    had_own = "step" in vars(optimizer)
    original = vars(optimizer).get("step")
    inner = optimizer.step

    def step(self, *args, **kwargs):
        _own_skipped.discard(key)
        result = inner(*args, **kwargs)
        if _skip_of(optimizer, result):
            _own_skipped.add(key)
        return result

    optimizer.step = types.MethodType(step, optimizer)
    _own_scales[key] = _loss_scale_of(optimizer)

    def undo() -> None:
        if had_own:
            optimizer.step = original
        else:
            vars(optimizer).pop("step", None)
        _own_skipped.discard(key)
        _own_scales.pop(key, None)

    return Handle(undo)


def _install() -> None:
    global _original
    if _original is None:
        _original = torch.amp.GradScaler.step
        torch.amp.GradScaler.step = _step  # type: ignore[method-assign]


def _uninstall() -> None:
    global _original
    if _original is not None:
        torch.amp.GradScaler.step = _original  # type: ignore[method-assign]
        _original = None


def _step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
    original = _original or _find_original(type(self))
    entries = _watchers.get(id(optimizer))
    if not entries or not self.is_enabled():
        return original(self, optimizer, *args, **kwargs)
    scalers = getattr(_state, "scalers", None)
    if scalers is None:
        scalers = _state.scalers = {}
    scalers[id(optimizer)] = self
    try:
        result = original(self, optimizer, *args, **kwargs)
        if _skipped(self, optimizer):
            _run_skipped(list(entries))
        return result
    finally:
        scalers.pop(id(optimizer), None)


def _find_original(cls: type[torch.amp.GradScaler]) -> Callable:
    # uninstalled while a step ran: the class attribute is the original again
    return cls.step if cls.step is not _step else torch.amp.GradScaler.step


def _skipped(scaler: Any, optimizer: Any) -> bool:
    """Whether ``GradScaler.step`` just skipped ``optimizer.step()`` (its own test: found_inf > 0;
    the values are on the host already, ``_maybe_opt_step`` read them)."""
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    state = scaler._per_optimizer_states.get(id(optimizer), {})
    found = state.get("found_inf_per_device", {})
    return bool(found) and bool(sum(v.item() for v in found.values()))


def _run_skipped(entries: list[tuple[Callable[[], None], Callable[[], None]]]) -> None:
    _state.skipping = True
    try:
        for before, _ in entries:
            before()
        for _, after in entries:
            after()
    finally:
        _state.skipping = False
