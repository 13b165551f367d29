"""API-faithful stand-ins for Megatron-core's optimizer wrappers (tests only).

Megatron's real optimizers allocate on ``device='cuda'`` and check ``'torch.cuda.FloatTensor'``
types, so they cannot be built on a CPU-only torch.  These classes keep the attribute names,
constructor arguments and ``step()`` contract of megatron-core 0.16 (``(success, grad_norm,
num_zeros)``, ``(False, None, None)`` on an fp16 overflow) and do the same work on the CPU: grads
come from ``main_grad``, the inner torch optimizer steps the fp32 main params (or, for the
distributed optimizer, the fp32 shards this rank owns), then the model params are refreshed.
``tests/integrations/test_megatron.py`` checks every name used here against the real classes so
the stand-ins cannot drift.  A fused-wgrad linear whose ``param.grad`` is a NaN dummy is here too.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn


class ConstantGradScaler:
    """megatron.core.optimizer.grad_scaler.ConstantGradScaler: ``scale``/``inv_scale`` tensors."""

    def __init__(self, scale: float):
        self.scale = torch.tensor([float(scale)])
        self.inv_scale = 1.0 / self.scale

    def update(self, found_inf: bool) -> None:
        pass


class _Base:
    def __init__(self, optimizer, config):
        self.optimizer = optimizer
        self.config = config
        self.is_stub_optimizer = optimizer is None

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True):
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                p.grad = None

    def get_grad_stats_parallel_group(self):
        return None

    @torch.no_grad()
    def clip_grad_norm(self, clip_grad: float) -> float:
        """megatron.core.optimizer.clip_grads.clip_grad_norm_fp32 on the main grads: the global
        norm (over the grad-stats group), then grad *= clip / (norm + 1e-6) when that is < 1."""
        grads = [p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])) \
            if grads else torch.zeros(())
        group = self.get_grad_stats_parallel_group()
        if group is not None:   # fp32 norms, as Megatron's multi_tensor_l2norm
            sq = norm.pow(2).reshape(1)
            dist.all_reduce(sq, group=group)
            norm = sq.sqrt().reshape(())
        coeff = torch.clamp(clip_grad / (norm + 1.0e-6), max=1.0)
        for g in grads:
            g.mul_(coeff)
        return float(norm)


class FP32Optimizer(_Base):
    def __init__(self, optimizer, config, init_state_fn=None):
        super().__init__(optimizer, config)
        self._scale = torch.tensor([1.0])

    def get_loss_scale(self):
        return self._scale

    @torch.no_grad()
    def step(self):
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                if hasattr(p, "main_grad"):
                    p.grad = p.main_grad
        norm = self.clip_grad_norm(self.config.clip_grad) if self.config.clip_grad > 0 else None
        self.optimizer.step()
        return True, norm, None


class _MixedPrecision(_Base):
    def __init__(self, optimizer, config, grad_scaler, init_state_fn=None):
        super().__init__(optimizer, config)
        self.grad_scaler = grad_scaler
        self._scale_one = torch.tensor([1.0])

    def get_loss_scale(self):
        return self._scale_one if self.grad_scaler is None else self.grad_scaler.scale

    def _main_grads(self):
        return [p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]

    @torch.no_grad()
    def step(self):
        self._copy_model_grads_to_main_grads()
        if self.grad_scaler is not None:
            grads = self._main_grads()
            found = torch.zeros(1)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, self.grad_scaler.inv_scale)
            if dist.is_initialized():
                dist.all_reduce(found, op=dist.ReduceOp.MAX)
            self.grad_scaler.update(bool(found.item() > 0))
            if found.item() > 0:
                return False, None, None
        norm = self.clip_grad_norm(self.config.clip_grad) if self.config.clip_grad > 0 else 0.0
        self.optimizer.step()
        self._copy_main_params_to_model_params()
        return True, norm, 0


class Float16OptimizerWithFloat16Params(_MixedPrecision):
    def __init__(self, optimizer, config, grad_scaler, init_state_fn=None):
        super().__init__(optimizer, config, grad_scaler, init_state_fn)
        self.float16_groups, self.fp32_from_float16_groups, self.fp32_from_fp32_groups = [], [], []
        for group in optimizer.param_groups:
            f16, main16, f32 = [], [], []
            for i, p in enumerate(group["params"]):
                if p.dtype in (torch.float16, torch.bfloat16):
                    main = p.detach().clone().float()
                    group["params"][i] = main
                    p.main_param = main
                    f16.append(p)
                    main16.append(main)
                else:
                    f32.append(p)
            self.float16_groups.append(f16)
            self.fp32_from_float16_groups.append(main16)
            self.fp32_from_fp32_groups.append(f32)

    def _copy_model_grads_to_main_grads(self):
        for mg, fg in zip(self.float16_groups, self.fp32_from_float16_groups):
            for p, main in zip(mg, fg):
                main.grad = p.main_grad.float()
        for group in self.fp32_from_fp32_groups:
            for p in group:
                p.grad = p.main_grad

    def _copy_main_params_to_model_params(self):
        for mg, fg in zip(self.float16_groups, self.fp32_from_float16_groups):
            for p, main in zip(mg, fg):
                p.data.copy_(main)


class Range:
    def __init__(self, start: int, end: int):
        self.start, self.end, self.size = start, end, end - start


class DistributedOptimizer(_MixedPrecision):
    """ZeRO-1 over the DDP grad buffers: this rank owns the dp-rank'th slice of every bucket."""

    def __init__(self, optimizer, config, grad_scaler, init_state_fn, model_chunks, per_model_buffers,
                 data_parallel_group, data_parallel_group_gloo=None, data_parallel_group_idx=0,
                 distributed_optimizer_instance_id=0):
        super().__init__(optimizer, config, grad_scaler, init_state_fn)
        self.model_chunks = model_chunks
        self.buffers = [b for bufs in per_model_buffers.values() for b in bufs]
        self.data_parallel_group = data_parallel_group
        self.gbuf_ranges = [self._build_gbuf_range_map(b) for b in self.buffers]
        self.model_param_gbuf_map = {p: (gi, dtype, bi) for gi, m in enumerate(self.gbuf_ranges)
                                     for dtype, buckets in m.items() for bi, r in enumerate(buckets)
                                     for p in r["param_map"]}
        self.model_float16_groups, self.model_fp32_groups = [], []
        self.shard_fp32_groups, self.shard_fp32_from_float16_groups = [], []
        for group in optimizer.param_groups:
            m16, m32, s32, s16 = [], [], [], []
            for p in group["params"]:
                if p not in self.model_param_gbuf_map:
                    continue
                rng = self._get_model_param_range_map(p)["param"]
                if p.dtype in (torch.float16, torch.bfloat16):
                    m16.append(p)
                    s16.append(p.detach().view(-1)[rng.start:rng.end].clone().float())
                else:
                    m32.append(p)
                    s32.append(p.detach().view(-1)[rng.start:rng.end])
            group["params"] = [*s32, *s16]
            self.model_float16_groups.append(m16)
            self.model_fp32_groups.append(m32)
            self.shard_fp32_groups.append(s32)
            self.shard_fp32_from_float16_groups.append(s16)
        self.optimizer.load_state_dict(self.optimizer.state_dict())

    @classmethod
    def _build_gbuf_range_map(cls, buffer):
        return {(buffer.param_dtype, buffer.grad_dtype): [cls._build_model_gbuf_range(buffer, i)
                                                          for i in range(len(buffer.buckets))]}

    @classmethod
    def _build_model_gbuf_range(cls, buffer, bucket_index):
        rank, world = buffer.data_parallel_group.rank(), buffer.data_parallel_group.size()
        bucket = buffer.buckets[bucket_index]
        size = bucket.grad_data.numel() // world
        lo, hi = bucket.offset + rank * size, bucket.offset + (rank + 1) * size
        param_map = {}
        for p, (start, end, _) in buffer.param_index_map.items():
            s, e = max(start, lo), min(end, hi)
            if e > s:
                param_map[p] = {"gbuf_world": Range(s, e), "gbuf_local": Range(s - lo, e - lo),
                                "gbuf_world_in_bucket": Range(s - bucket.offset, e - bucket.offset),
                                "param": Range(s - start, e - start)}
        return {"param_map": param_map}

    def _get_model_param_range_map(self, param):
        gi, dtype, bi = self.model_param_gbuf_map[param]
        return self.gbuf_ranges[gi][dtype][bi]["param_map"][param]

    def get_grad_stats_parallel_group(self):
        return self.data_parallel_group

    def _copy_model_grads_to_main_grads(self):
        for models, shards in ((self.model_float16_groups, self.shard_fp32_from_float16_groups),
                               (self.model_fp32_groups, self.shard_fp32_groups)):
            for mg, sg in zip(models, shards):
                for p, s in zip(mg, sg):
                    rng = self._get_model_param_range_map(p)["param"]
                    s.grad = p.main_grad.view(-1)[rng.start:rng.end].float()

    def _copy_main_params_to_model_params(self):
        for mg, sg in zip(self.model_float16_groups, self.shard_fp32_from_float16_groups):
            for p, s in zip(mg, sg):
                rng = self._get_model_param_range_map(p)["param"]
                p.data.view(-1)[rng.start:rng.end].copy_(s)
        for chunk in self.model_chunks:   # the all-gather of the updated shards
            chunk.start_param_sync(force_sync=True)


