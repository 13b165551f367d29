"""Tensor-parallel shards (Megatron-style ``tensor_model_parallel``/``partition_dim`` attributes)
on real gloo ranks: sharded params are reported as the full tensor, merged over ``tp_group``;
replicated params are reported once, not once per TP rank; the monitor's own merge collectives
never show up in the comm rows."""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests._support.runs import read_family
from tests._support.dist_checks import (batch, check_family, check_param_families, rank_dir, reference_state,
                               tiny_model, write_config)
from tests._support.distributed import run_distributed
from trainmon import TrainerMon

pytestmark = pytest.mark.slow   # real multi-process gloo jobs

STEPS = 2


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's row-parallel output reduce: all_reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        out = x.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad


class _TPMlp(nn.Module):
    """Column-parallel first linear (weight and bias split on dim 0), row-parallel second
    linear (weight split on dim 1), replicated output bias."""

    def __init__(self, full: nn.Sequential, rank: int, world: int):
        super().__init__()
        w1, b1, w2, b2 = (p.detach() for p in full.parameters())
        rows = w1.shape[0] // world
        part = slice(rank * rows, (rank + 1) * rows)
        self.w1 = self._shard(w1[part], 0)
        self.b1 = self._shard(b1[part], 0)
        self.w2 = self._shard(w2[:, part], 1)
        self.b2 = nn.Parameter(b2.clone())

    @staticmethod
    def _shard(t, dim):
        p = nn.Parameter(t.clone())
        p.tensor_model_parallel, p.partition_dim = True, dim
        return p

    def forward(self, x):
        h = torch.tanh(x @ self.w1.T + self.b1)
        return _ReduceFromTP.apply(h @ self.w2.T) + self.b2


def _body(rank, world, tmp):
    os.environ["TRAINMON_RUN_ID"] = "tp"
    cfg = write_config(tmp / "tp.json", wg_distribution=True, mv_distribution=True,
                       param_distribution=True, ur_distribution=True, ops=["norm", "mean", "min", "max"],
                       cc_distribution={"enable": True})
    ref = tiny_model()
    model = _TPMlp(copy.deepcopy(ref), rank, world)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt, tp_group=dist.group.WORLD)
    names = {"w1": "0.weight", "b1": "0.bias", "w2": "2.weight", "b2": "2.bias"}
    expected = []
    for step in range(STEPS):
        x, y = batch(step, 4)       # every TP rank sees the same batch
        origin = {n: p.detach().clone() for n, p in zip(names, ref.parameters())}
        for m, opt_ in ((ref, ref_opt), (model, opt)):
            torch.nn.functional.mse_loss(m(x), y).backward()
        grads = {n: p.grad.clone() for n, p in zip(names, ref.parameters())}
        ref_opt.step()
        opt.step()
        for o in (ref_opt, opt):
            o.zero_grad()
        updated, moments = reference_state(ref, ref_opt, names)
        expected.append((grads, origin, updated, moments))
    mon.close()
    out = rank_dir("tp", rank)
    for step, (grads, origin, updated, moments) in enumerate(expected):
        check_family(out, "grad_unreduced", step, grads)
        check_family(out, "grad_reduced", step, grads)
        check_param_families(out, step, origin, updated, moments)
    comm = read_family(out, "comm")
    # the model's own forward all_reduce only (1 per step), none of trainmon's merges
    assert set(comm["name"]) == {"all_reduce"} and len(comm) == STEPS, comm
    assert all(c.rsplit(":", 1)[0].endswith("test_tensor_parallel.py") for c in comm["caller"])
    return read_family(out, "param_origin")[["name", "shape"]].drop_duplicates().values.tolist()


def test_tp_shards_merged_replicas_not_double_counted(output_root, tmp_path):
    shapes = run_distributed(_body, world_size=2, timeout=120, args=(tmp_path,))
    assert shapes[0] == shapes[1]
    assert dict(shapes[0]) == {"w1": "[8, 6]", "b1": "[8]", "w2": "[3, 8]", "b2": "[3]"}
