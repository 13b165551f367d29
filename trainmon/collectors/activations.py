"""Module inputs/outputs and their gradients (``xy_distribution``).

Emits, for every selected module and every micro-batch of a collected step:

=========== ==================================== =============================================
family      when                                 value
=========== ==================================== =============================================
actv        forward pre-hook (inputs),           ``<module>.input[.<i>]``, ``<module>.output[.<i>]``
            forward hook (outputs)               as they are at that moment
actv_grad   when autograd has the gradient of    outputs: d loss / d that tensor (summed over all
            the tensor (tensor hook)             its consumers); inputs: the gradient flowing
                                                 into the input through this module only
                                                 (``register_full_backward_hook``'s ``grad_input``)
=========== ==================================== =============================================

Columns ``vpp_stage,name,step,micro_step,<ops...>,shape,dtype``.  ``micro_step`` is the index
of the model's forward pass in the step (``actv``) and of the backward pass (``actv_grad``).

Config: ``{"xy_distribution": true, "targets": ["layers.0", ...]}`` or ``"all_xy": true``;
``forward_only`` / ``backward_only``.  Names: see ``module_io``.

Input grads: on collected steps the forward pre-hook hands the module an alias of each input
that needs a grad (``aten.alias``: same storage and values, no kernel) and hooks the alias, so
its gradient is only what this module sends back; the alias's backward passes the gradient on
unchanged, so training is bitwise unchanged.  Where the alias is the input's only consumer its
gradient is the very tensor the input receives: one reduction serves both names.  A module that
modifies its input in place loses the alias's hook; then the input's total gradient is recorded.
Tensors inside containers other than plain tuples, lists and dicts are hooked as they are
(total gradient).  Per-target specs (``{"input": "tuple[2]:0", ...}``) choose which inputs,
outputs and their grads are recorded.

A copy of the model (``copy.deepcopy(model)``, the EMA idiom) carries these hooks: they check
that the module they fire for is the monitored one and do nothing for a copy.

Design: stats are computed inside the hook (partials stay on the device, no host read), so an
in-place op later in the forward cannot change them and nothing holds the activation.  A tensor
seen twice unchanged (output of one module, input of the next) is reduced once.  Forwards that
run inside the autograd engine are checkpoint recomputations: they record no ``actv`` (the
micro-batch was recorded in the real forward), but grad hooks are installed on them because the
reentrant checkpoint's backward runs through the recomputed graph.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any

import torch
import torch.nn as nn

from trainmon.collectors.base import Collector, register_collector
from trainmon.collectors.module_io import (
    HookedModule,
    hook_fn,
    in_backward,
    io_names,
    is_recordable,
    model_files,
    pick,
    replace_tensors,
    select_modules,
    standalone_forwards,
    tensors_of,
    uses_compile,
)
from trainmon.core.dtensor import dtensor_parts
from trainmon.core.hooks import Handle, replace_recompile_warnings, skip_standalone_frames
from trainmon.families import Family
from trainmon.stats.engine import Tracked

__all__ = ["ActivationCollector"]

log = logging.getLogger(__name__)

_alias = torch.ops.aten.alias.default  # a view with the same elements; its backward returns grad itself


class _RowCache:
    """Partials rows of tensors already reduced in this pass, by identity and version."""

    def __init__(self) -> None:
        self._rows: dict[int, tuple[Any, int, torch.Tensor]] = {}

    def get(self, t: torch.Tensor) -> torch.Tensor | None:
        hit = self._rows.get(id(t))
        if hit is None or hit[0]() is not t or _version(t) != hit[1]:
            return None
        return hit[2]

    def put(self, t: torch.Tensor, row: torch.Tensor) -> None:
        version = _version(t)
        if version >= 0:
            self._rows[id(t)] = (weakref.ref(t), version, row)

    def clear(self) -> None:
        self._rows.clear()


class _HookedTensors:
    """The (vpp_stage, name)s hooked on each tensor in this step.  One grad hook per tensor serves
    every name it has (the output of one module is often the input of the next), as long as the
    tensor has not been modified in place in between: after ``ReLU(inplace=True)`` the same
    tensor object holds other values with another gradient, so the version is part of the key.
    A non-reentrant checkpoint recomputes with the very input tensors of the first forward: their
    names are already there, so their gradient is not recorded twice."""

    def __init__(self) -> None:
        self._names: dict[tuple[int, int], tuple[Any, list[tuple[int, str]]]] = {}

    def names(self, t: torch.Tensor) -> list[tuple[int, str]] | None:
        entry = self._names.get((id(t), t._version))
        return entry[1] if entry is not None and entry[0]() is t else None

    def add(self, t: torch.Tensor, names: list[tuple[int, str]]) -> None:
        self._names[(id(t), t._version)] = (weakref.ref(t), names)

    def clear(self) -> None:
        self._names.clear()


_PLAIN = (torch.Tensor, nn.Parameter)


def _waited(t: torch.Tensor) -> torch.Tensor:
    """The values of an ``AsyncCollectiveTensor`` (the output of a tensor-parallel module whose
    reduction is still in flight): its data is not there until waited on."""
    wait = getattr(t, "trigger_wait", None) if type(t).__name__ == "AsyncCollectiveTensor" else None
    return wait() if wait is not None else t


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def _same_elements_base(t: torch.Tensor) -> torch.Tensor | None:
    """The base of view ``t`` when both are contiguous and hold exactly the same elements."""
    base = t._base
    if (
        base is None
        or not base.requires_grad
        or base.numel() != t.numel()
        or base.storage_offset() != t.storage_offset()
        or base.dtype != t.dtype
        or not (t.is_contiguous() and base.is_contiguous())
    ):
        return None
    return base


def _version(t: torch.Tensor) -> int:
    return -1 if t.is_inference() else t._version  # inference tensors have no version counter


@register_collector
class ActivationCollector(Collector):
    name = "activations"
    priority = 10

    @staticmethod
    def enabled(config) -> bool:
        return config.xy_distribution

    def attach(self) -> None:
        cfg = self.ctx.config
        self._live = True
        self._forward = not cfg.backward_only
        self._backward = not cfg.forward_only
        self._cache = _RowCache()
        self._hooked = _HookedTensors()
        self._counts: list[int] = [0] * len(self.ctx.chunks)
        self._count_step = self.ctx.clock.step
        # True from the start of a model forward without autograd (torch.no_grad, inference_mode:
        # an evaluation) to the start of the next forward: its modules record nothing.
        self._eval_pass = False
        # chunk -> engine.mark() at the start of its forward, until the forward returns: a
        # forward still open when the next one starts (or the step ends) raised.
        self._open: dict[int, tuple[int, int]] = {}
        self._warned_raise = False
        if cfg.module_ranks and self.ctx.rank not in cfg.module_ranks:
            return  # this rank writes nothing: hook nothing
        self._warned: set = set()
        specs = [(raw, cfg.spec_of(raw)) for raw, _ in cfg.target_specs]
        self.modules = select_modules(self.ctx.chunks, self.ctx.matcher, cfg.all_xy, cfg.squash_name, specs)
        compiled = uses_compile(self.ctx.chunks)
        if compiled and self.modules:
            log.warning(
                "trainmon: the model uses torch.compile; each of the %d modules recorded "
                "by xy_distribution runs its hooks eagerly (a graph break), so the values are "
                "those of the uncompiled module boundaries and the compiled model runs in "
                "more pieces (select fewer modules with targets to keep it fast)",
                len(self.modules),
            )
        if self.modules:  # whether the model is compiled before or after set_monitor
            self.handles.append(skip_standalone_frames(standalone_forwards(self.modules)))
            self.handles.append(replace_recompile_warnings(model_files(self.ctx.chunks)))
        wrap = lambda fn: hook_fn(self._gated(fn), compiled)  # noqa: E731
        for vpp, chunk in enumerate(self.ctx.chunks):  # first: counting runs before recording
            self._hook(chunk.register_forward_pre_hook(wrap(functools.partial(self._chunk_begins, vpp))))
            self._hook(chunk.register_forward_hook(wrap(functools.partial(self._chunk_ends, vpp))))
        for hm in self.modules:
            self._hook(hm.module.register_forward_pre_hook(wrap(functools.partial(self._inputs, hm)), with_kwargs=True))
            self._hook(hm.module.register_forward_hook(wrap(functools.partial(self._outputs, hm))))
        self._grad_hook = self.ctx.guard.gated(self, self._on_grad, self.ctx.clock)
        self._base_grad_hook = self.ctx.guard.gated(self, self._on_base_grad, self.ctx.clock)
        self._backward_mark = self.ctx.guard.wrap(self, self._on_backward_start)

    def _gated(self, fn: Any) -> Any:
        """A module hook that costs one flag check on steps that are not collected."""
        return self.ctx.guard.gated(self, fn, self.ctx.clock)

    def _hook(self, handle: Any) -> None:
        self.handles.append(Handle(handle.remove))

    def on_params_joined(self, params: list) -> None:
        """A module added after set_monitor brings params (runtime.param_watch): hook the
        modules the config selects now that are not hooked yet, before this forward reaches them."""
        if not hasattr(self, "modules"):
            return  # this rank hooks nothing (module_ranks)
        cfg, known = self.ctx.config, {id(hm.module) for hm in self.modules}
        specs = [(raw, cfg.spec_of(raw)) for raw, _ in cfg.target_specs]
        now = select_modules(self.ctx.chunks, self.ctx.matcher, cfg.all_xy, cfg.squash_name, specs)
        compiled = uses_compile(self.ctx.chunks)
        for hm in [hm for hm in now if id(hm.module) not in known]:
            self.modules.append(hm)
            pre = hook_fn(self._gated(functools.partial(self._inputs, hm)), compiled)
            post = hook_fn(self._gated(functools.partial(self._outputs, hm)), compiled)
            self._hook(hm.module.register_forward_pre_hook(pre, with_kwargs=True))
            self._hook(hm.module.register_forward_hook(post))

    # -- forward ---------------------------------------------------------------------------
    def _chunk_begins(self, vpp: int, module: nn.Module, _args: Any) -> None:
        clock = self.ctx.clock
        if module is not self.ctx.chunks[vpp] or not clock.collecting or in_backward():
            return  # not the monitored chunk: a copy of the model (copy.deepcopy) carries the hook
        # Decided once per forward, here, not per module: a reentrant checkpoint runs its
        # segment's real forward with grad off inside a training forward.
        self._eval_pass = not torch.is_grad_enabled()
        if self._eval_pass:
            return  # an evaluation is no training micro-batch: no row, no micro_step taken
        if self._count_step != clock.step:
            self._count_step = clock.step
            self._counts = [0] * len(self._counts)
            self._open.clear()
        elif vpp in self._open:
            self._drop_unfinished(vpp)
        self._counts[vpp] += 1
        self._open[vpp] = self.ctx.engine.mark()
        self._cache.clear()

    def _drop_unfinished(self, vpp: int) -> None:
        """The last forward of chunk ``vpp`` raised before returning (caught by the training
        loop): its rows belong to no micro-batch, and the next forward takes its micro_step."""
        dropped = self.ctx.engine.drop_since(self._open.pop(vpp), Family.ACTV, vpp)
        self._counts[vpp] -= 1
        if not self._warned_raise:
            self._warned_raise = True
            log.warning(
                "trainmon: a forward of the model raised before returning (step %d); its %d actv "
                "rows are dropped and the next forward takes its micro_step. Warned once",
                self.ctx.clock.step,
                dropped,
            )

    def _chunk_ends(self, vpp: int, module: nn.Module, _args: Any, output: Any) -> None:
        """Close the forward; mark the start of backward on the model's output, so the
        backward-pass count is kept by the outermost backward even when checkpointed segments
        run nested ones."""
        if module is not self.ctx.chunks[vpp] or not self.ctx.clock.collecting or in_backward():
            return
        self._open.pop(vpp, None)
        if not self._backward or not torch.is_grad_enabled():
            return
        for t in tensors_of(output):
            if t.requires_grad:
                t.register_hook(self._backward_mark)
                return

    def _on_backward_start(self, _grad: torch.Tensor) -> None:
        if self._live and self.ctx.clock.collecting:
            self.ctx.clock.enter_backward()

    def _inputs(self, hm: HookedModule, module: nn.Module, args: Any, kwargs: Any) -> Any:
        """Records the inputs; returns (args, kwargs) with aliases of the inputs whose grads are
        recorded (None: the module's arguments unchanged)."""
        if module is not hm.module or self._eval_pass:
            return None  # a copy of the model (copy.deepcopy) carries the hook, or an evaluation
        if not kwargs and len(args) == 1 and type(args[0]) in _PLAIN and not hm.spec and is_recordable(args[0]):
            return self._one_input(hm, args[0])  # the common call: one plain tensor, fewer frames
        tensors = tensors_of(kwargs, tensors_of(args)) if kwargs else tensors_of(args)
        if not tensors:
            return None
        names = io_names(hm.label, "input", len(tensors))
        self._record_actv(hm, "input", names, tensors)
        if not (self._backward and torch.is_grad_enabled()):
            return None
        want = [i for i in pick(hm, "input_grad", len(tensors), self._warned) if tensors[i].requires_grad]
        if not want:
            return None
        labels: dict[int, list[tuple[int, str]]] = {}  # id(input) -> its names in this call
        for i in want:
            labels.setdefault(id(tensors[i]), []).append((hm.vpp_stage, names[i]))
        recompute = in_backward()
        made: dict[int, torch.Tensor] = {}

        def swap(t: torch.Tensor, replaceable: bool) -> torch.Tensor:
            # One alias per distinct input: a tensor passed several times (attention's query, key
            # and value) stays one object, so ``query is key`` checks in the module still hold.
            mine = labels.get(id(t))
            if mine is None:
                return t
            if id(t) in made:
                return made[id(t)]
            if not replaceable:  # inside a container we cannot rebuild: its total gradient
                for name in mine:
                    self._hook_shared(t, name)
                made[id(t)] = t
                return t
            made[id(t)] = a = _alias(t)
            # In a checkpoint's recompute no fallback: a non-reentrant one never backpropagates
            # through the recomputed graph (the alias's hook stays silent, the input's would not).
            self._hook_grad(a, mine, fallback=not recompute)
            return a

        new_args = replace_tensors(args, swap)
        new_kwargs = replace_tensors(kwargs, swap) if kwargs else kwargs
        swapped = any(made.get(id(t), t) is not t for t in tensors)
        return (new_args, new_kwargs) if swapped else None

    def _one_input(self, hm: HookedModule, t: torch.Tensor) -> Any:
        """``_inputs`` for a module called with one plain tensor and no per-target spec."""
        name = io_names(hm.label, "input", 1)[0]
        recompute = in_backward()
        if self._forward and not recompute:
            self._capture_one(Family.ACTV, hm.vpp_stage, name, t, self._micro(hm.vpp_stage))
        if not (self._backward and t.requires_grad and torch.is_grad_enabled()):
            return None
        a = _alias(t)
        self._hook_grad(a, [(hm.vpp_stage, name)], fallback=not recompute)
        return (a,), {}

    def _outputs(self, hm: HookedModule, module: nn.Module, _args: Any, output: Any) -> None:
        if module is not hm.module or self._eval_pass:
            return  # a copy of the model (copy.deepcopy) carries the hook, or an evaluation
        if type(output) in _PLAIN and not hm.spec and is_recordable(output):  # the common call
            name = io_names(hm.label, "output", 1)[0]
            if self._forward and not in_backward():
                self._capture_one(Family.ACTV, hm.vpp_stage, name, output, self._micro(hm.vpp_stage))
            if self._backward and output.requires_grad and torch.is_grad_enabled():
                self._hook_shared(output, (hm.vpp_stage, name))
            return
        tensors = tensors_of(output)
        if not tensors:
            return
        names = io_names(hm.label, "output", len(tensors))
        self._record_actv(hm, "output", names, tensors)
        if self._backward and torch.is_grad_enabled():
            for i in pick(hm, "output_grad", len(tensors), self._warned):
                if tensors[i].requires_grad:
                    self._hook_shared(tensors[i], (hm.vpp_stage, names[i]))

    def _record_actv(self, hm: HookedModule, kind: str, names: tuple[str, ...], tensors: list[torch.Tensor]) -> None:
        if not self._forward or in_backward():
            return  # forwards inside backward are checkpoint recomputations: recorded already
        chosen = pick(hm, kind, len(tensors), self._warned)
        if len(chosen) != len(tensors):
            names, tensors = tuple(names[i] for i in chosen), [tensors[i] for i in chosen]
        if tensors:
            self._capture(Family.ACTV, hm.vpp_stage, list(names), tensors, self._micro(hm.vpp_stage))

    def _micro(self, vpp: int) -> int:
        """The forward pass (micro-batch) of chunk ``vpp`` running now."""
        return max(self._counts[vpp] - 1, 0) if self._count_step == self.ctx.clock.step else 0

    def _hook_shared(self, t: torch.Tensor, name: tuple[int, str]) -> None:
        """One grad hook per tensor serves every name it has (output of one module and of its parent)."""
        hooked = self._hooked.names(t)
        if hooked is None:
            self._hook_grad(t, [name])
        elif name not in hooked:
            hooked.append(name)

    def _hook_grad(self, t: torch.Tensor, names: list[tuple[int, str]], fallback: bool = True) -> None:
        self._hooked.add(t, names)
        fired = [False]
        t.register_hook(functools.partial(self._grad_hook, names, fired))
        base = _same_elements_base(t) if fallback else None
        if base is not None:
            # A hook on a view is lost when the view is later modified in place (Linear on a 3-D
            # input returns a view; ReLU(inplace=True) then rebases it).  Its base still gets
            # the gradient of these very elements, after the view's would have: it is used only
            # when the view's own hook did not run.
            base.register_hook(functools.partial(self._base_grad_hook, names, fired, tuple(t.shape)))

    # -- backward --------------------------------------------------------------------------
    def _on_grad(self, names: list[tuple[int, str]], fired: list[bool], grad: torch.Tensor | None) -> None:
        fired[0] = True
        if grad is not None and self._live:
            if len(names) == 1:  # the common case, fewer frames
                micro = self.ctx.clock.enter_backward()
                self._capture_one(Family.ACTV_GRAD, names[0][0], names[0][1], grad, micro)
            else:
                self._capture_grad(names, grad, None)

    def _on_base_grad(
        self, names: list[tuple[int, str]], fired: list[bool], shape: tuple[int, ...], grad: torch.Tensor | None
    ) -> None:
        if not fired[0] and grad is not None and self._live:  # fired: the view's hook ran
            self._capture_grad(names, grad, shape)

    def _capture_grad(self, names: list[tuple[int, str]], grad: torch.Tensor, shape: tuple[int, ...] | None) -> None:
        micro = self.ctx.clock.enter_backward()
        for vpp in dict.fromkeys(v for v, _ in names):  # one stage in practice
            labels = [n for v, n in names if v == vpp]
            self._capture(Family.ACTV_GRAD, vpp, labels, [grad] * len(labels), micro, shape=shape)

    # -- stats -----------------------------------------------------------------------------
    def _capture(
        self,
        family: str,
        vpp: int,
        names: list[str],
        tensors: list[torch.Tensor],
        micro: int,
        shape: tuple[int, ...] | None = None,
    ) -> None:
        if any(type(t) not in _PLAIN for t in tensors):
            tensors = [_waited(t) for t in tensors]
        if any(_is_dtensor(t) for t in tensors):
            self._capture_dtensors(family, vpp, names, tensors, micro)
            return
        cache, engine = self._cache, self.ctx.engine
        rows = [cache.get(t) for t in tensors]
        missing: dict[int, list[int]] = {}  # distinct tensor -> its positions: reduced once
        for i, r in enumerate(rows):
            if r is None:
                missing.setdefault(id(tensors[i]), []).append(i)
        if missing:
            fresh = engine.partials([tensors[at[0]] for at in missing.values()], no_sync=True)
            for at, row in zip(missing.values(), fresh):
                for i in at:
                    rows[i] = row
                cache.put(tensors[at[0]], row)
        engine.capture_tensors(family, vpp, names, tensors, rows, micro_step=micro, shape=shape)

    def _capture_one(self, family: str, vpp: int, name: str, t: torch.Tensor, micro: int) -> None:
        """``_capture`` of one tensor under one name (most hook calls)."""
        if type(t) not in _PLAIN:
            self._capture(family, vpp, [name], [t], micro)
            return
        cache = self._cache
        row = cache.get(t)
        if row is None:
            row = self.ctx.engine.partial(t)
            cache.put(t, row)
        self.ctx.engine.capture_one(family, vpp, name, t, row, micro)

    def _capture_dtensors(
        self, family: str, vpp: int, names: list[str], tensors: list[torch.Tensor], micro: int
    ) -> None:
        """Outputs of tensor-parallel modules kept as DTensors (``use_local_output=False``): the
        full tensor's stats, from this rank's shard merged over the TP group like a sharded param
        (a ``Partial`` one, not yet reduced, is reduced first: a collective of the TP group, which
        runs this same hook).  Plain tensors of the same call are recorded as they are."""
        for name, t in zip(names, tensors):
            if not _is_dtensor(t):
                self._capture(family, vpp, [name], [t], micro)
                continue
            local, group, shape = dtensor_parts(t, reduce_partial=True)
            self.ctx.engine.capture(family, [Tracked(name, local, vpp, shape)], micro_step=micro, group=group)

    def on_step_end(self) -> None:
        for vpp in list(self._open):  # still open at the step's end: that forward raised
            self._drop_unfinished(vpp)
        self._cache.clear()
        self._hooked.clear()

    def detach(self) -> None:
        self._live = False  # grad hooks already on tensors of this step become no-ops
        self._open.clear()
        self._cache.clear()
        self._hooked.clear()
        super().detach()
