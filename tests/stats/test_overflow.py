"""Large finite values end to end (issue 12, item 3): a run whose params are filled with 1e38 and
whose grads hold 1e18-sized elements records finite, exact norms/means/stds, and ``anomalies``
finds nothing non-finite in it."""
from __future__ import annotations

import json
import math

import pytest
import torch

from tests._support.runs import only_run_dir, read_family, reference_stats
from trainmon import TrainerMon
from trainmon.cli import main

OPS = ["norm", "mean", "min", "max", "std", "nans", "infs"]


@pytest.mark.slow   # a monitored run per case
@pytest.mark.parametrize("fused", ["1", "0"])
def test_huge_finite_params_and_grads_are_recorded_finite_and_not_flagged(output_root, tmp_path, monkeypatch,
                                                                          capsys, fused):
    monkeypatch.setenv("TRAINMON_FUSED_CPU", fused)
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"wg_distribution": True, "param_distribution": True, "ops": OPS}))
    model = torch.nn.Linear(300, 40)
    with torch.no_grad():
        model.weight.fill_(1e38)
        model.bias.fill_(-3e38)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)   # lr 0: the params stay as they are
    mon = TrainerMon(str(cfg))
    mon.set_monitor(model, optimizer=opt)
    x = torch.full((4, 300), 1e-20)
    model.weight.register_hook(lambda g: torch.full_like(g, 1e18))   # every weight grad element 1e18
    for _ in range(2):
        opt.zero_grad()
        (model(x).sum() * 1e-20).backward()
        grads = {"weight": model.weight.grad.clone(), "bias": model.bias.grad.clone()}
        opt.step()
    mon.close()
    run = only_run_dir(output_root)
    params = read_family(run / "rank0", "param_origin")
    for name, t in (("weight", model.weight), ("bias", model.bias)):
        row = params[params["name"].str.endswith(name)].iloc[0]
        want = reference_stats(t)
        for op in ("norm", "mean", "min", "max", "std"):
            assert math.isfinite(row[op]) and row[op] == pytest.approx(want[op], rel=1e-6, abs=1e-6), (name, op)
        assert row["nans"] == row["infs"] == 0
    g = read_family(run / "rank0", "grad_reduced")
    row = g[g["name"].str.endswith("weight")].iloc[-1]
    assert row["norm"] == pytest.approx(reference_stats(grads["weight"])["norm"], rel=1e-6)
    capsys.readouterr()
    assert main(["anomalies", str(run), "--rules", "nonfinite", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["anomalies"] == []
