"""Collector base, registry, and the context collectors are built from.

A collector turns one kind of training data into ``engine.capture`` calls.  It never writes.
Surface: ``attach`` (install hooks), ``on_step_entry`` (``optimizer.step()`` entered, params
not yet touched), ``on_step_begin`` (the update's grads are final: at entry too, or after a
closure's backward) / ``on_step_end`` (step exit), on collected steps only, ``detach`` (remove
everything it installed).
"""

from __future__ import annotations

import functools
import itertools
import logging
import operator
from abc import ABC
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn as nn

from trainmon.config import MonitorConfig
from trainmon.core.hooks import (
    Handle,
    eager_gate,
    eager_only,
    outside_compiled_graphs,
)
from trainmon.core.naming import TargetMatcher, TrackedParam
from trainmon.core.schedule import StepClock
from trainmon.stats.engine import StatsEngine, Tracked

__all__ = [
    "Collector",
    "CollectorContext",
    "register_collector",
    "collector_classes",
    "Guard",
    "capture_views",
    "capture_plain",
    "FamilyRows",
]

log = logging.getLogger(__name__)


@dataclass
class CollectorContext:
    """Everything a collector may read.  Built once per ``set_monitor``."""

    config: MonitorConfig
    chunks: Sequence[nn.Module]
    params: list[TrackedParam]  # trainable params selected by ``targets``
    matcher: TargetMatcher
    engine: StatsEngine
    clock: StepClock
    optimizer: Any = None
    use_main_grad: bool = False
    distributed: bool = False  # grads may be reduced during backward
    dp_group: Any = None
    tp_group: Any = None
    integration: Any = None  # trainmon.integrations.base.Integration
    run_dir: Any = None  # pathlib.Path of the run, None when nothing is written
    rank: int = 0
    guard: Guard = field(default=None)  # type: ignore[assignment]


def capture_views(
    ctx: CollectorContext, family: str, pairs: Sequence[tuple[TrackedParam, Any]], micro_step: int | None = None
) -> None:
    """Capture ``(param, View)`` pairs; shards of one process group are merged over it."""
    if all(
        view.group is None and getattr(view, "scale", None) is None for _, view in pairs
    ):  # plain tensors: one capture
        items = [Tracked(tp.name, view.tensor, tp.vpp_stage, view.shape) for tp, view in pairs]
        if not any(it.tensor.is_complex() for it in items):
            ctx.engine.capture(family, items, micro_step=micro_step)
            return
    by_group: dict[tuple[int, int], tuple[Any, Any, list[Tracked]]] = {}
    for tp, view in pairs:
        scale = getattr(view, "scale", None)
        entry = by_group.setdefault((id(view.group), id(scale)), (view.group, scale, []))
        entry[2].append(Tracked(tp.name, view.tensor, tp.vpp_stage, view.shape))
    for group, scale, items in by_group.values():
        if not any(it.tensor.is_complex() for it in items):
            ctx.engine.capture(family, items, micro_step=micro_step, group=group, scale=scale)
            continue
        for complex_run, same in itertools.groupby(items, key=lambda it: it.tensor.is_complex()):
            run = list(same)  # consecutive items of one kind: the rows keep the params' order
            if complex_run:
                _capture_modulus(ctx, family, run, micro_step, group, scale)
            else:
                ctx.engine.capture(family, run, micro_step=micro_step, group=group, scale=scale)


@torch.no_grad()
def _capture_modulus(
    ctx: CollectorContext, family: str, items: list[Tracked], micro_step: int | None, group: Any, scale: Any = None
) -> None:
    """Complex tensors: every statistic is of the modulus ``|z|`` (so ``norm`` is the complex
    2-norm, ``min``/``max``/``mean`` are of ``|z|``), recorded under the tensor's own dtype."""
    rows = ctx.engine.partials([it.tensor.abs() for it in items])
    ctx.engine.capture_rows(family, items, rows, micro_step=micro_step, group=group, scale=scale)


