"""The step boundary: one wrapping per optimizer, shared by whoever needs the boundary.

A monitored optimizer's step is wrapped once (``core.hooks.wrap_optimizer_step``: step pre/post
hooks, or an instance wrap) by one :class:`StepBoundary`, however many users subscribe to it (a
``Session``, the dynamic driver, an ``EscalatingSession``); the last subscriber to leave restores
everything exactly as it was.

Loss-scaled training: steps a loss scaler skips are steps too.  ``scaler.step(optimizer)`` calls
``optimizer.step()`` only when the unscaled grads are finite; on an Inf/NaN it skips it, so a
boundary bound to ``optimizer.step()`` alone would silently merge the skipped iteration into the
next one.  So the boundary is bound to both: ``optimizer.step()`` as before, and a
``GradScaler.step`` that skipped (then the subscribers' ``before``/``after`` run with
:func:`skipping` true, right after the skip).  The session records a skipped step's grads under
its own step number, no param/moment rows, and one row of the ``steps`` family (``skipped``,
``loss_scale``: the scale the iteration ran with).

``GradScaler.step`` is patched on the class once, while some boundary of a torch optimizer exists
(:class:`_GradScalerPatch`), and only looks at those optimizers; the patch costs a dict lookup per
``scaler.step``.  Megatron's mixed-precision optimizers (a leaf with a ``grad_scaler``) do the
found-inf test inside their own ``step()`` and return ``(False, None, None)`` when they skip:
their ``step`` is wrapped (inside the boundary's own wrapper) to note that, so the boundary's
``after`` half knows the step was skipped (:func:`skipped`); the ``before`` half has run by then,
so the session drops the optimizer-phase rows of such a step when it writes it.  DeepSpeed's ZeRO
optimizers (stages 1-3) skip the same way and say so in their ``overflow`` attribute: their
``step`` is wrapped likewise.

Not covered: optimizers that do the inf check themselves (``_step_supports_amp_scaling``, the
fused/capturable ones): ``GradScaler`` always calls their ``step()``, so their skipped steps are
recorded as normal ones.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from trainmon.core.hooks import Handle, wrap_optimizer_step

__all__ = ["StepBoundary", "current_scale", "skipped", "skipping", "subscribe"]

Callback = Callable[[], None]


class _Subscriber:
    __slots__ = ("active", "after", "before", "entry")

    def __init__(self, entry: Callback | None, before: Callback, after: Callback):
        self.entry, self.before, self.after = entry, before, after
        self.active = True  # False once its handle is removed (even in the middle of a boundary)


class StepBoundary:
    """One optimizer's step boundary: wrapped on the first subscription, restored after the last."""

    def __init__(self, optimizer: Any):
        self.optimizer = optimizer
        self.scaled_by_grad_scaler = isinstance(optimizer, torch.optim.Optimizer)
        self.own_skipped = False  # its own loss scaler (Megatron, DeepSpeed) skipped the last step
        self.own_scale: Callable[[], torch.Tensor] | None = None  # its own loss scaler's scale
        self._subscribers: tuple[_Subscriber, ...] = ()  # replaced, never mutated: safe to iterate
        self._installed: list[Handle] = []  # undone last-in first-out

    @property
    def subscribed(self) -> bool:
        return bool(self._subscribers)

    def add(self, subscriber: _Subscriber) -> None:
        if not self._subscribers:
            self._install()
        self._subscribers = (*self._subscribers, subscriber)

    def discard(self, subscriber: _Subscriber) -> None:
        subscriber.active = False
        self._subscribers = tuple(s for s in self._subscribers if s is not subscriber)
        if not self._subscribers:
            self._uninstall()

    def _install(self) -> None:
        optimizer = self.optimizer
        if not self.scaled_by_grad_scaler and _has_own_scaler(optimizer):
            self._installed.append(self._watch_own_scaler())  # inside the boundary's wrapper
        self._installed.append(wrap_optimizer_step(optimizer, self._before, self._after, entry=self._entry))

    def _uninstall(self) -> None:
        while self._installed:
            self._installed.pop().remove()
        self.own_skipped, self.own_scale = False, None

    # -- the boundary's halves, for every subscriber ---------------------------------------------
    def _entry(self) -> None:
        for s in self._subscribers:
            if s.active and s.entry is not None:
                s.entry()

    def _before(self) -> None:
        for s in self._subscribers:
            if s.active:
                s.before()

    def _after(self) -> None:
        for s in self._subscribers:
            if s.active:
                s.after()

    def run_skipped(self) -> None:
        """The boundary of a step the GradScaler skipped (``optimizer.step()`` never ran)."""
        _local.skipping = True
        try:
            subscribers = self._subscribers
            for s in subscribers:
                if s.active:
                    s.before()
            for s in subscribers:
                if s.active:
                    s.after()
        finally:
            _local.skipping = False

    def _watch_own_scaler(self) -> Handle:
        """Wrap ``optimizer.step`` (on the instance) to note a skip (``_skip_of``)."""
        optimizer = self.optimizer
        had_own = "step" in vars(optimizer)
        original = vars(optimizer).get("step")
        inner = optimizer.step
        boundary = self

        def step(_self: Any, *args: Any, **kwargs: Any) -> Any:
            boundary.own_skipped = False
            result = inner(*args, **kwargs)
            if _skip_of(optimizer, result):
                boundary.own_skipped = True
            return result

        optimizer.step = types.MethodType(step, optimizer)
        self.own_scale = _loss_scale_of(optimizer)

        def undo() -> None:
            if had_own:
                optimizer.step = original
            else:
                vars(optimizer).pop("step", None)

        return Handle(undo)


