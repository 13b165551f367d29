"""FSDP2 over tensor parallelism (the torchtitan layout) on a 2x2 gloo mesh: ``parallelize_module``
over the "tp" dimension, ``fully_shard`` over "dp".  Every param, reduced grad and Adam moment is
reported as the statistics of the full tensor (merged over both mesh dimensions, or over "dp" alone
for a TP-replicated bias), under the names of the unwrapped model, against a single-process
reference trained on the global batch."""
from __future__ import annotations

import copy
import functools
import math
import os

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from tests._support.dist_checks import (MB, batch, check_family, check_param_families, expected_step, rank_dir,
                                        reference_state, tiny_model, write_config)
from tests._support.distributed import run_distributed
from tests._support.runs import read_family
from trainmon import TrainerMon
from trainmon.integrations.fsdp2 import PRE_REDUCE_ENV

pytestmark = pytest.mark.slow   # a real 4-process gloo job

STEPS, DP, TP = 2, 2, 2


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _job(rank, world, tmp, run_id, pre_reduce):
    os.environ["TRAINMON_RUN_ID"] = run_id
    os.environ[PRE_REDUCE_ENV] = "1" if pre_reduce else "0"
    cfg = write_config(tmp / f"{run_id}.json", wg_distribution=True, mv_distribution=True, param_distribution=True,
                       ops=["norm", "mean", "min", "max"], xy_distribution=not pre_reduce, all_xy=True)
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    model = tiny_model()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    # layer 0's output stays a DTensor (sharded over tp) into Tanh and the row-parallel layer 2
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(use_local_output=False), "2": RowwiseParallel()})
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    placements = {n: tuple(type(p).__name__ for p in param.placements) for n, param in model.named_parameters()}
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt)
    out, expected, clip = rank_dir(run_id, rank), [], []
    for step in range(STEPS):
        origin = {n: p.detach().clone() for n, p in ref.named_parameters()}
        local, full = expected_step(ref, step, DP, 1, dp_rank, no_sync=True)
        x, y = batch(step, DP * MB)
        xb, yb = x[dp_rank * MB:(dp_rank + 1) * MB], y[dp_rank * MB:(dp_rank + 1) * MB]
        acts = _activations(ref, xb, yb)
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(_full(p.grad), full[n], rtol=1e-5, atol=1e-7)
        clip.append(_full(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)).item())
        for n, p in ref.named_parameters():
            p.grad = full[n].clone()
        ref_opt.step()
        opt.step()
        opt.zero_grad()
        updated, moments = reference_state(ref, ref_opt)
        expected.append((local, full, origin, updated, moments, acts))
    mon.close()
    for step, (local, full, origin, updated, moments, (actv, actv_grad)) in enumerate(expected):
        if not pre_reduce:   # activations: whole over TP whether DTensors (merged) or replicated plain tensors
            check_family(out, "actv", step, actv)
            check_family(out, "actv_grad", step, actv_grad)
        if pre_reduce:   # this DP rank's own grad (its half of the batch), whole over TP
            check_family(out, "grad_unreduced", step, local)
        check_family(out, "grad_reduced", step, full)
        check_param_families(out, step, origin, updated, moments)
        reduced = read_family(out, "grad_reduced")
        total = math.sqrt((reduced[reduced["step"] == step]["norm"] ** 2).sum())
        assert math.isclose(total, clip[step], rel_tol=1e-5), (total, clip[step])
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(_full(p.detach()), q.detach(), rtol=1e-5, atol=1e-7, msg=n)
    if not pre_reduce:
        assert read_family(out, "grad_unreduced").empty
    return placements


def _activations(ref, xb, yb):
    """Inputs/outputs of every submodule of the reference on this DP rank's batch, and their grads."""
    model = copy.deepcopy(ref)
    actv, grads, handles = {}, {}, []

    def keep(label, kind, t):
        actv[f"{label}.{kind}"] = t.detach().clone()
        if t.requires_grad:
            t.register_hook(lambda g: grads.__setitem__(f"{label}.{kind}", g.detach().clone()))

    def hook(label, _m, args, out):
        keep(label, "input", args[0])
        keep(label, "output", out)

    for label, m in model.named_children():
        handles.append(m.register_forward_hook(functools.partial(hook, label)))
    torch.nn.functional.mse_loss(model(xb), yb).backward()
    for h in handles:
        h.remove()
    return actv, grads


def _body(rank, world, tmp):
    return [_job(rank, world, tmp, "fsdp-tp", False), _job(rank, world, tmp, "fsdp-tp-pre", True)]


def test_fsdp2_over_tp_reports_full_tensor_stats_of_every_param_grad_and_moment(output_root, tmp_path):
    placements = [p[0] for p in run_distributed(_body, world_size=DP * TP, timeout=300, args=(tmp_path,))]
    # the layout is really 2-D: weights sharded over both dims, the row-parallel bias over dp only
    w0 = placements[0]["0.weight"]
    assert len(w0) == 2 and all("Shard" in p for p in w0), w0
    assert "Replicate" in placements[0]["2.bias"][1], placements[0]["2.bias"]
    for run in ("fsdp-tp", "fsdp-tp-pre"):
        assert sorted(p.name for p in (output_root / run).iterdir() if p.is_dir()) == \
            [f"rank{r}" for r in range(DP * TP)]
