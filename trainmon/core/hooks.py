"""Thin wrappers that install hooks and give back handles.  No math, no I/O here."""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch

__all__ = [
    "Handle",
    "outside_compiled_graphs",
    "eager_only",
    "never_traced",
    "eager_gate",
    "step_optimizer",
    "wrap_optimizer_step",
    "post_accumulate_grad_hook",
    "skip_standalone_frames",
    "replace_recompile_warnings",
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
        # args[1] is where a positional closure sits; partial and a method: no frame of their own
        pre = target.register_step_pre_hook(functools.partial(boundary.enter, 1))
        post = target.register_step_post_hook(boundary.exit)

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
        replaced = boundary.enter(0, self, args, kwargs)
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

    def enter(self, first: int, _optimizer: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """At step entry (with ``first`` bound, a step pre-hook's signature); ``args[first]`` is
        where a positional closure sits.  Returns the (args, kwargs) to call ``step`` with when
        the closure had to be wrapped."""
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

    def exit(self, *_hook_args: Any) -> None:
        """At step exit (a step post-hook's signature: the optimizer, args and kwargs, unused)."""
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


def _compile_probes() -> tuple[Callable[[], Any], Callable[[types.CodeType, bool], None]]:
    """(is Dynamo's frame callback set now, set whether a code object is compiled when it starts
    a frame); no-ops if this torch lacks them (then hooks are traced as before, which is slower but
    right).  Both live in torch's C extension: importing ``torch._dynamo`` (seconds) is left to
    scripts that compile."""
    try:
        from torch._C._dynamo.eval_frame import (
            _FrameAction,
            _FrameExecStrategy,
            get_eval_frame_callback,
            set_code_exec_strategy,
        )
    except ImportError:  # pragma: no cover - other torch versions
        return (lambda: None), (lambda code, skip: None)
    skip = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT)  # what torch._dynamo's skip_code sets
    default = _FrameExecStrategy(_FrameAction.DEFAULT, _FrameAction.DEFAULT)

    def set_skipped(code: types.CodeType, skipped: bool) -> None:
        set_code_exec_strategy(code, skip if skipped else default)

    return get_eval_frame_callback, set_skipped


_dynamo_callback, _set_frame_skipped = _compile_probes()


def outside_compiled_graphs(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as a module hook that ``torch.compile`` runs as it is instead of tracing it.

    Traced, a monitor hook would put its bookkeeping into the graph and guard on its state (the
    module's name, whether this step is collected): Dynamo recompiles for every monitored module and
    every switch of that state, then gives up with pages of warnings pointing into trainmon.  So
    the hook's own frame is never compiled, and while a compiled model runs (Dynamo's frame
    callback is set) the body runs with Dynamo off, nested calls included: one graph break per
    hook, values as in eager mode, and one hint of ours.  Eager training pays one Python frame and
    one C call (Dynamo's frame-callback probe) on top of ``fn``: Dynamo never traces the hook
    (``never_traced``), so the probe is the whole compile test.
    """
    eager = eager_only(fn)
    probe = _dynamo_callback

    @functools.wraps(fn)
    def hook(*args: Any) -> Any:
        if probe() is not None:
            return eager(*args)
        return fn(*args)

    return never_traced(hook)


def eager_only(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run with Dynamo off (nested calls included), after our one hint: what a hook does
    while a compiled model runs (see ``outside_compiled_graphs``).  ``torch.compiler.disable``
    imports ``torch._dynamo``, so it is built at the first call: only a compiled model gets
    here, and Dynamo is loaded by then."""
    disabled: Callable[..., Any] | None = None

    def eager(*args: Any) -> Any:
        nonlocal disabled
        if disabled is None:

            def hinted(*inner: Any) -> Any:
                _hint_compiled()
                return fn(*inner)

            disabled = torch.compiler.disable(hinted, recursive=True)
        return disabled(*args)

    return never_traced(eager)


def never_traced(hook: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``hook`` as ``torch._dynamo.skip`` does, without importing Dynamo: its own frame is
    never compiled, and Dynamo never inlines it into a traced caller (a graph break at the call;
    the hook then runs as plain Python while the compiled code's frame callback is set).  So a
    hook never runs under tracing, and Dynamo's frame-callback probe is its whole compile test
    (``outside_compiled_graphs``, ``eager_gate``)."""
    _set_frame_skipped(cast(types.FunctionType, hook).__code__, True)
    hook._torchdynamo_disable = True  # type: ignore[attr-defined]  # what Dynamo reads: never inline this
    return hook


def eager_gate(
    fn: Callable[..., Any],
    general: Callable[..., Any],
    clock: Any,
    failed: set[str],
    name: str,
    on_error: Callable[[], None],
) -> Callable[..., Any]:
    """A gated hook for the hottest paths (activation hooks: several per module per step) that
    costs one Python frame, not two: what ``Guard.gated`` does in eager mode (run ``fn`` while
    ``clock.collecting`` and ``name`` is not in ``failed``, ``on_error()`` if it raises), with
    the compile test reduced to Dynamo's frame-callback probe (a C call).  Whenever compiled code
    runs (the probe is set) the call goes to ``general``, the compile-aware path.  Dynamo never
    traces the hook itself (``never_traced``)."""
    probe = _dynamo_callback

    def hook(*args: Any) -> Any:
        if probe() is None:
            if clock.collecting and name not in failed:
                try:
                    return fn(*args)
                except Exception:
                    on_error()
            return None
        return general(*args)

    return never_traced(hook)


_standalone_skips: dict[types.CodeType, int] = {}  # code -> monitors that asked: the last one restores


def skip_standalone_frames(codes: Iterable[types.CodeType]) -> Handle:
    """Never compile ``codes`` as frames of their own; inside a compiled caller they are still
    traced as before (Dynamo inlines them).  For the forwards of modules whose monitor hooks break
    the compiled graph at their boundary: each such module's forward starts a frame that Dynamo
    would compile on its own, once per shape, all instances of a class sharing one code object and
    its ``recompile_limit`` (8).  One-op modules (Linear, LayerNorm, GELU...) gain nothing from
    that and a model has more than 8 shapes of them.  Restored by the last monitor that set it."""
    mine = list(dict.fromkeys(codes))
    for code in mine:
        _standalone_skips[code] = _standalone_skips.get(code, 0) + 1
        _set_frame_skipped(code, True)

    def undo() -> None:
        for code in mine:
            left = _standalone_skips.pop(code, 1) - 1
            if left > 0:
                _standalone_skips[code] = left
            else:
                _set_frame_skipped(code, False)

    return Handle(undo)


_DYNAMO_FRAME_LOGGER = "torch._dynamo.convert_frame"


class _RecompileLimitHint(logging.Filter):
    """Dynamo's recompile-limit warning for code in ``files`` (the monitored model's modules),
    replaced by one trainmon line per function saying why the limit is reached there."""

    def __init__(self, files: set[str]):
        super().__init__()
        self.files = files
        self.told: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if not (isinstance(record.msg, str) and record.msg.startswith("torch._dynamo hit config.")):
            return True
        args = record.args if isinstance(record.args, tuple) else ()
        if len(args) < 4 or not isinstance(args[2], str):
            return True
        function = args[2]  # "'forward' (/path/to/file.py:130)"
        path = function.rpartition(" (")[2].rpartition(":")[0]
        if path not in self.files or not _compile_hint_given:
            return True  # not the model's code, or no hook of ours ran in a compiled model yet
        if function not in self.told:
            self.told.add(function)
            log.warning(
                "trainmon: torch.compile reached %s=%s for %s (last reason: %s): trainmon's hooks "
                "break the compiled model at each module recorded by xy_distribution, so Dynamo "
                "compiles those modules' code piece by piece, once per shape and grad mode; further "
                "variants run uncompiled, values unchanged. Record fewer modules ('targets') or raise "
                "torch._dynamo.config.%s",
                args[0],
                args[1],
                function,
                args[3],
                args[0],
            )
        return False


def replace_recompile_warnings(files: Iterable[str]) -> Handle:
    """Install ``_RecompileLimitHint`` for ``files`` on Dynamo's frame logger (by name: Dynamo
    need not be imported) until the handle is removed."""
    hint = _RecompileLimitHint(set(files))
    logger = logging.getLogger(_DYNAMO_FRAME_LOGGER)
    logger.addFilter(hint)
    return Handle(lambda: logger.removeFilter(hint))