@dataclass(frozen=True, slots=True)
class _PlainView:
    """A whole tensor as ``capture_views`` takes it (no shard group, no shape, no scale)."""

    tensor: torch.Tensor
    group: Any = None
    shape: Any = None
    scale: Any = None


def capture_plain(
    ctx: CollectorContext, family: str, params: Sequence[TrackedParam], tensors: Sequence[torch.Tensor | None]
) -> None:
    """``capture_views`` of whole tensors (``None``: that param has none): the path of what
    ``FamilyRows`` does not take (complex tensors, recorded by their modulus)."""
    capture_views(ctx, family, [(tp, _PlainView(t)) for tp, t in zip(params, tensors) if t is not None])


_present = functools.partial(operator.is_not, None)  # map()/filter() of it: no Python frame per item
_dtype_of = operator.attrgetter("dtype")
_numel_of: Any = torch.Tensor.numel


class FamilyRows:
    """One family's rows, step after step, with no Python work per tensor.

    The rows' names, stages, shapes and dtypes (the layout) are built once into a
    ``stats.engine.FamilyBlock`` that the engine captures as a whole
    (``StatsEngine.capture_block``: one multi-tensor call, one pending entry); a step only checks,
    with ``map``/``filter`` over the tensors (loops in C: no Python frame per tensor), that they
    still fit it: which params have one, their dtypes and element counts.  It is rebuilt when they
    do not (a grad appeared or went, a dtype or size changed, params joined).  Rows are reported
    under the param's shape (read at the rebuild: a param reshaped in place to the same number of
    elements keeps its old shape in the rows).  For integrations whose Views are the tensors
    themselves (``Integration.plain_views``); the others go through ``capture_views``.
    """

    __slots__ = ("_block", "_complex", "_dtypes", "_key", "_numels", "_present", "engine", "family")

    def __init__(self, engine: StatsEngine, family: str):
        self.engine, self.family = engine, family
        self._key: tuple[int, int] | None = None
        self._present: list[bool] | None = None
        self._dtypes: list[torch.dtype] = []
        self._numels: list[int] = []
        self._block: Any = None
        self._complex = False

    def capture(
        self, params: list[TrackedParam], tensors: list[torch.Tensor | None], micro_step: int | None = None
    ) -> bool:
        """Capture ``tensors`` (``None``: that param has none now) as the rows of ``params``.
        False, with nothing captured, for tensors this path does not take (complex ones: the
        caller records them by modulus through ``capture_views``)."""
        kept = list(filter(_present, tensors))
        present = None if len(kept) == len(tensors) else list(map(_present, tensors))
        dtypes = list(map(_dtype_of, kept))
        numels = list(map(_numel_of, kept))
        key = (id(params), len(params))
        if key != self._key or present != self._present or dtypes != self._dtypes or numels != self._numels:
            self._rebuild(params, present, dtypes, numels)
            self._key = key
        if self._complex:
            return False
        self.engine.capture_block(self.family, self._block, kept, micro_step)  # type: ignore[arg-type]
        return True

    def _rebuild(
        self, params: list[TrackedParam], present: list[bool] | None, dtypes: list[torch.dtype], numels: list[int]
    ) -> None:
        self._present, self._dtypes, self._numels = present, dtypes, numels
        self._complex = any(d.is_complex for d in dtypes)
        with_tensor = params if present is None else [tp for tp, here in zip(params, present) if here]
        items = [  # a new block: the engine keeps the old one until its step is written
            (tp.name, tp.vpp_stage, tuple(tp.param.shape), dtype) for tp, dtype in zip(with_tensor, dtypes)
        ]
        self._block = self.engine.block(items, dtypes, numels)