# The process's boundaries, by id of the optimizer as subscribed (the id the GradScaler and the
# sessions look up); only boundaries with a subscriber are kept, so an id is never stale.
_lock = threading.Lock()
_boundaries: dict[int, StepBoundary] = {}
_local = threading.local()  # .scalers: {id(optimizer): GradScaler} during scaler.step; .skipping


def subscribe(optimizer: Any, before: Callback, after: Callback, *, entry: Callback | None = None) -> Handle:
    """Call ``before``/``after`` (and ``entry``) at every step boundary of ``optimizer``: each
    ``optimizer.step()`` (``core.hooks.wrap_optimizer_step`` says when each runs) and each step a
    loss scaler skips (then ``before``/``after`` run, with :func:`skipping` or :func:`skipped` true).
    The wrapping is installed with the first subscriber and removed with the last."""
    subscriber = _Subscriber(entry, before, after)
    key = id(optimizer)
    with _lock:
        boundary = _boundaries.get(key)
        if boundary is None:
            boundary = _boundaries[key] = StepBoundary(optimizer)
        boundary.add(subscriber)
        if boundary.scaled_by_grad_scaler:
            _GRAD_SCALER.install()

    def unsubscribe() -> None:
        with _lock:
            boundary.discard(subscriber)
            if not boundary.subscribed and _boundaries.get(key) is boundary:
                del _boundaries[key]
            if not any([b.scaled_by_grad_scaler for b in _boundaries.values()]):
                _GRAD_SCALER.uninstall()

    return Handle(unsubscribe)


def skipping() -> bool:
    """True while the boundary of a step the GradScaler skipped runs."""
    return getattr(_local, "skipping", False)


def skipped(optimizer: Any) -> bool:
    """After ``optimizer``'s step: True when a loss scaler (GradScaler or its own) skipped it."""
    if getattr(_local, "skipping", False):  # ``skipping()`` inline: this runs every step
        return True
    boundary = _boundaries.get(id(optimizer))
    return boundary is not None and boundary.own_skipped


def current_scale(optimizer: Any) -> torch.Tensor | None:
    """The loss scale (a 1-element tensor, not synced) of the loss scaler stepping ``optimizer``."""
    scaler = getattr(_local, "scalers", {}).get(id(optimizer))
    if scaler is not None:
        return getattr(scaler, "_scale", None)
    boundary = _boundaries.get(id(optimizer))
    own = boundary.own_scale if boundary is not None else None
    return None if own is None else own()


class _GradScalerPatch:
    """``torch.amp.GradScaler.step`` replaced on the class while a torch optimizer is subscribed;
    ``uninstall`` puts the very same function object back."""

    def __init__(self) -> None:
        self.original: Callable | None = None

    def install(self) -> None:
        if self.original is None:
            self.original = torch.amp.GradScaler.step
            torch.amp.GradScaler.step = _scaler_step  # type: ignore[method-assign]

    def uninstall(self) -> None:
        if self.original is not None:
            torch.amp.GradScaler.step = self.original  # type: ignore[method-assign]
            self.original = None


_GRAD_SCALER = _GradScalerPatch()


def _scaler_step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
    original = _GRAD_SCALER.original or _find_original(type(self))
    boundary = _boundaries.get(id(optimizer))
    if boundary is None or not boundary.scaled_by_grad_scaler or not self.is_enabled():
        return original(self, optimizer, *args, **kwargs)
    scalers = getattr(_local, "scalers", None)
    if scalers is None:
        scalers = _local.scalers = {}
    scalers[id(optimizer)] = self
    try:
        result = original(self, optimizer, *args, **kwargs)
        if _grad_scaler_skipped(self, optimizer):
            boundary.run_skipped()
        return result
    finally:
        scalers.pop(id(optimizer), None)


def _find_original(cls: type[torch.amp.GradScaler]) -> Callable:
    # uninstalled while a step ran: the class attribute is the original again
    return cls.step if cls.step is not _scaler_step else torch.amp.GradScaler.step


def _grad_scaler_skipped(scaler: Any, optimizer: Any) -> bool:
    """Whether ``GradScaler.step`` just skipped ``optimizer.step()`` (its own test: found_inf > 0;
    the values are on the host already, ``_maybe_opt_step`` read them)."""
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    state = scaler._per_optimizer_states.get(id(optimizer), {})
    found = state.get("found_inf_per_device", {})
    return bool(found) and bool(sum(v.item() for v in found.values()))


# -- stacks with a loss scaler of their own -------------------------------------------------------


def _leaves(optimizer: Any) -> Iterator[Any]:
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
