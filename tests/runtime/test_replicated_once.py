"""``replicated_once``: on real gloo DDP ranks, the replicated families are written by rank 0 only,
with the values every rank would have written, and ``trainmon ranks`` still checks the run."""
from __future__ import annotations

import json
import os

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tests._support.dist_checks import batch, micro, rank_dir, tiny_model, write_config
from tests._support.distributed import run_distributed
from tests._support.runs import read_family
from trainmon import TrainerMon
from trainmon.config import parse_config
from trainmon.output.layout import parse_family_file
from trainmon.families import FAMILIES
from trainmon.runtime.builder import REPLICATED_UNDER_DDP

ALL = ("grad_unreduced", "grad_reduced", "param_origin", "param_updated", "exp_avg", "exp_avg_sq", "update_ratio")


def _train(rank, world, tmp, run_id, once):
    os.environ["TRAINMON_RUN_ID"] = run_id
    cfg = write_config(tmp / f"{run_id}.json", wg_distribution=True, mv_distribution=True, param_distribution=True,
                       ur_distribution=True, replicated_once=once, ops=["norm", "mean", "max"])
    ddp = DDP(tiny_model())
    opt = torch.optim.Adam(ddp.parameters(), lr=0.05)
    mon = TrainerMon(cfg)
    mon.set_monitor(ddp, optimizer=opt)
    for step in range(3):
        x, y = batch(step, world * 4)
        xb, yb = micro(x, y, world, 1, rank, 0)
        torch.nn.functional.mse_loss(ddp(xb), yb).backward()
        opt.step()
        opt.zero_grad()
    mon.close()
    return sorted({parse_family_file(p).family for p in rank_dir(run_id, rank).glob("*.csv")})


def _jobs(rank, world, tmp):
    return [_train(rank, world, tmp, "once", True), _train(rank, world, tmp, "all", False)]


def test_replicated_once_is_a_documented_boolean_key():
    assert parse_config({"replicated_once": True}, "x").replicated_once is True
    assert parse_config({}, "x").replicated_once is False
    # every family equal on all ranks under plain DDP (families.FAMILIES' replicated ones + grad_reduced)
    replicated = {str(f) for f, info in FAMILIES.items() if info.replicated} | {"grad_reduced"}
    assert REPLICATED_UNDER_DDP == replicated and set(ALL) - {"grad_unreduced"} <= replicated


@pytest.mark.slow
def test_replicated_families_only_on_rank0_equal_to_a_full_run_and_ranks_still_checks(output_root, tmp_path, capsys):
    from trainmon.cli import main

    families = run_distributed(_jobs, world_size=2, timeout=240, args=(tmp_path,))
    assert families[0] == [sorted(ALL), sorted(ALL)]
    assert families[1] == [["grad_unreduced"], sorted(ALL)]
    once, full = output_root / "once", output_root / "all"
    for family in ALL:  # rank 0 wrote exactly what it writes without the option
        assert read_family(once / "rank0", family).equals(read_family(full / "rank0", family)), family
    assert read_family(once / "rank1", "grad_unreduced").equals(read_family(full / "rank1", "grad_unreduced"))
    assert main(["ranks", str(once), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ranks"] == [0, 1] and doc["issues"] == []