class Collector(ABC):
    """Base class; subclasses set ``name``, ``priority`` and ``enabled`` and register themselves.

    ``priority`` orders the collectors' step hooks (lower first); ties by name.
    """

    name: ClassVar[str]
    priority: ClassVar[int] = 100
    # False for collectors of what the optimizer step changes (params, moments): a step the AMP
    # loss scaler skipped changed nothing, so they record nothing for it (core.step_boundary).
    runs_on_skipped_steps: ClassVar[bool] = True

    def __init__(self, ctx: CollectorContext):
        self.ctx = ctx
        self.handles: list[Handle] = []

    @staticmethod
    def enabled(config: MonitorConfig) -> bool:
        raise NotImplementedError

    def attach(self) -> None:
        pass

    def on_step_entry(self) -> None:
        pass

    def on_step_begin(self) -> None:
        pass

    def on_step_end(self) -> None:
        pass

    def quiet_hooks(self) -> tuple[str, ...]:
        """Step methods (``on_step_entry``, ``on_step_begin``, ``on_step_end``) this collector
        overrides but that do nothing under its config: the session does not call them.  Asked
        again when the collectors or the params change, and after the first ``record_loss``."""
        return ()

    def on_params_joined(self, params: list[TrackedParam]) -> None:
        """``params`` were just added to ``ctx.params`` (unfrozen, or handed to the optimizer
        after ``set_monitor``: ``runtime.param_watch``), before a collected step's forward or at
        its optimizer step entry.  Collectors that hook params one by one hook these."""

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


_REGISTRY: dict[str, type[Collector]] = {}


def register_collector(cls: type[Collector]) -> type[Collector]:
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"collector '{cls.name}' is already registered by {_REGISTRY[cls.name].__qualname__}")
    _REGISTRY[cls.name] = cls
    return cls


def collector_classes() -> list[type[Collector]]:
    """Registered collectors by ``priority`` (lower first): the order of their step hooks."""
    return sorted(_REGISTRY.values(), key=lambda c: (c.priority, c.name))


class Guard:
    """Runs collector code so that a failure switches that collector off, never the training.

    A tensor the statistics cannot be computed for never gets here: the engine retries a failed
    batch one tensor at a time and skips only that tensor, with one warning naming it
    (``stats.odd_tensors``), so one bad tensor cannot switch a collector off or take its batch's
    other rows with it."""

    def __init__(self, on_failure: Callable[[Collector], None]):
        self._on_failure = on_failure
        self.failed: set[str] = set()

    def run(self, collector: Collector, fn: Callable[..., Any], *args: Any) -> Any:
        if collector.name in self.failed:
            return None
        try:
            return fn(*args)
        except Exception:
            self._fail(collector)
            return None

    def fail(self, collector: Collector) -> None:
        """``collector`` raised (the exception being handled): log it and switch it off."""
        self._fail(collector)

    def gated(self, collector: Collector, fn: Callable[..., Any], clock: StepClock) -> Callable[..., Any]:
        """``wrap`` for hooks that do nothing on steps that are not collected: one flag check
        then, and on collected steps a single Python frame around ``fn`` (``eager_gate``: the
        compile test, the step check and the failure guard together: hooks run hundreds of times
        per step)."""
        failed, name, fail = self.failed, collector.name, self._fail

        def body(*args: Any) -> Any:
            if clock.collecting and name not in failed:
                try:
                    return fn(*args)  # None but for forward pre-hooks handing the module new args
                except Exception:
                    fail(collector)
            return None

        return eager_gate(fn, eager_only(body), clock, failed, name, functools.partial(fail, collector))

    def _fail(self, collector: Collector) -> None:
        self.failed.add(collector.name)
        log.exception(
            "trainmon: collector '%s' failed at step %d and is switched off; training continues",
            collector.name,
            collector.ctx.clock.step,
        )
        self._on_failure(collector)

    def wrap(self, collector: Collector, fn: Callable[..., Any]) -> Callable[..., None]:
        """A hook body that goes through ``run`` (hooks must return None: never alter grads);
        ``torch.compile`` runs it eagerly instead of tracing it (``outside_compiled_graphs``)."""

        def hook(*args: Any) -> None:
            self.run(collector, fn, *args)

        return outside_compiled_graphs(hook)