class ChainedOptimizer:
    def __init__(self, chained_optimizers):
        self.chained_optimizers = chained_optimizers
        self.is_stub_optimizer = not chained_optimizers

    def get_loss_scale(self):
        return self.chained_optimizers[0].get_loss_scale()

    def zero_grad(self, set_to_none: bool = True):
        for o in self.chained_optimizers:
            o.zero_grad(set_to_none)

    @torch.no_grad()
    def step(self):
        ok = True
        for o in self.chained_optimizers:
            ok = o.step()[0] and ok
        return (ok, 0.0, 0) if ok else (False, None, None)


def optimizer_config(**kw) -> SimpleNamespace:
    return SimpleNamespace(**{**dict(clip_grad=0.0, log_num_zeros_in_grad=False, fp16=False, bf16=False), **kw})


class _FusedWgrad(torch.autograd.Function):
    """y = x @ w.T whose weight grad goes straight into ``main_grad`` (gradient-accumulation
    fusion); autograd gets a NaN-filled dummy, as Megatron's is uninitialised memory."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        weight.main_grad.add_((dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])).to(weight.main_grad.dtype))
        weight.grad_added_to_main_grad = True
        return dy @ weight, torch.full_like(weight, float("nan"))


class FusedLinear(nn.Module):
    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) / n_in ** 0.5)

    def forward(self, x):
        if not hasattr(self.weight, "main_grad"):   # a plain reference copy
            return x @ self.weight.t()
        return _FusedWgrad.apply(x, self.weight)
