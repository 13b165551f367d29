"""Thin wrappers that install hooks and give back handles.  No math, no I/O here."""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable
from typing import Any, cast

import torch

__all__ = [
    "Handle",
    "outside_compiled_graphs",
    "eager_only",
    "never_traced",
    "dynamo_compiling",
    "dynamo_frame_callback",
    "step_optimizer",
    "wrap_optimizer_step",
    "post_accumulate_grad_hook",
]


log = logging.getLogger(__name__)


class Handle:
    """Something that can be undone exactly once."""

    def __init__(self, undo: Callable[[], None]):
        self._undo: Callable[[], None] | None = undo

    def remove(self) -> None:
        if self._undo is not None:
            undo, self._undo = self._undo, None
            undo()


def step_optimizer(optimizer: Any) -> Any:
    """The object whose ``step()`` is the step boundary.

    Facades that pass as a torch optimizer (``isinstance`` is true) but keep no step-hook
    registry of their own and hold the real one are unwrapped: accelerate's
    ``AcceleratedOptimizer`` (its ``step()`` runs on every micro-batch and only steps the inner
    optimizer when gradients are synced) and Lightning's ``LightningOptimizer``.  Anything else
    (torch optimizers, DeepSpeed's and Megatron's optimizers, a duck-typed ``step()``) is its own
    boundary.  ``TypeError`` (one line) if the result has no ``step()``.
    """
    seen: set[int] = set()
    while _is_facade(optimizer) and id(optimizer) not in seen:
        seen.add(id(optimizer))
        optimizer = _inner_optimizer(optimizer)
    if not callable(getattr(optimizer, "step", None)):
        raise TypeError(
            f"trainmon: set_monitor(optimizer=...) got a {type(optimizer).__name__}, which has no "
            "step() method; pass the optimizer whose step() applies the update, or pass none "
            "and call monitor.step() after each optimizer step"
        )
    return optimizer


def _inner_optimizer(obj: Any) -> Any:
    own = vars(obj) if hasattr(obj, "__dict__") else {}
    for attr in ("optimizer", "_optimizer"):
        inner = own.get(attr)
        if inner is not None and inner is not obj and callable(getattr(inner, "step", None)):
            return inner
    return None


def _is_facade(obj: Any) -> bool:
    return isinstance(obj, torch.optim.Optimizer) and not _has_hook_registry(obj) and _inner_optimizer(obj) is not None


def _has_hook_registry(obj: Any) -> bool:
    return isinstance(getattr(obj, "__dict__", {}).get("_optimizer_step_pre_hooks"), dict)


def wrap_optimizer_step(
    optimizer: Any, before: Callable[[], None], after: Callable[[], None], *, entry: Callable[[], None] | None = None
) -> Handle:
    """Call ``before``/``after`` around every ``optimizer.step()`` (and ``entry`` first, at entry).

    ``before`` runs when the grads the update uses are final: at step entry, or, when ``step`` is
    given a closure (Lightning's automatic optimization, LBFGS, SAM-like optimizers), right after
    the closure's first call returns (its backward has run; no param was updated yet).  Optimizers
    that call the closure again (LBFGS re-evaluates during its line search) run more backward
    passes in the same step; those are not captured again.  ``entry`` runs at step entry in every
    case: the params are still those before the step there, even for optimizers that move them
    before calling the closure (SAM evaluates its closure at perturbed params).

    ``optimizer`` may be a facade (see :func:`step_optimizer`).  torch optimizers get the
    official step pre/post hooks (so LR schedulers, which re-wrap ``optimizer.step``, keep
    working); other objects with a ``step()`` (Megatron's, DeepSpeed's optimizers) get their
    ``step`` replaced on the instance only, restored on ``remove``.
    """
    target = step_optimizer(optimizer)
    boundary = _Boundary(before, after, entry)
    if isinstance(target, torch.optim.Optimizer) and _has_hook_registry(target):
        # args[0] is the optimizer itself; a pre-hook may return replacement (args, kwargs).
        pre = target.register_step_pre_hook(lambda _opt, args, kwargs: boundary.enter(args, kwargs, 1))
        post = target.register_step_post_hook(lambda *_: boundary.exit())

        def remove() -> None:
            pre.remove()
            post.remove()

        return Handle(remove)
    return _wrap_instance_step(target, boundary)


def _wrap_instance_step(optimizer: Any, boundary: _Boundary) -> Handle:
    had_own = "step" in vars(optimizer)
    original = vars(optimizer).get("step")
    inner = optimizer.step

    def step(self, *args, **kwargs):
        replaced = boundary.enter(args, kwargs, 0)
        if replaced is not None:
            args, kwargs = replaced
        result = inner(*args, **kwargs)
        boundary.exit()
        return result

    optimizer.step = types.MethodType(step, optimizer)

    def undo() -> None:
        if had_own:
            optimizer.step = original
        else:
            del optimizer.step

    return Handle(undo)


