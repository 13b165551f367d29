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

Design: a hook does O(1) Python: it appends (family, stage, name, tensor, version, micro_step)
to a pending batch.  The batch is reduced by ONE ``engine.partials`` call (the multi-tensor
path: fused C kernel on CPU, the device path elsewhere) and captured in hook order (one
``capture_tensors`` per run of one layout) at the end of each chunk's forward, at the end of each
backward (``StepClock.on_backward_end``), at the step's end, and whenever it holds
``TRAINMON_ACTV_BATCH_TENSORS`` tensors (default 256) or its referenced storages hold
``TRAINMON_ACTV_BATCH_BYTES`` bytes (default 64 MiB: the extra memory batches may keep alive).

Values never change.  An in-place op cannot be intercepted cheaply, so batching is learned per
row slot (family, stage, name): the first time a slot is seen its tensor is reduced at once in
the hook (as before batching) and its version counter (``t._version``) is kept; at the flush, a
slot whose tensor's version did not move becomes batchable, one whose version moved (a
``ReLU(inplace=True)`` after a Linear, ``x.add_(1)`` in a later module) is reduced at once on every
later step.  Should a batchable slot's tensor be changed in place on a later step (data-dependent
control flow), the flush sees the moved version and drops that row (one WARNING) and the slot is
reduced at once from then on: a recorded value is always the one the tensor had at hook time.
A tensor seen twice in a batch (output of one module, input of the next) is reduced once.
Forwards that run inside the autograd engine are checkpoint recomputations: they record no
``actv`` (the micro-batch was recorded in the real forward), but grad hooks are installed on
them because the reentrant checkpoint's backward runs through the recomputed graph.
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
    _graph_task_id,
    hook_fn,
    in_backward,
    io_names,
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
from trainmon.errors import env_int
from trainmon.families import Family
from trainmon.stats.engine import Tracked

__all__ = ["ActivationCollector"]

log = logging.getLogger(__name__)

