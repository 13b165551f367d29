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
to a pending batch.  Each hook is one Python frame on collected steps (``core.hooks.eager_gate``:
the gate, the compile probe and the failure guard inline) and does its common case inline: one
plain tensor (or a plain tuple of them: one more frame per call, none per tensor), a batchable
slot, a grad hook added to the tensor's hook dict as ``Tensor.register_hook`` does but without
its handle object (``_add_hook``; checked once per process against the public API).  The alias's
fallback (the input's total gradient, above) rides on the hook its base already has when the
base is the output of another recorded module.  A step costs ~3-3.7 Python frames per activation
row, torch's own module-hook path included (``tests/test_host_budget_activations.py``).  The
batch is reduced by ONE ``engine.partials`` call (the multi-tensor path: fused C kernel on CPU,
the device path elsewhere) and captured in hook order (one ``capture_tensors`` per run of one
layout) at the end of each chunk's forward, at the end of each backward
(``StepClock.on_backward_end``), at the step's end, and whenever it holds
``TRAINMON_ACTV_BATCH_TENSORS`` tensors (default 256) or its referenced storages hold
``TRAINMON_ACTV_BATCH_BYTES`` bytes (default 2 MiB: the extra memory batches may keep alive; small so
that a batch is reduced while its tensors are still in the CPU's cache: 64 MiB measured 1.115x on
``benchmarks/overhead.py --only xy``, 2 MiB 1.072x, the same run).

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
import itertools
import logging
import operator
import weakref
from collections import OrderedDict
from collections.abc import Sequence
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
from trainmon.core.hooks import Handle, eager_gate, replace_recompile_warnings, skip_standalone_frames
from trainmon.errors import env_int
from trainmon.families import Family
from trainmon.stats.engine import Tracked

__all__ = ["ActivationCollector"]

log = logging.getLogger(__name__)

_alias = torch.ops.aten.alias.default  # a view with the same elements; its backward returns grad itself


# A grad hook's record, one per hooked tensor: [names, fired, fallbacks, ref, shape, version].
# ``names``: the (vpp_stage, name)s the tensor's gradient is recorded under (the output of one
# module is often the input of the next: one hook serves them all; a shared tuple until a second
# name comes, then a list of its own); ``fired``: the hook ran; ``fallbacks``: records of views
# (aliases) of this tensor whose own hook may be lost (see ``_fallback``); ``ref``: a weak reference
# to the tensor (``_hooked`` is keyed by id); ``shape``: the shape a base's fallback records this
# view's grad with (None: the base's own); ``version``: the tensor's version when hooked
# (``_hooked`` holds the latest hooked version of each tensor: after ``ReLU(inplace=True)`` the same
# tensor object holds other values with another gradient, so an entry of another version is no
# match).  A list, not an object: building one costs no Python frame, and few objects that outlive
# the hook (each one brings the next garbage collection closer).
_NAMES, _FIRED, _FALLBACKS, _REF, _SHAPE, _VERSION = 0, 1, 2, 3, 4, 5

# (vpp_stage, name) -> ((vpp_stage, name),): one shared names tuple per row slot (C call on a hit)
_one_name = functools.lru_cache(maxsize=65536)(lambda vpp, name: ((vpp, name),))


def _add_name(rec: list, name: tuple[int, str]) -> None:
    names = rec[_NAMES]
    if name not in names:
        rec[_NAMES] = [*names, name]


_HOOK_IDS = itertools.count(-1, -1)  # keys of our hooks in a tensor's hook dict: never torch's own


def _fast_hooks_work() -> bool:
    """Whether ``_add_hook``'s shortcut registers a tensor hook as ``Tensor.register_hook`` does
    on this torch (checked once: a hook on a non-leaf, a leaf and a view receives its gradient)."""
    seen: list[float] = []
    try:
        with torch.enable_grad():
            leaf = torch.ones(2, requires_grad=True)
            mid = leaf * 2
            view = mid[...]
            for t, k in ((leaf, 1.0), (mid, 10.0), (view, 100.0)):
                _add_hook_unchecked(t, lambda g, k=k: seen.append(k * float(g[0])))
            (view * 3).sum().backward()
    except Exception:  # another torch: the public API it is
        return False
    return sorted(seen) == [6.0, 30.0, 300.0]


def _add_hook_unchecked(t: torch.Tensor, fn: Any) -> None:
    # What ``Tensor.register_hook`` does for a plain tensor, minus its handle (two Python frames
    # per hooked tensor, hundreds a step): our hooks are never removed, they die with the tensor.
    hooks = t._backward_hooks
    if hooks is None:
        t._backward_hooks = hooks = OrderedDict()
        grad_fn = t.grad_fn
        if grad_fn is not None:
            grad_fn._register_hook_dict(t)
    hooks[next(_HOOK_IDS)] = fn


def _add_hook(t: torch.Tensor, fn: Any) -> None:
    """``t.register_hook(fn)``, without a handle where that is known to be the same."""
    if _FAST_HOOKS and type(t) in _PLAIN:
        _add_hook_unchecked(t, fn)
    else:
        t.register_hook(fn)


_PLAIN = (torch.Tensor, nn.Parameter)
_WALKED = (torch.Tensor, tuple, list, dict)  # what tensors_of looks into


_FAST_HOOKS: bool | None = None  # _fast_hooks_work(), decided at the first attach


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


# A batch entry's (family, vpp, micro_step, shape): one capture per run of entries sharing it.
_LAYOUT_KEY = operator.itemgetter(0, 1, 5, 6)
_NAME_OF, _TENSOR_OF = operator.itemgetter(2), operator.itemgetter(3)

_Memory = tuple  # (data pointer, dtype, numel or shape and strides, device): the elements read


class _ReadOnce:
    """One reduction per distinct memory, within a flush and from one flush to the next.

    A module's output and the next module's input are different tensor objects (the input is an
    alias, for its grad hook) over the same elements, and so are many grads; with batches bounded
    at 2 MiB they often land in consecutive flushes.  Keyed by object they were read twice (47% of
    the activation bytes of an all-modules step of the overhead model).  Same data pointer, dtype,
    shape and strides, unchanged since their hooks (the flush's ``moved`` check) and, for a row of
    the previous flush, its tensor still alive (its memory not reused) and its version counter
    where it was when read: the same values, so the same row.  Rows are kept for one flush only,
    and forgotten at the end of a pass and of the step (``forget``): a row is a handle into the
    step's buffer."""

    def __init__(self) -> None:
        self._recent: dict[_Memory, tuple[Any, int, Any]] = {}  # memory -> (weakref, version, row)

    def forget(self) -> None:
        self._recent = {}

    def plan(
        self, entries: list[tuple], done: dict[tuple[int, int], Any]
    ) -> tuple[dict[tuple[int, int], torch.Tensor], list[tuple[tuple[int, int], tuple[int, int]]], dict]:
        """``(need, same, memories)``: the tensors to reduce, ``(id, version) -> tensor``; for the
        other entries the key whose row they take; each key's memory.  Rows of the previous flush
        that still hold go straight into ``done``."""
        need: dict[tuple[int, int], torch.Tensor] = {}
        first_of: dict[_Memory, tuple[int, int]] = {}
        memories: dict[tuple[int, int], _Memory] = {}
        same = []
        recent, strided = self._recent, torch.strided
        for e in entries:
            t = e[3]
            key = (id(t), e[4])
            if key in done or key in need:
                continue
            # Every statistic is over all elements: a contiguous reshaped view reads the same ones.
            if t.layout is not strided:
                need[key] = t
                continue
            memory = (
                (t.data_ptr(), t.dtype, t.numel(), t.device)
                if t.is_contiguous()
                else (t.data_ptr(), t.dtype, t.shape, t.stride(), t.device)
            )
            memories[key] = memory
            first = first_of.get(memory)
            if first is not None:
                same.append((key, first))
                continue
            first_of[memory] = key
            old = recent.get(memory)
            if old is not None:
                was = old[0]()
                if was is not None and was._version == old[1]:
                    done[key] = old[2]
                    continue
            need[key] = t
        return need, same, memories

    def keep(self, batch: list[tuple], fresh: dict[tuple[int, int], Any], memories: dict) -> None:
        """This flush's rows by memory, for the next flush."""
        kept: dict[_Memory, tuple[Any, int, Any]] = {}
        for e in batch:
            key = (id(e[3]), e[4])
            memory = memories.get(key)
            if memory is not None and key in fresh and memory not in kept:
                kept[memory] = (weakref.ref(e[3]), e[4], fresh[key])
        self._recent = kept


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
        global _FAST_HOOKS
        if _FAST_HOOKS is None:
            _FAST_HOOKS = _fast_hooks_work()
        # id -> the grad hook's record of the tensors hooked in this step (its latest hooked
        # version; see _NAMES...).  A non-reentrant checkpoint recomputes
        # with the very input tensors of the first forward: their names are already there, so
        # their gradient is not recorded twice.
        self._hooked: dict[int, list] = {}
        # Pending batch: (family, vpp, name, tensor, version at hook time, micro_step, shape, row
        # or None when batched).  Bounded by tensors and by the bytes of the storages referenced.
        self._batch: list[tuple] = []
        self._batch_bytes = 0
        self._eager_rows: dict[tuple[int, int], Any] = {}  # (id, version) -> row reduced in a hook
        self._read_once = _ReadOnce()  # one reduction per distinct memory, across one flush boundary
        self._max_tensors = env_int("TRAINMON_ACTV_BATCH_TENSORS", 256)
        self._max_bytes = env_int("TRAINMON_ACTV_BATCH_BYTES", 2 << 20)
        self._safe: set[tuple[str, int, str]] = set()  # slots seen unchanged until their flush
        self._unsafe: set[tuple[str, int, str]] = set()  # slots changed in place: reduced at once
        # The running backward pass's micro_step once a grad of it reached us (a backward-end
        # flush is registered then), None between passes.
        self._grad_micro: int | None = None
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
        self._grad_hook = self._gated(self._on_grad)
        self._backward_mark = self.ctx.guard.wrap(self, self._on_backward_start)
        # Runs in the autograd engine's callback: a failure there must not reach training.
        self._guarded_backward_flush = self.ctx.guard.wrap(self, self._backward_flush)

    def _gated(self, fn: Any) -> Any:
        """A hook that costs one flag check on steps that are not collected, and one Python
        frame around ``fn`` on collected ones (``core.hooks.eager_gate``)."""
        guard, clock = self.ctx.guard, self.ctx.clock
        general = guard.gated(self, fn, clock)
        return eager_gate(fn, general, clock, guard.failed, self.name, functools.partial(guard.fail, self))

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
        if (  # the common call: one plain tensor, no per-target spec.  All inline: one frame
            not kwargs
            and len(args) == 1
            and type(t := args[0]) in _PLAIN
            and not hm.spec
            and t.layout == torch.strided
            and not t.is_meta
            and not t.is_complex()
        ):
            name = io_names(hm.label, "input", 1)[0]  # an lru_cache: C, no frame
            recompute = _graph_task_id() != -1  # in_backward(), inlined
            vpp = hm.vpp_stage
            if self._forward and not recompute:
                micro = max(self._counts[vpp] - 1, 0) if self._count_step == self.ctx.clock.step else 0  # _micro
                slot = (Family.ACTV, vpp, name)
                version = -1 if t.is_inference() else t._version
                nbytes = t.untyped_storage().nbytes()
                if (  # _enqueue's common case, inlined: a batchable slot with room in the batch
                    slot in self._safe
                    and len(self._batch) + 1 < self._max_tensors
                    and self._batch_bytes + nbytes < self._max_bytes
                ):
                    self._batch.append((Family.ACTV, vpp, name, t, version, micro, None, None))
                    self._batch_bytes += nbytes
                else:
                    self._enqueue(Family.ACTV, vpp, name, t, micro, None)
            if not (self._backward and t.requires_grad and torch.is_grad_enabled()):
                return None
            a = t[...]  # aten.alias through indexing: no Python frame
            rec = [_one_name(vpp, name), False, None, weakref.ref(a), None, a._version]
            self._hooked[id(a)] = rec
            hook = functools.partial(self._grad_hook, rec)
            if _FAST_HOOKS:  # _add_hook, inlined (a is a plain tensor)
                hooks = a._backward_hooks
                if hooks is None:
                    a._backward_hooks = hooks = OrderedDict()
                    a.grad_fn._register_hook_dict(a)
                hooks[next(_HOOK_IDS)] = hook
            else:
                a.register_hook(hook)
            # In a checkpoint's recompute no fallback: a non-reentrant one never backpropagates
            # through the recomputed graph (the alias's hook stays silent, the input's would not).
            if recompute:
                return (a,), {}
            if t._base is None:  # the alias's base is t itself
                if t.is_contiguous():
                    entry = self._hooked.get(id(t))  # _fallback's common case, inlined
                    if entry is not None and entry[_REF]() is t and entry[_VERSION] == t._version:
                        if entry[_FALLBACKS] is None:  # same shape as t: rec[_SHAPE] stays None
                            entry[_FALLBACKS] = [rec]
                        else:
                            entry[_FALLBACKS].append(rec)
                    elif _FAST_HOOKS and type(t) in _PLAIN:
                        # a hook of its own (see _fallback), registered inline
                        hook = functools.partial(self._grad_hook, [(), False, [rec], None, None, -1])
                        hooks = t._backward_hooks
                        if hooks is None:
                            t._backward_hooks = hooks = OrderedDict()
                            if t.grad_fn is not None:
                                t.grad_fn._register_hook_dict(t)
                        hooks[next(_HOOK_IDS)] = hook
                    else:
                        self._fallback(t, rec, None)
            elif (base := _same_elements_base(a)) is not None:  # t is a view: its own hook may be lost too
                self._fallback(base, rec, tuple(a.shape))
            return (a,), {}
        return self._inputs_general(hm, args, kwargs)

    def _inputs_general(self, hm: HookedModule, args: Any, kwargs: Any) -> Any:
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
            self._hook_grad(a, mine, fallback=not recompute)
            return a

        new_args = replace_tensors(args, swap)
        new_kwargs = replace_tensors(kwargs, swap) if kwargs else kwargs
        swapped = any(made.get(id(t), t) is not t for t in tensors)
        return (new_args, new_kwargs) if swapped else None

    def _outputs(self, hm: HookedModule, module: nn.Module, _args: Any, output: Any) -> None:
        if module is not hm.module or self._eval_pass:
            return  # a copy of the model (copy.deepcopy) carries the hook, or an evaluation
        if (  # the common call: one plain tensor, no per-target spec.  All inline: one frame
            type(output) in _PLAIN
            and not hm.spec
            and output.layout == torch.strided
            and not output.is_meta
            and not output.is_complex()
        ):
            name = io_names(hm.label, "output", 1)[0]
            vpp = hm.vpp_stage
            if self._forward and _graph_task_id() == -1:  # not in backward (a recompute)
                micro = max(self._counts[vpp] - 1, 0) if self._count_step == self.ctx.clock.step else 0  # _micro
                slot = (Family.ACTV, vpp, name)
                version = -1 if output.is_inference() else output._version
                nbytes = output.untyped_storage().nbytes()
                if (  # _enqueue's common case, inlined
                    slot in self._safe
                    and len(self._batch) + 1 < self._max_tensors
                    and self._batch_bytes + nbytes < self._max_bytes
                ):
                    self._batch.append((Family.ACTV, vpp, name, output, version, micro, None, None))
                    self._batch_bytes += nbytes
                else:
                    self._enqueue(Family.ACTV, vpp, name, output, micro, None)
            if self._backward and output.requires_grad and torch.is_grad_enabled():
                entry = self._hooked.get(id(output))  # _hook_shared, inlined
                if entry is not None and entry[_REF]() is output and entry[_VERSION] == output._version:
                    if (vpp, name) not in entry[_NAMES]:
                        _add_name(entry, (vpp, name))
                elif _FAST_HOOKS and output._base is None and output.grad_fn is not None:
                    # _hook_grad inlined for a plain non-view output (no fallback to find)
                    rec = [_one_name(vpp, name), False, None, weakref.ref(output), None, output._version]
                    self._hooked[id(output)] = rec
                    hooks = output._backward_hooks
                    if hooks is None:
                        output._backward_hooks = hooks = OrderedDict()
                        output.grad_fn._register_hook_dict(output)
                    hooks[next(_HOOK_IDS)] = functools.partial(self._grad_hook, rec)
                else:
                    self._hook_grad(output, [(vpp, name)])
            return
        if (  # a plain tuple of plain tensors (None and non-tensors skipped, as tensors_of does)
            type(output) is tuple
            and not hm.spec
            and all([type(o) in _PLAIN or not isinstance(o, _WALKED) for o in output])
        ):
            self._tuple_outputs(hm, output)
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

    def _tuple_outputs(self, hm: HookedModule, output: tuple) -> None:
        """``_outputs`` for a tuple of plain tensors: a few Python frames per call, none per tensor."""
        tensors = [
            o
            for o in output
            if type(o) in _PLAIN and o.layout == torch.strided and not o.is_meta and not o.is_complex()
        ]
        if not tensors:
            return
        names = io_names(hm.label, "output", len(tensors))
        vpp = hm.vpp_stage
        if self._forward and _graph_task_id() == -1:  # not a checkpoint's recompute
            micro = max(self._counts[vpp] - 1, 0) if self._count_step == self.ctx.clock.step else 0  # _micro
            self._enqueue_many(Family.ACTV, vpp, names, tensors, micro)
        if self._backward and torch.is_grad_enabled():
            hooked = self._hooked
            for name, t in zip(names, tensors):
                if not t.requires_grad:
                    continue
                entry = hooked.get(id(t))  # _hook_shared, inlined
                if entry is not None and entry[_REF]() is t and entry[_VERSION] == t._version:
                    if (vpp, name) not in entry[_NAMES]:
                        _add_name(entry, (vpp, name))
                elif _FAST_HOOKS and t._base is None and t.grad_fn is not None:
                    # _hook_grad inlined for a plain non-view output (no fallback to find)
                    rec = [_one_name(vpp, name), False, None, weakref.ref(t), None, t._version]
                    hooked[id(t)] = rec
                    hooks = t._backward_hooks
                    if hooks is None:
                        t._backward_hooks = hooks = OrderedDict()
                        t.grad_fn._register_hook_dict(t)
                    hooks[next(_HOOK_IDS)] = functools.partial(self._grad_hook, rec)
                else:
                    self._hook_grad(t, [(vpp, name)])

    def _enqueue_many(
        self, family: str, vpp: int, names: Sequence[str], tensors: list[torch.Tensor], micro: int
    ) -> None:
        """``_enqueue`` for several tensors of one call, the common case inline: one frame."""
        safe, batch = self._safe, self._batch
        for name, t in zip(names, tensors):
            version = -1 if t.is_inference() else t._version
            nbytes = t.untyped_storage().nbytes()
            if (
                (family, vpp, name) in safe
                and len(batch) + 1 < self._max_tensors
                and self._batch_bytes + nbytes < self._max_bytes
            ):
                batch.append((family, vpp, name, t, version, micro, None, None))
                self._batch_bytes += nbytes
            else:
                self._enqueue(family, vpp, name, t, micro, None)
                batch = self._batch  # a flush starts a new batch

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
        entry = self._hooked.get(id(t))
        if entry is None or entry[_REF]() is not t or entry[_VERSION] != t._version:
            self._hook_grad(t, [name])
        else:
            _add_name(entry, name)

    def _hook_grad(self, t: torch.Tensor, names: list[tuple[int, str]], fallback: bool = True) -> None:
        rec = [names, False, None, weakref.ref(t), None, t._version]
        self._hooked[id(t)] = rec
        _add_hook(t, functools.partial(self._grad_hook, rec))
        base = _same_elements_base(t) if fallback and t._base is not None else None  # no frame for a non-view
        if base is not None:
            self._fallback(base, rec, tuple(t.shape))

    def _fallback(self, base: torch.Tensor, rec: list, shape: tuple[int, ...] | None) -> None:
        """A hook on a view is lost when the view is later modified in place (Linear on a 3-D
        input returns a view, ReLU(inplace=True) then rebases it; a module changing its input's
        alias in place).  Its base still gets the gradient of these very elements, after the
        view's would have: it is used only when the view's own hook did not run.  A base already
        hooked (the output of the previous module) serves it from its own hook: no second hook."""
        entry = self._hooked.get(id(base))
        rec[_SHAPE] = shape
        if entry is not None and entry[_REF]() is base and entry[_VERSION] == base._version:
            if entry[_FALLBACKS] is None:
                entry[_FALLBACKS] = [rec]
            else:
                entry[_FALLBACKS].append(rec)
        else:  # a hook of its own, not listed: names given to the base later get their own hook
            _add_hook(base, functools.partial(self._grad_hook, [(), False, [rec], None, None, -1]))

    # -- backward --------------------------------------------------------------------------
    def _on_grad(self, rec: list, grad: torch.Tensor | None) -> None:
        rec[_FIRED] = True
        if grad is None or not self._live:
            return
        names = rec[_NAMES]
        if len(names) == 1 and type(grad) in _PLAIN:  # the common case, all inline: one frame
            micro = self._grad_micro
            if micro is None:
                micro = self._enter_grad_pass()
            vpp, name = names[0]
            version = -1 if grad.is_inference() else grad._version
            nbytes = grad.untyped_storage().nbytes()
            if (  # _enqueue's common case, inlined
                (Family.ACTV_GRAD, vpp, name) in self._safe
                and len(self._batch) + 1 < self._max_tensors
                and self._batch_bytes + nbytes < self._max_bytes
            ):
                self._batch.append((Family.ACTV_GRAD, vpp, name, grad, version, micro, None, None))
                self._batch_bytes += nbytes
            else:
                self._enqueue(Family.ACTV_GRAD, vpp, name, grad, micro, None)
        elif names:
            self._capture_grad(names, grad, None)
        if rec[_FALLBACKS] is not None:
            for alias in rec[_FALLBACKS]:
                if not alias[_FIRED]:  # the alias's (view's) own hook was lost
                    self._capture_grad(alias[_NAMES], grad, alias[_SHAPE])

    def _enter_grad_pass(self) -> int:
        """The first grad of a backward pass here: its micro_step, and a flush at its end."""
        clock = self.ctx.clock
        micro = self._grad_micro = clock.enter_backward()
        clock.on_backward_end(self._guarded_backward_flush)
        return micro

    def _capture_grad(
        self, names: Sequence[tuple[int, str]], grad: torch.Tensor, shape: tuple[int, ...] | None
    ) -> None:
        micro = self._grad_micro
        if micro is None:
            micro = self._enter_grad_pass()
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
        in-place changes before the flush, else at the flush.  The hooks inline the common case
        (a batchable slot, room in the batch); this is the general one."""
        version = -1 if t.is_inference() else t._version
        nbytes = t.untyped_storage().nbytes()
        if self._batch_bytes + nbytes > self._max_bytes:
            self._flush()  # the references held never exceed the bound (one bigger tensor alone)
        row = None
        # After that flush, not before: a flush forgets the rows reduced in hooks, and a row it
        # forgot was read again by the next flush and its slot never learned batchable (every
        # activation of the batch bound or more, reduced twice on every step).
        if (family, vpp, name) not in self._safe:
            # Reduced now; a tensor already reduced now in this batch with these values (the
            # output of one module is the input of the next) is reduced once.
            row = self._eager_rows.get((id(t), version))
            if row is None:
                row = self._eager_rows[(id(t), version)] = self.ctx.engine.partial(t)
        self._batch.append((family, vpp, name, t, version, micro, shape, row))
        self._batch_bytes += nbytes
        if len(self._batch) >= self._max_tensors or self._batch_bytes >= self._max_bytes:
            self._flush()
        elif family == Family.ACTV_GRAD and self._grad_micro is None:
            self._enter_grad_pass()

    def _backward_flush(self) -> None:
        self._grad_micro = None
        if self._live:
            self._flush()
        self._read_once.forget()

    def _flush(self) -> None:
        """Reduce the pending batch in one ``partials`` call and capture it in hook order.  With
        2 MiB batches a forward of medium tensors flushes every few rows (74 times a step on
        nanoGPT's CPU recipe), so the common case (no row reduced in a hook, nothing changed in
        place, one layout) is a handful of comprehensions and one ``capture_tensors``."""
        batch = self._batch
        if not batch:
            return
        self._batch, self._batch_bytes = [], 0
        moved = [(-1 if e[3].is_inference() else e[3]._version) != e[4] for e in batch]
        anything_moved = True in moved
        eager = bool(self._eager_rows)  # some rows were reduced in their hook (e[7] set)
        if eager:
            self._eager_rows.clear()
            # Rows by (tensor, version): one reduction per distinct tensor and values in the batch.
            fresh = {(id(e[3]), e[4]): e[7] for e in batch if e[7] is not None}
        else:
            fresh = {}
        reduce = batch if not (eager or anything_moved) else [e for e, m in zip(batch, moved) if e[7] is None and not m]
        need, same, memories = self._read_once.plan(reduce, fresh)
        if need:
            fresh.update(zip(need, self.ctx.engine.partials(list(need.values()), no_sync=True)))
        if same:
            fresh.update([(key, fresh[first]) for key, first in same])
        self._read_once.keep(batch, fresh, memories)
        if anything_moved:
            self._learn_moved(batch, moved)
        if eager:
            self._safe.update(
                [e[:3] for e, m in zip(batch, moved) if e[7] is not None and not m and e[:3] not in self._unsafe]
            )
        kept = batch if not anything_moved else [e for e, m in zip(batch, moved) if not m or e[7] is not None]
        if len(set(map(_LAYOUT_KEY, kept))) == 1:  # one layout: the common case
            self._capture_run(kept, fresh)
            return
        run: list[tuple] = []
        key: tuple | None = None
        for e in kept:  # in hook order, one capture per run of one layout
            k = _LAYOUT_KEY(e)
            if k != key and run:
                self._capture_run(run, fresh)
                run = []
            key = k
            run.append(e)
        if run:
            self._capture_run(run, fresh)

    def _capture_run(self, run: list[tuple], fresh: dict[tuple[int, int], Any]) -> None:
        """Capture ``run``'s entries (one family, stage, micro_step and shape: its first's)."""
        family, vpp, _, _, _, micro, shape, _ = run[0]
        rows = [fresh[(id(e[3]), e[4])] if e[7] is None else e[7] for e in run]
        names, tensors = list(map(_NAME_OF, run)), list(map(_TENSOR_OF, run))  # C loops, no frame
        self.ctx.engine.capture_tensors(family, vpp, names, tensors, rows, micro_step=micro, shape=shape)

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
        self._read_once.forget()
        self._grad_micro = None  # a backward that raised never ended: the next pass enters anew

    def detach(self) -> None:
        self._flush()  # what was recorded is kept
        self._live = False  # grad hooks already on tensors of this step become no-ops
        self._open.clear()
        self._hooked.clear()
        super().detach()
