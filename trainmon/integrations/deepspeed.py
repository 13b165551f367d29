"""DeepSpeed ZeRO: reduced grads, fp32 params and moments from this rank's fragments.

``safe_get_full_*`` are per-param collectives (and gather whole tensors): instead every rank
measures the fragment it owns and the engine merges the partials over the data-parallel group
in one exchange per family, which gives the statistics of the full tensors.

* stage 0: plain torch (``param.grad`` after DeepSpeed's all-reduce, ``optimizer.state``).
* stages 1-2: ``param._hp_mapping`` links each model param to its slice of this rank's fp32
  partition: the reduced grad (``averaged_gradients``), the fp32 master and the moments.
* stage 3: ``param._z3_optimizer`` hands out this rank's fp32 grad / param / moment partition;
  the padding at the end of the last partition is cut off.

Pre-reduce (``grad_unreduced``), as DeepSpeed defines the reduce: stages 0 and 1 reduce once at
the gradient-accumulation boundary, so the generic post-accumulate-grad hook sees this rank's
accumulated local grad (rows without ``micro_step``).  Stages 2 and 3 reduce (and free the grad)
bucket by bucket on every micro-batch, so an accumulated local grad never exists; what exists is
each micro-batch's local grad just before its bucket is reduced.  The optimizer's bucket-reduce
method (stage 2 ``reduce_ipg_grads``, stage 3 ``__reduce_and_partition_ipg_grads``) is wrapped on
the instance and the bucket's params are emitted right before calling through: one row per param
per micro-batch, ``micro_step`` = the micro-batch's index within the step (DeepSpeed's own count).
The grad is the tensor DeepSpeed is about to reduce (already divided by the accumulation steps).

``grad_reduced`` is the grad the update applies.  Stages 1-3 unscale and clip (``gradient_clipping``,
1.0 in DeepSpeed's default config) inside ``optimizer.step()``, on this rank's flat fp32 grad
partition, after the step's entry: the optimizer's ``_optimizer_step(group)`` is wrapped on the
instance and, right before it calls the inner optimizer, each param's slice of that partition's
``.grad`` is measured (stage 3: the sub-group's flat fp32 grad, cut at ``grad_position``;
``BF16_Optimizer``: at its inner optimizer's step entry, after its clip).  Stage 0
clips ``param.grad`` in place before calling the torch optimizer, whose step entry already sees it.

fp16 (loss scaling): under ZeRO 1-3 the model's grads carry DeepSpeed's loss scale until its
optimizer unscales them, so ``grad_unreduced`` is reported divided by the scale the iteration ran
with (the rows are on the scale of the loss, as under Megatron); the applied-grad points above
already see unscaled grads.  Stage 0 in fp16 runs DeepSpeed's ``FP16_UnfusedOptimizer``: an fp32 master per param, whose
grads it unscales and clips before its inner torch optimizer steps; ``grad_reduced`` is read at that
inner step's entry and the param and moments from the masters.  (A fused ``FP16_Optimizer``, chosen
for DeepSpeed's FusedAdam, keeps flat masters that are not mapped: one warning, and ``grad_reduced``
is then read at step entry, unscaled but before the clip.)  A step the loss scaler skips (an
overflow: DeepSpeed's optimizer returns before its inner optimizer steps) is handled by
``core.step_boundary``: its ``grad_unreduced`` rows (with the overflow in them), no ``grad_reduced``,
param or moment rows, and a ``steps`` row with ``skipped`` 1 and the ``loss_scale`` it ran with.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.nn as nn

from trainmon.core.hooks import Handle
from trainmon.core.naming import TrackedParam
from trainmon.families import MOMENTS
from trainmon.integrations.base import Integration, View, register_integration

__all__ = ["DeepSpeedIntegration"]

log = logging.getLogger(__name__)

_MOMENTS = tuple(str(f) for f in MOMENTS)
_Z3_REDUCE = "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads"


def _engine(chunks: Sequence[nn.Module]) -> Any:
    for c in chunks:
        if type(c).__name__ == "DeepSpeedEngine" and hasattr(c, "zero_optimization_stage"):
            return c
    return None


@register_integration
class DeepSpeedIntegration(Integration):
    name = "deepspeed"
    priority = 40
    needs_all_ranks = True  # shards are merged over a process group: every rank takes part

    @classmethod
    def detect(cls, chunks: Sequence[nn.Module], optimizer: Any) -> bool:
        return _engine(chunks) is not None

    def __init__(self, chunks: Sequence[nn.Module], optimizer: Any, use_main_grad: bool):
        super().__init__(chunks, optimizer, use_main_grad)
        self.engine = _engine(chunks)
        self.stage = int(self.engine.zero_optimization_stage())
        # DeepSpeed's ZeRO optimizer (untyped, never imported); None at stage 0, where its methods are not called
        self.zero: Any = self.engine.optimizer if self.stage > 0 else None
        self.group = getattr(self.zero, "dp_process_group", None)
        self.reduces_every_micro_batch = self.stage >= 2
        self.fp16 = bool(getattr(self.engine, "fp16_enabled", lambda: False)())
        # stage 0 fp16: model param id -> its fp32 master in FP16_UnfusedOptimizer (None otherwise)
        self._masters = self._fp16_masters() if self.stage == 0 and self.fp16 else None

    def _fp16_masters(self) -> dict[int, torch.Tensor] | None:
        opt = self.engine.optimizer
        fp16, fp32 = getattr(opt, "fp16_groups", None), getattr(opt, "fp32_groups", None)
        if fp16 is None or fp32 is None or not hasattr(getattr(opt, "optimizer", None), "register_step_pre_hook"):
            log.warning(
                "trainmon: DeepSpeed fp16 without ZeRO runs %s, whose fp32 masters trainmon does not map; "
                "grad_reduced is read at step entry (unscaled, before DeepSpeed's clip) and exp_avg* are not "
                "recorded (use ZeRO stage 1-3, or an unfused torch optimizer)",
                type(opt).__name__,
            )
            return None
        return {id(p): m for g16, g32 in zip(fp16, fp32) for p, m in zip(g16, g32)}

    def _loss_scale(self) -> float | None:
        """The loss scale the running iteration's grads carry (fp16 under ZeRO 1-3), else None.

        ``engine.backward`` multiplies the loss by the scale only for its ZeRO optimizers; at
        stage 0 (``FP16_UnfusedOptimizer``) the model's grads carry none (DeepSpeed 0.19: tested)."""
        scale = getattr(self.engine.optimizer, "loss_scale", None) if self.fp16 and self.stage > 0 else None
        return None if scale is None else float(scale)

    def pre_reduce_points(
        self, params: list[TrackedParam], emit: Callable[[list[TrackedParam], int], None]
    ) -> list[Handle] | None:
        if self.stage <= 1:
            return None  # reduced once at the boundary: the generic hooks see the local grad
        by_id = {id(tp.param): tp for tp in params}
        attr = "reduce_ipg_grads" if self.stage == 2 else _Z3_REDUCE
        bucket_params = self._z2_bucket_params if self.stage == 2 else self._z3_bucket_params
        inner = getattr(self.zero, attr, None)
        if inner is None:
            log.warning(
                "trainmon: DeepSpeed ZeRO stage %d optimizer has no '%s' (another DeepSpeed "
                "version?); grad_unreduced is not recorded",
                self.stage,
                attr,
            )
            return []

        def reduce_bucket(*args: Any, **kwargs: Any) -> Any:
            mine = [tp for p in bucket_params(*args, **kwargs) if (tp := by_id.get(id(p))) is not None]
            if mine:
                side = self._z3_stream() if self.stage == 3 else None
                if side is not None:  # the IPG copy ran on DeepSpeed's stream: read after it
                    torch.cuda.current_stream().wait_stream(side)
                emit(mine, self._micro_step())
                if side is not None:  # and DeepSpeed's in-place divide waits for the read
                    side.wait_stream(torch.cuda.current_stream())
            return inner(*args, **kwargs)

        # On the instance only: other optimizers of the class stay untouched; the call sites
        # (``self.reduce_ipg_grads``, the mangled ``self.__reduce...``) look the instance up first.
        setattr(self.zero, attr, reduce_bucket)
        return [Handle(lambda: delattr(self.zero, attr))]

    def _z3_stream(self) -> Any:
        """ZeRO-3's ``reduce_and_partition_stream`` when it is a side CUDA stream (overlap_comm):
        the grads are copied into the IPG buffer and divided in place on it, so the pre-reduce
        read must be ordered after the copy and before the divide (``wait_stream`` both ways)."""
        stream = getattr(self.zero, "reduce_and_partition_stream", None)
        if stream is None or not isinstance(stream, torch.cuda.Stream):
            return None
        return None if stream == torch.cuda.current_stream() else stream

    def applied_grad_points(
        self, params: list[TrackedParam], emit: Callable[[list[tuple[TrackedParam, View]]], None]
    ) -> list[Handle] | None:
        if self.stage == 0 and self._masters is not None:
            return self._fp16_applied_points(params, emit)
        if self.stage == 0:
            return None  # the engine clips param.grad before the torch optimizer's step entry
        if hasattr(self.zero, "fp32_groups_flat_partition") and hasattr(self.zero, "bf16_groups"):
            return self._bf16_applied_points(params, emit)
        inner = getattr(self.zero, "_optimizer_step", None)
        groups = getattr(self.zero, "bit16_groups" if self.stage < 3 else "fp16_groups", None)
        if inner is None or groups is None:
            log.warning(
                "trainmon: DeepSpeed ZeRO stage %d optimizer %s has no '_optimizer_step' / param groups "
                "(another DeepSpeed version or optimizer?); grad_reduced is read at step entry, "
                "before DeepSpeed's clipping",
                self.stage,
                type(self.zero).__name__,
            )
            return None
        by_id = {id(tp.param): tp for tp in params}
        applied = self._z3_applied if self.stage == 3 else self._z12_applied

        def optimizer_step(group: int, *args: Any, **kwargs: Any) -> Any:
            mine = [tp for p in groups[group] if (tp := by_id.get(id(p))) is not None]
            if mine:
                emit([(tp, applied(tp, group)) for tp in mine])
            return inner(group, *args, **kwargs)

        self.zero._optimizer_step = optimizer_step
        return [Handle(lambda: delattr(self.zero, "_optimizer_step"))]

    def _bf16_applied_points(
        self, params: list[TrackedParam], emit: Callable[[list[tuple[TrackedParam, View]]], None]
    ) -> list[Handle]:
        """``BF16_Optimizer`` (bf16 with fp32 grad accumulation, ZeRO 1) clips its fp32 grads,
        hands them to the fp32 partitions, then steps the inner optimizer once for all groups."""
        by_id = {id(tp.param): tp for tp in params}
        order = [
            (tp, g)
            for g, group in enumerate(self.zero.bf16_groups)
            for p in group
            if (tp := by_id.get(id(p))) is not None
        ]

        def pre(*_: Any) -> None:
            pairs = []
            for tp, g in order:
                flat = self.zero.fp32_groups_flat_partition[g].grad
                mapping = getattr(tp.param, "_hp_mapping", None)
                if mapping is None or flat is None:
                    pairs.append((tp, self._sharded(tp, None)))
                else:
                    address = mapping.hp_fragment_address
                    pairs.append((tp, self._sharded(tp, flat.detach().narrow(0, address.start, address.numel))))
            emit(pairs)

        return [Handle(self.zero.optimizer.register_step_pre_hook(pre).remove)]

    def _fp16_applied_points(
        self, params: list[TrackedParam], emit: Callable[[list[tuple[TrackedParam, View]]], None]
    ) -> list[Handle]:
        """Stage 0 fp16: the masters' grads, unscaled and clipped, at the inner optimizer's step entry."""
        masters = self._masters or {}

        def pre(*_: Any) -> None:
            pairs = []
            for tp in params:
                master = masters.get(id(tp.param))
                if master is not None and master.grad is not None:
                    pairs.append((tp, View(master.grad.detach())))
            emit(pairs)

        return [Handle(self.engine.optimizer.optimizer.register_step_pre_hook(pre).remove)]

    def _z12_applied(self, tp: TrackedParam, group: int) -> View:
        """This rank's slice of the clipped fp32 grad partition the inner optimizer is about to apply."""
        mapping = getattr(tp.param, "_hp_mapping", None)
        flat = self.zero.single_partition_of_fp32_groups[group].grad
        if mapping is None or flat is None:
            return self._sharded(tp, None)
        address = mapping.hp_fragment_address
        return self._sharded(tp, flat.detach().narrow(0, address.start, address.numel))

    def _z3_applied(self, tp: TrackedParam, group: int) -> View:
        flat = self.zero.fp32_partitioned_groups_flat[group].grad
        if flat is None:
            return self._sharded(tp, None)
        _, offset, numel = self.zero.grad_position[self.zero.get_param_id(tp.param)]
        return self._sharded(tp, self._z3_valid(tp, flat.detach().narrow(0, offset, numel)))

    def _micro_step(self) -> int:
        """Index of the running micro-batch in its step (``micro_steps`` counts finished ones)."""
        return int(self.engine.micro_steps) % max(1, int(self.engine.gradient_accumulation_steps()))

    def _z2_bucket_params(self, comm_dtype: Any = None) -> list[nn.Parameter]:
        # ``bucket.params`` holds (group index, index in group, param id) tuples in 0.19.x
        buckets = self.zero.ipg_buckets
        keys = [comm_dtype] if comm_dtype is not None else list(buckets.keys())
        groups = self.zero.bit16_groups
        return [groups[g][i] for k in keys if k in buckets for g, i, _ in buckets[k].params]

    def _z3_bucket_params(self, comm_dtype: Any = None) -> list[nn.Parameter]:
        bucket = self.zero.ipg_buckets.get(comm_dtype)
        return list(bucket.params) if bucket is not None else []

    def local_grad(self, tp: TrackedParam) -> View | None:
        """The grad as DeepSpeed is about to reduce it (stages 2/3: this micro-batch's only)."""
        if self.stage == 2:
            g = self.zero.get_gradient_for_reduction(tp.param)
        elif self.stage == 3:
            g = tp.param.grad  # still whole: partitioned only after the reduce-scatter
        else:
            view = super().local_grad(tp)
            # keep the view's shard group/shape (a tensor-parallel param): only the scale is DeepSpeed's
            return view if view is None or not self.fp16 else replace(view, scale=self._loss_scale())
        return None if g is None else View(g.detach().reshape(-1), None, self._shape(tp), scale=self._loss_scale())

    # -- fragments ---------------------------------------------------------------------------
    def _z3_valid(self, tp: TrackedParam, t: torch.Tensor) -> torch.Tensor:
        """This rank's partition without the padding that rounds partitions up."""
        rank = torch.distributed.get_rank(self.group)
        size = t.numel()
        valid = max(0, min(size, tp.param.ds_numel - rank * size))  # type: ignore[attr-defined]  # set by ZeRO-3
        return t.reshape(-1)[:valid]

    def _sharded(self, tp: TrackedParam, t: torch.Tensor | None) -> View:
        if t is None:
            t = torch.empty(0, dtype=torch.float32, device=tp.param.device)
        return View(t.reshape(-1), self.group, self._shape(tp))

    @staticmethod
    def _shape(tp: TrackedParam) -> tuple[int, ...]:
        return tuple(getattr(tp.param, "ds_shape", None) or tp.param.shape)

    def reduced_grad(self, tp: TrackedParam) -> View | None:
        if self.stage == 0:
            return super().reduced_grad(tp)
        if self.stage == 3:
            g = self.zero.get_local_fp32_grad_for_param(tp.param)
            return self._sharded(tp, None if g is None else self._z3_valid(tp, g))
        mapping = getattr(tp.param, "_hp_mapping", None)
        if mapping is None:
            return self._sharded(tp, None)
        index = tp.param._index_in_param_group  # type: ignore[attr-defined]  # set by ZeRO
        frag = mapping.get_lp_grad_fragment(index).reshape(-1).float()
        address = mapping.lp_fragment_address
        if frag.numel() == tp.param.numel() and frag.numel() != address.numel:
            frag = frag.narrow(0, address.start, address.numel)  # a full local buffer (bf16)
        return self._sharded(tp, frag)

    def param(self, tp: TrackedParam) -> View:
        if self.stage == 0:
            master = (self._masters or {}).get(id(tp.param))
            return super().param(tp) if master is None else View(master.detach())
        if self.stage == 3:
            return self._sharded(tp, self._z3_valid(tp, self.zero.get_local_fp32_param(tp.param)).detach())
        mapping = getattr(tp.param, "_hp_mapping", None)
        return self._sharded(tp, None if mapping is None else mapping.hp_fragment.detach())

    def moments(self, tp: TrackedParam) -> dict[str, View]:
        if self.stage == 0 and self._masters is not None:
            master = self._masters.get(id(tp.param))
            state = self.engine.optimizer.optimizer.state.get(master, {}) if master is not None else {}
            return {k: View(state[k].detach()) for k in _MOMENTS if isinstance(state.get(k), torch.Tensor)}
        if self.stage == 0:
            return super().moments(tp)
        out = {}
        for key in _MOMENTS:
            out[key] = self._sharded(tp, self._moment(tp, key))
        return out

    def _moment(self, tp: TrackedParam, key: str) -> torch.Tensor | None:
        if self.stage == 3:
            try:
                t = self.zero.get_local_fp32_param(tp.param, key)
            except (KeyError, ValueError):
                return None
            return None if t is None else self._z3_valid(tp, t)
        mapping = getattr(tp.param, "_hp_mapping", None)
        frags = getattr(mapping, "optim_fragment", None) or {}
        return frags[key] if key in frags else self._flat_moment(mapping, key)

    def _flat_moment(self, mapping: Any, key: str) -> torch.Tensor | None:
        """This param's slice of the moment of its flat fp32 partition, from the inner optimizer.

        DeepSpeed links ``optim_fragment`` once, right after the first param group's first step,
        so the other groups' params (the Trainer's no-weight-decay group) are never linked."""
        if mapping is None:
            return None
        flats = getattr(self.zero, "single_partition_of_fp32_groups", None)
        if flats is None:
            flats = getattr(self.zero, "fp32_groups_flat_partition", None)  # BF16_Optimizer
        inner = getattr(self.zero, "optimizer", None)
        if flats is None or inner is None:
            return None
        moment = inner.state.get(flats[mapping.param_group_index], {}).get(key)
        if not isinstance(moment, torch.Tensor):
            return None
        address = mapping.hp_fragment_address
        return moment.detach().narrow(0, address.start, address.numel)

    def has_moments(self) -> bool:
        return True if self.stage > 0 or self._masters is not None else super().has_moments()
