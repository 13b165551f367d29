"""grad_probe, loss alignment and ``similarity``/``compare`` on real 2-rank DDP runs (gloo)."""
from __future__ import annotations

import os

import pandas as pd
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tests._support.dist_checks import batch, tiny_model, write_config
from tests._support.distributed import run_distributed
from tests._support.runs import compare_runs
from tests.collectors.test_grad_probe import counts_by_hand
from trainmon import TrainerMon
from trainmon.diagnosis.similarity import similarities, write_similarities

pytestmark = pytest.mark.slow

STEPS, MB, BOUNDS = 3, 4, [-0.05, 0.0, 0.05]
CONFIG = {"grad_probe": {"grad_level": "L2", "bounds": BOUNDS}, "loss_alignment": True}


def _runs(rank, world, tmp):
    truth = {}
    for run_id, change_at in (("base", None), ("late", 1)):
        os.environ["TRAINMON_RUN_ID"] = run_id
        cfg = write_config(tmp / f"{run_id}.json", **CONFIG)
        ddp = DDP(tiny_model())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        mon = TrainerMon(cfg).set_monitor(ddp, optimizer=opt)
        for step in range(STEPS):
            seed = 2 if change_at is not None and step >= change_at and rank == 1 else 1
            x, y = batch(step, world * MB, seed=seed)
            loss = torch.nn.functional.mse_loss(ddp(x[rank * MB:(rank + 1) * MB]), y[rank * MB:(rank + 1) * MB])
            mon.record_loss(loss)
            loss.backward()
            truth[(run_id, step)] = {n.removeprefix("module."): counts_by_hand(p.grad, BOUNDS)
                                     for n, p in ddp.named_parameters()}
            opt.step()
            opt.zero_grad()
        mon.close()
    return truth


def test_two_rank_runs_probe_each_rank_and_compare_per_rank(tmp_path):
    out = tmp_path / "out"
    truths = run_distributed(_runs, world_size=2, timeout=240, args=(tmp_path,),
                             env={"MONITOR_OUTPUT_DIR": str(out)})
    for rank, truth in enumerate(truths):        # L1 on each rank: the reduced grad that rank applied
        for run_id in ("base", "late"):
            files = sorted((out / run_id / f"rank{rank}").glob("grad_probe_*.csv"))
            df = pd.concat([pd.read_csv(f) for f in files])
            for row in df.itertuples(index=False):
                counts = truth[(run_id, row.step)][row.name]
                numel = sum(counts[:-1])
                assert list(row[3:8]) == [c / numel for c in counts], (rank, run_id, row.name)
    result = similarities(out / "base", out / "late")
    assert result.multi_rank and set(result.frame["rank"]) == {0, 1}
    f = result.frame
    assert (f[f["step"] < 1]["similarity"] == 1.0).all()
    first = result.first_below(1.0)
    assert (first["step"], first["rank"]) == (1, 0)       # DDP: both ranks apply the changed grad
    write_similarities(result, tmp_path / "sim")
    table = pd.read_csv(tmp_path / "sim" / "similarities.csv")
    assert list(table.columns) == ["rank", "step", "name", "similarity"]
    cmp = compare_runs(out / "base", out / "late")
    stages = {(s.stage, s.rank): s.match for s in cmp.stages}
    assert stages[("metadata", 0)] and stages[("metadata", 1)] and stages[("hyperparams", 1)]
    assert stages[("sample_data", 0)] is True and stages[("sample_data", 1)] is False
    d = cmp.first_difference
    assert (d.stage, d.kind, d.rank, d.step) == ("sample_data", "model_input", 1, 1)
