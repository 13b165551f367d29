"""Odd parameters (issue 12, item 8): a complex parameter is recorded by its modulus |z| (norm =
the complex 2-norm, computed here in float64 from the tensor), and a zero-element parameter is
recorded but never a finding of ``anomalies`` (nor of the runtime alerts)."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn

from tests._support.runs import only_run_dir, read_family
from trainmon import TrainerMon
from trainmon.cli import main


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.z = nn.Parameter(torch.randn(6, 3, dtype=torch.complex64))
        self.empty = nn.Parameter(torch.zeros(0, 4))

    def forward(self, x):
        y = self.lin(x)
        # the complex and the empty param both take part, so both get (complex / empty) grads
        return (y.sum() + (self.z.abs() ** 2).sum() * 0.01 + (self.empty.sum() if self.empty.numel() else 0)
                + (x[:, :0] @ self.empty).sum())


def _truth(t: torch.Tensor) -> dict[str, float]:
    m = t.detach().abs().double().reshape(-1) if t.is_complex() else t.detach().double().reshape(-1)
    return {"norm": m.norm().item(), "min": m.min().item(), "max": m.max().item(), "mean": m.mean().item()}


@pytest.mark.slow
def test_complex_params_are_recorded_by_their_modulus_and_empty_ones_are_never_findings(
        output_root, make_config, capsys):
    model = Odd()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    cfg = make_config(wg_distribution=True, param_distribution=True, mv_distribution=True, ur_distribution=True,
                      ops=["norm", "min", "max", "mean", "nans"], alert={"rules": [{"rule_name": "AnomalyNan"}]})
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt)
    truth: dict[tuple[str, int], dict] = {}
    for step in range(4):
        truth[("param_origin", step)] = _truth(model.z)
        model(torch.randn(2, 4)).backward()
        truth[("grad_reduced", step)] = _truth(model.z.grad)
        opt.step()
        truth[("exp_avg", step)] = _truth(opt.state[model.z]["exp_avg"])
        opt.zero_grad()
    mon.close()
    rank0 = only_run_dir(output_root) / "rank0"
    for family in ("param_origin", "grad_reduced", "exp_avg"):
        df = read_family(rank0, family)
        z = df[df["name"].str.endswith("z")]
        assert len(z) == 4 and (z["dtype"] == "torch.complex64").all() and (z["shape"] == "[6, 3]").all()
        for _, r in z.iterrows():
            want = truth[(family, int(r["step"]))]
            for op in ("norm", "min", "max", "mean"):
                assert r[op] == pytest.approx(want[op], rel=1e-5), (family, op)
        empty = df[df["name"].str.endswith("empty")]
        assert len(empty) == 4 and (empty["shape"] == "[0, 4]").all(), "an empty param is still recorded"
        assert (empty["norm"] == 0).all() and empty["mean"].isna().all()
    capsys.readouterr()
    assert main(["anomalies", str(only_run_dir(output_root)), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["count"] == 0, doc["anomalies"][:3]
    assert not (rank0 / "anomalies.jsonl").exists() or not (rank0 / "anomalies.jsonl").read_text().strip()
    ur = read_family(rank0, "update_ratio")
    z_ratio = ur[ur["name"].str.endswith("z")]["update_ratio"]
    assert len(z_ratio) == 4 and all(math.isfinite(v) and v > 0 for v in z_ratio)