class _Boundary:
    """``before`` at the right moment of one ``step()`` call, ``after`` at its end."""

    def __init__(self, before: Callable[[], None], after: Callable[[], None], entry: Callable[[], None] | None = None):
        self._before = before
        self._after = after
        self._entry = entry
        self._pending = False  # a closure was given and has not returned yet

    def enter(self, args: tuple, kwargs: dict, first: int) -> tuple[tuple, dict] | None:
        """At step entry; ``args[first]`` is where a positional closure sits.  Returns the
        (args, kwargs) to call ``step`` with when the closure had to be wrapped."""
        if self._entry is not None:
            self._entry()
        if callable(kwargs.get("closure")):
            self._pending = True
            return args, {**kwargs, "closure": self._wrap(kwargs["closure"])}
        if "closure" not in kwargs and len(args) > first and callable(args[first]):
            self._pending = True
            return (*args[:first], self._wrap(args[first]), *args[first + 1 :]), kwargs
        self._pending = False
        self._before()
        return None

    def _wrap(self, closure: Callable[..., Any]) -> Callable[..., Any]:
        def closure_then_capture(*args: Any, **kwargs: Any) -> Any:
            result = closure(*args, **kwargs)
            if self._pending:
                self._pending = False
                with torch.no_grad():  # optimizers call closures under enable_grad()
                    self._before()
            return result

        return closure_then_capture

    def exit(self) -> None:
        if self._pending:  # the optimizer never called its closure: capture now, late but once
            self._pending = False
            self._before()
        self._after()


def post_accumulate_grad_hook(param: torch.Tensor, fn: Callable[[torch.Tensor], None]) -> Handle:
    h = param.register_post_accumulate_grad_hook(fn)
    return Handle(h.remove)


_compile_hint_given = False


def _hint_compiled() -> None:
    global _compile_hint_given
    if not _compile_hint_given:
        _compile_hint_given = True
        log.warning(
            "trainmon: the model runs under torch.compile; trainmon's module hooks run outside the "
            "compiled graphs (a graph break at each monitored module, values unchanged). For full "
            "compiled speed record activations only while investigating, or narrow 'targets'; "
            "weight grads, params and moments add no graph break"
        )


def _compile_probes() -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """(is Dynamo's frame callback set now, mark a code object never-compiled); no-ops if this
    torch lacks them (then hooks are traced as before, which is slower but right)."""
    try:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback
        from torch._dynamo.eval_frame import skip_code
    except ImportError:  # pragma: no cover - other torch versions
        return (lambda: None), (lambda code: None)
    return get_eval_frame_callback, skip_code


_dynamo_callback, _skip_code = _compile_probes()
# True while Dynamo traces (its own constant there), a plain False otherwise: tracing never reaches
# the callback probe, which Dynamo cannot trace.
_is_dynamo_compiling = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)


def outside_compiled_graphs(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as a module hook that ``torch.compile`` runs as it is instead of tracing it.

    Traced, a monitor hook would put its bookkeeping into the graph and guard on its state (the
    module's name, whether this step is collected): Dynamo recompiles for every monitored module and
    every switch of that state, then gives up with pages of warnings pointing into trainmon.  So
    the hook's own frame is never compiled, and while a compiled model runs (Dynamo's frame
    callback is set) the body runs with Dynamo off, nested calls included: one graph break per
    hook, values as in eager mode, and one hint of ours.  Eager training pays two calls (~40 ns).
    """
    eager = eager_only(fn)

    @functools.wraps(fn)
    def hook(*args: Any) -> Any:
        if dynamo_compiling() or dynamo_frame_callback() is not None:
            return eager(*args)
        return fn(*args)

    return never_traced(hook)


def eager_only(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run with Dynamo off (nested calls included), after our one hint: what a hook does
    while a compiled model runs (see ``outside_compiled_graphs``)."""

    def eager(*args: Any) -> Any:
        _hint_compiled()
        return fn(*args)

    return torch.compiler.disable(eager, recursive=True)


def never_traced(hook: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``hook``'s own frame never-compiled.  A hook built by hand instead of through
    ``outside_compiled_graphs`` (to save a frame on a hot path) starts with the same test:
    ``if dynamo_compiling() or dynamo_frame_callback() is not None: return eager_only(fn)(*args)``."""
    _skip_code(cast(types.FunctionType, hook).__code__)
    return hook


dynamo_compiling = _is_dynamo_compiling
dynamo_frame_callback = _dynamo_callback
