"""run.json says which statistics path produced the numbers, per device type."""
from __future__ import annotations

import json

import pytest
import torch

from tests._support.runs import only_run_dir, read_family
from trainmon import TrainerMon


@pytest.mark.slow   # a monitored run per case
@pytest.mark.parametrize(("env", "want"), [({"TRAINMON_DEVICE_PATH": "1"}, "device"),
                                           ({"TRAINMON_FUSED_CPU": "0"}, "cpu-eager"),
                                           ({"TRAINMON_FUSED_CPU": "1"}, "cpu-fused")])
def test_run_json_records_the_stats_path_from_the_first_finished_step(output_root, make_config, monkeypatch,
                                                                      env, want):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(str(make_config(wg_distribution=True, ops=["norm"])))
    mon.set_monitor(model, optimizer=opt)
    run = only_run_dir(output_root)
    assert "stats_path" not in json.loads((run / "run.json").read_text())   # nothing seen yet
    for _ in range(2):
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    mon.close()
    meta = json.loads((run / "run.json").read_text())
    assert meta["stats_path"] == {"cpu": want} and meta["run_id"] == run.name
    assert sorted(p.name for p in run.iterdir()) == ["rank0", "run.json"]    # no temporary left
    assert len(read_family(run / "rank0", "grad_reduced")) == 4