_alias = torch.ops.aten.alias.default  # a view with the same elements; its backward returns grad itself


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
        self._hooked = _HookedTensors()
        # Pending batch: (family, vpp, name, tensor, version at hook time, micro_step, shape, row
        # or None when batched).  Bounded by tensors and by the bytes of the storages referenced.
        self._batch: list[tuple] = []
        self._batch_bytes = 0
        self._eager_rows: dict[tuple[int, int], Any] = {}  # (id, version) -> row reduced in a hook
        self._max_tensors = env_int("TRAINMON_ACTV_BATCH_TENSORS", 256)
        self._max_bytes = env_int("TRAINMON_ACTV_BATCH_BYTES", 64 << 20)
        self._safe: set[tuple[str, int, str]] = set()  # slots seen unchanged until their flush
        self._unsafe: set[tuple[str, int, str]] = set()  # slots changed in place: reduced at once
        self._flush_queued = False  # a backward-end flush is registered for this backward
        self._warned_moved = False
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
        # Runs in the autograd engine's callback: a failure there must not reach training.
        self._guarded_backward_flush = self.ctx.guard.wrap(self, self._backward_flush)

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
        self._flush()  # rows of earlier passes go before this forward's mark
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

    def _drop_unfinished(self, vpp: int) -> None:
        """The last forward of chunk ``vpp`` raised before returning (caught by the training
        loop): its rows belong to no micro-batch, and the next forward takes its micro_step."""
        self._flush()  # its batched rows are captured after its mark, so dropped with the others
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
        self._flush()
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
        if (  # the common call: one plain tensor, fewer frames (is_recordable inlined)
            not kwargs
            and len(args) == 1
            and type(t := args[0]) in _PLAIN
            and not hm.spec
            and t.layout == torch.strided
            and not t.is_meta
            and not t.is_complex()
        ):
            return self._one_input(hm, t)
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
        recompute = _graph_task_id() != -1  # in_backward(), inlined: hot path
        if self._forward and not recompute:
            vpp = hm.vpp_stage
            micro = max(self._counts[vpp] - 1, 0) if self._count_step == self.ctx.clock.step else 0  # _micro
            self._enqueue(Family.ACTV, vpp, name, t, micro, None)  # t is a plain tensor
        if not (self._backward and t.requires_grad and torch.is_grad_enabled()):
            return None
        a = _alias(t)
        self._hook_grad(a, [(hm.vpp_stage, name)], fallback=not recompute)
        return (a,), {}

    def _outputs(self, hm: HookedModule, module: nn.Module, _args: Any, output: Any) -> None:
        if module is not hm.module or self._eval_pass:
            return  # a copy of the model (copy.deepcopy) carries the hook, or an evaluation
        if (  # the common call; is_recordable inlined
            type(output) in _PLAIN
            and not hm.spec
            and output.layout == torch.strided
            and not output.is_meta
            and not output.is_complex()
        ):
            name = io_names(hm.label, "output", 1)[0]
            if self._forward and _graph_task_id() == -1:  # not in backward (a recompute)
                vpp = hm.vpp_stage
                micro = max(self._counts[vpp] - 1, 0) if self._count_step == self.ctx.clock.step else 0  # _micro
                self._enqueue(Family.ACTV, vpp, name, output, micro, None)
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
        self._hooked._names[(id(t), t._version)] = (weakref.ref(t), names)  # _hooked.add, inlined
        fired = [False]
        t.register_hook(functools.partial(self._grad_hook, names, fired))
        base = _same_elements_base(t) if fallback and t._base is not None else None  # no frame for a non-view
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
                clock = self.ctx.clock  # enter_backward() only on the pass's first grad: one frame less
                micro = clock.backward_index if clock._in_backward else clock.enter_backward()
                if type(grad) in _PLAIN:
                    self._enqueue(Family.ACTV_GRAD, names[0][0], names[0][1], grad, micro, None)
                else:
                    self._capture(Family.ACTV_GRAD, names[0][0], [names[0][1]], [grad], micro)
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
        if any([type(t) not in _PLAIN for t in tensors]):
            tensors = [_waited(t) for t in tensors]
        if any([_is_dtensor(t) for t in tensors]):
            self._flush()  # rows stay in hook order
            self._capture_dtensors(family, vpp, names, tensors, micro)
            return
        for name, t in zip(names, tensors):
            self._enqueue(family, vpp, name, t, micro, shape)

    def _enqueue(
        self, family: str, vpp: int, name: str, t: torch.Tensor, micro: int, shape: tuple[int, ...] | None
    ) -> None:
        """Append ``t`` to the pending batch: reduced now if its slot is not known to be safe from
        in-place changes before the flush, else at the flush.  No Python frame per row beyond this."""
        version = -1 if t.is_inference() else t._version
        row = None
        if (family, vpp, name) not in self._safe:
            # Reduced now; a tensor already reduced now in this batch with these values (the
            # output of one module is the input of the next) is reduced once.
            row = self._eager_rows.get((id(t), version))
            if row is None:
                row = self._eager_rows[(id(t), version)] = self.ctx.engine.partial(t)
        nbytes = t.untyped_storage().nbytes()
        if self._batch_bytes + nbytes > self._max_bytes:
            self._flush()  # the references held never exceed the bound (one bigger tensor alone)
        self._batch.append((family, vpp, name, t, version, micro, shape, row))
        self._batch_bytes += nbytes
        if len(self._batch) >= self._max_tensors or self._batch_bytes >= self._max_bytes:
            self._flush()
        elif family == Family.ACTV_GRAD and not self._flush_queued:
            self._flush_queued = True
            self.ctx.clock.on_backward_end(self._guarded_backward_flush)

    def _backward_flush(self) -> None:
        self._flush_queued = False
        if self._live:
            self._flush()

    def _flush(self) -> None:
        """Reduce the pending batch in one ``partials`` call and capture it in hook order."""
        batch = self._batch
        if not batch:
            return
        self._batch, self._batch_bytes = [], 0
        self._eager_rows.clear()
        moved = [(-1 if e[3].is_inference() else e[3]._version) != e[4] for e in batch]
        # Rows by (tensor, version): one reduction per distinct tensor and values in the batch.
        fresh = {(id(e[3]), e[4]): e[7] for e in batch if e[7] is not None}
        need = {
            (id(e[3]), e[4]): e[3]
            for e, m in zip(batch, moved)
            if e[7] is None and not m and (id(e[3]), e[4]) not in fresh
        }
        if need:
            fresh.update(zip(need, self.ctx.engine.partials(list(need.values()), no_sync=True)))
        if any(moved):
            self._learn_moved(batch, moved)
        self._safe.update(
            [e[:3] for e, m in zip(batch, moved) if e[7] is not None and not m and e[:3] not in self._unsafe]
        )
        run: list[tuple] = []
        key: tuple | None = None
        for e, m in zip(batch, moved):
            if m and e[7] is None:
                continue  # changed in place before its batch ran: its values are gone (warned)
            k = (e[0], e[1], e[5], e[6])
            if k != key and run:
                self._capture_run(key, run, fresh)
                run = []
            key = k
            run.append(e)
        if run:
            self._capture_run(key, run, fresh)

    def _capture_run(self, key: Any, run: list[tuple], fresh: dict[tuple[int, int], Any]) -> None:
        family, vpp, micro, shape = key
        rows = [fresh[(id(e[3]), e[4])] if e[7] is None else e[7] for e in run]
        self.ctx.engine.capture_tensors(
            family, vpp, [e[2] for e in run], [e[3] for e in run], rows, micro_step=micro, shape=shape
        )

    def _learn_moved(self, batch: list[tuple], moved: list[bool]) -> None:
        """Slots whose tensor changed in place before the flush are reduced in the hook from now on."""
        lost = [e[2] for e, m in zip(batch, moved) if m and e[7] is None]
        for e, m in zip(batch, moved):
            if m:
                self._unsafe.add(e[:3])
                self._safe.discard(e[:3])
        if lost and not self._warned_moved:
            self._warned_moved = True
            log.warning(
                "trainmon: %d activation rows (%s) are not recorded at step %d: their tensors were "
                "changed in place before their batch was reduced; they are reduced in the hook "
                "from now on. Warned once",
                len(lost),
                ", ".join(lost[:3]),
                self.ctx.clock.step,
            )

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
        self._flush()
        for vpp in list(self._open):  # still open at the step's end: that forward raised
            self._drop_unfinished(vpp)
        self._hooked.clear()

    def detach(self) -> None:
        self._flush()  # what was recorded is kept
        self._live = False  # grad hooks already on tensors of this step become no-ops
        self._open.clear()
        self._hooked.clear()
        super().detach()
