"""FSDP2 fully_shard on real gloo ranks: sharded grads, params and moments are reported as the
stats of the full tensor (merged from every rank's shard, empty shards included), the norms
agree with clip_grad_norm_, and the opt-in pre-reduce capture sees this rank's local grad."""
from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from tests._support.runs import read_family
from tests._support.dist_checks import (MB, batch, check_family, check_param_families, expected_step, micro,
                               rank_dir, reference_state, tiny_model, write_config)
from tests._support.distributed import run_distributed
from trainmon import TrainerMon
from trainmon.integrations.fsdp2 import PRE_REDUCE_ENV

pytestmark = pytest.mark.slow   # real multi-process gloo jobs

STEPS, ACC = 2, 2


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _scenario(rank, world, tmp, run_id, pre_reduce, hsdp=False):
    os.environ["TRAINMON_RUN_ID"] = run_id
    os.environ[PRE_REDUCE_ENV] = "1" if pre_reduce else "0"
    cfg = write_config(tmp / f"{run_id}.json", wg_distribution=True, mv_distribution=True,
                       param_distribution=True, ur_distribution=True, ops=["norm", "mean", "min", "max"],
                       cc_distribution={"enable": run_id == "fsdp-post", "cc_pre_hook": True})
    model = tiny_model()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    # HSDP: replicate over mesh dim 0, shard over dim 1; the merge must skip the replicas
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard")) if hsdp else None
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    mon = TrainerMon(cfg)
    mon.set_monitor(model, grad_acc_steps=ACC, optimizer=opt)
    local_shapes = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    out, expected, clip = rank_dir(run_id, rank), [], []
    for step in range(STEPS):
        origin = {n: p.detach().clone() for n, p in ref.named_parameters()}
        before = origin
        local, full = expected_step(ref, step, world, ACC, rank, no_sync=True)
        x, y = batch(step, world * ACC * MB)
        for k in range(ACC):
            model.set_requires_gradient_sync(k == ACC - 1)
            xb, yb = micro(x, y, world, ACC, rank, k)
            (torch.nn.functional.mse_loss(model(xb), yb) / ACC).backward()
        for n, p in model.named_parameters():   # the reduced grad is the full-batch grad
            torch.testing.assert_close(_full(p.grad), full[n], rtol=1e-5, atol=1e-7)
        clip.append(_full(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)).item())
        for n, p in ref.named_parameters():
            p.grad = full[n].clone()
        ref_opt.step()
        opt.step()
        opt.zero_grad()
        updated, moments = reference_state(ref, ref_opt)
        ratio = {n: ((updated[n].double() - before[n].double()).norm() / before[n].double().norm()).item()
                 for n in updated}
        expected.append((local, full, origin, updated, moments, ratio))
    mon.close()
    for step, (local, full, origin, updated, moments, ratio) in enumerate(expected):
        if pre_reduce:
            check_family(out, "grad_unreduced", step, local)
        check_family(out, "grad_reduced", step, full)
        check_param_families(out, step, origin, updated, moments)
        reduced = read_family(out, "grad_reduced")
        total = math.sqrt((reduced[reduced["step"] == step]["norm"] ** 2).sum())
        assert math.isclose(total, clip[step], rel_tol=1e-5), (total, clip[step])
        ur = read_family(out, "update_ratio")
        for n, want in ratio.items():
            got = ur[(ur["step"] == step) & (ur["name"] == n)]["update_ratio"].item()
            assert math.isclose(got, want, rel_tol=1e-5), (n, got, want)
    if not pre_reduce:
        assert read_family(out, "grad_unreduced").empty
    if run_id == "fsdp-post":
        _check_fsdp_comm(read_family(out, "comm"))
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(_full(p.detach()), q.detach(), rtol=1e-5, atol=1e-7, msg=n)
    return local_shapes


def _check_fsdp_comm(comm):
    """FSDP2's own all-gathers and reduce-scatters go through torch.distributed: recorded, each
    with a pre and a post row per tensor, and none of trainmon's shard merges among them."""
    assert {"all_gather_single", "reduce_scatter_single"} <= set(comm["name"]), set(comm["name"])
    assert all("/fsdp/" in c for c in comm["caller"]), set(comm["caller"])
    per_call = comm.groupby(["step", "call", "arg", "item"])["when"].apply(sorted)
    assert all(w == ["post", "pre"] for w in per_call), per_call
    # one reduce-scatter per sharded layer per step (the no-sync micro-batch reduces nothing;
    # the root holds no params of its own)
    rs = comm[(comm["name"] == "reduce_scatter_single") & (comm["when"] == "post")]
    assert rs.groupby("step")["call"].nunique().tolist() == [2] * STEPS


def _fsdp_body(rank, world, tmp):
    return [_scenario(rank, world, tmp, "fsdp-post", False), _scenario(rank, world, tmp, "fsdp-pre", True),
            _scenario(rank, world, tmp, "hsdp", False, hsdp=True)]


def test_fsdp2_full_tensor_stats_with_empty_shards(output_root, tmp_path):
    shapes = run_distributed(_fsdp_body, world_size=4, timeout=240, args=(tmp_path,))
    # the [3, 8] weight and [3] bias leave rank 3 an empty shard: merged rows still match
    assert shapes[3][0]["2.bias"] == (0,) and shapes[3][0]["2.weight"][0] == 0
    assert shapes[1][2]["2.bias"] == (1,)     # HSDP: 2-way shards, [2, 1] for the bias
    assert sorted(p.name for p in output_root.iterdir()) == ["fsdp-post", "fsdp-pre", "hsdp"]
    for run in ("fsdp-post", "fsdp-pre", "hsdp"):
        assert sorted(p.name for p in (output_root / run).iterdir() if p.is_dir()) == \
            [f"rank{r}" for r in range(4)]
