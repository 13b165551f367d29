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
Not covered: optimizers that do the inf check themselves (``_step_supports_amp_scaling``, the
fused/capturable ones): ``GradScaler`` always calls their ``step()``, so their skipped steps are
recorded as normal ones.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from trainmon.core.hooks import Handle, wrap_optimizer_step

__all__ = ["wrap_step_with_scaler", "skipping", "current_scale"]

_lock = threading.Lock()
_watchers: dict[int, list[tuple[Callable[[], None], Callable[[], None]]]] = {}
_state = threading.local()          # .scalers: {id(optimizer): scaler} during scaler.step; .skipping
_original: Callable | None = None


def skipping() -> bool:
    """True while the boundary of a step the GradScaler skipped runs."""
    return getattr(_state, "skipping", False)


def current_scale(optimizer: Any) -> torch.Tensor | None:
    """The loss scale (a 1-element tensor, not synced) of the GradScaler stepping ``optimizer`` now."""
    scaler = getattr(_state, "scalers", {}).get(id(optimizer))
    return None if scaler is None else getattr(scaler, "_scale", None)


def wrap_step_with_scaler(optimizer: Any, before: Callable[[], None], after: Callable[[], None]) -> Handle:
    """``core.hooks.wrap_optimizer_step``, plus the boundary of steps a GradScaler skips."""
    step = wrap_optimizer_step(optimizer, before, after)
    if not isinstance(optimizer, torch.optim.Optimizer):
        return step
    key, entry = id(optimizer), (before, after)
    with _lock:
        _watchers.setdefault(key, []).append(entry)
        _install()

    def undo() -> None:
        step.remove()
        with _lock:
            entries = _watchers.get(key, [])
            if entry in entries:
                entries.remove(entry)
            if not entries:
                _watchers.pop(key, None)
            if not _watchers:
                _uninstall()

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


def _find_original(cls: type) -> Callable:
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
