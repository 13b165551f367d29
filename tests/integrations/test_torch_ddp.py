"""torch DDP on real gloo ranks: pre-reduce = this rank's local grad, post-reduce = the full-batch
grad, moments = a plain torch Adam fed that grad, training unchanged by the monitor."""
from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tests._support.dist_checks import (MB, batch, check_family, check_param_families, expected_step, micro,
                               rank_dir, reference_state, tiny_model, write_config)
from tests._support.distributed import run_distributed
from trainmon import TrainerMon

pytestmark = pytest.mark.slow   # real multi-process gloo jobs

STEPS = 2


def _scenario(rank, world, tmp, acc, no_sync, bucket_view, run_id):
    os.environ["TRAINMON_RUN_ID"] = run_id
    cfg = write_config(tmp / f"{run_id}.json", wg_distribution=True, mv_distribution=True,
                       param_distribution=True, ops=["norm", "mean", "min", "max"])
    model = tiny_model()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    ddp = DDP(model, gradient_as_bucket_view=bucket_view)
    opt = torch.optim.Adam(ddp.parameters(), lr=0.05)
    mon = TrainerMon(cfg)
    mon.set_monitor(ddp, grad_acc_steps=acc, optimizer=opt)
    out = rank_dir(run_id, rank)
    expected = []
    for step in range(STEPS):
        origin = {n: p.detach().clone() for n, p in ref.named_parameters()}
        local, full = expected_step(ref, step, world, acc, rank, no_sync)
        x, y = batch(step, world * acc * MB)
        for k in range(acc):
            sync_off = no_sync and k < acc - 1
            with ddp.no_sync() if sync_off else contextlib.nullcontext():
                xb, yb = micro(x, y, world, acc, rank, k)
                (torch.nn.functional.mse_loss(ddp(xb), yb) / acc).backward()
        for n, p in ref.named_parameters():
            p.grad = full[n].clone()
        ref_opt.step()
        opt.step()
        opt.zero_grad()
        updated, moments = reference_state(ref, ref_opt)
        expected.append((local, full, origin, updated, moments))
    mon.close()
    for step, (local, full, origin, updated, moments) in enumerate(expected):
        check_family(out, "grad_unreduced", step, local)
        check_family(out, "grad_reduced", step, full)
        check_param_families(out, step, origin, updated, moments)
    # the monitor did not change training: DDP's params are the reference's
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-7, msg=n)
    return sorted(d for d in os.listdir(out.parent) if d.startswith("rank"))


def _ddp_matrix(rank, world, tmp, cases):
    return [_scenario(rank, world, tmp, *case) for case in cases]


def test_ddp_two_ranks_pre_and_post_reduce(output_root, tmp_path):
    cases = [(2, True, True, "ns-bv"), (2, True, False, "ns-copy"), (2, False, True, "sync-bv"),
             (3, False, False, "sync-copy"), (1, False, True, "acc1")]
    dirs = run_distributed(_ddp_matrix, world_size=2, timeout=180, args=(tmp_path, cases))
    assert dirs[0] == dirs[1] == [["rank0", "rank1"]] * len(cases)
    assert sorted(p.name for p in output_root.iterdir()) == sorted(c[-1] for c in cases)


def test_ddp_four_ranks(output_root, tmp_path):
    cases = [(2, True, True, "w4-ns"), (2, False, False, "w4-sync")]
    dirs = run_distributed(_ddp_matrix, world_size=4, timeout=240, args=(tmp_path, cases))
    assert all(d == [[f"rank{r}" for r in range(4)]] * 2 for d in dirs)


def _recorded_reduce_body(rank, world, tmp):
    """Two identical DDP models on the same data: one plain, one whose bucket reduces are recorded
    (``record_ddp_comm`` without a user hook).  Their params stay bit for bit the same."""
    from trainmon.integrations.torch_ddp import record_ddp_comm

    os.environ["TRAINMON_RUN_ID"] = "ddp-recorded"
    cfg = write_config(tmp / "rec.json", ops=["norm"], cc_distribution={"enable": True})
    plain_model, recorded_model = tiny_model(), tiny_model()
    plain, recorded = DDP(plain_model), DDP(recorded_model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, recorded)]
    mon = TrainerMon(cfg)
    mon.set_monitor(recorded, optimizer=opts[1])
    record_ddp_comm(mon, recorded)
    for step in range(2):
        x, y = micro(*batch(step, world * MB), world, 1, rank, 0)
        for model, opt in zip((plain, recorded), opts):
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    mon.close()
    return [torch.equal(p, q) for p, q in zip(plain_model.parameters(), recorded_model.parameters())]


def test_recording_ddp_bucket_reduces_leaves_training_bitwise_unchanged_on_three_ranks(output_root, tmp_path):
    """torch's allreduce_hook divides by the world size, DDP multiplies by its inverse: at 3 ranks
    the bits differ, so the recorder's default hook is DDP's own reduction."""
    same = run_distributed(_recorded_reduce_body, world_size=3, timeout=180, args=(tmp_path,))
    assert same == [[True] * len(same[0])] * 3, same
