"""``param_changed`` and the spike rule's warm-up report (issue 34, item 21).

A real run in which one weight is multiplied x1e4 between steps 3 and 4, outside the optimizer
(what a bad checkpoint load or code writing weights does): the first finding names step 4 and
that weight, in both engines, and the report says which steps the spike rule could not judge.
"""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from tests._support.runs import ENGINES
from trainmon.cli import main
from trainmon.diagnosis.engine_buckets import load_table
from trainmon.diagnosis.scan import param_changes

CONFIG = {"wg_distribution": True, "mv_distribution": True, "param_distribution": True,
          "ops": ["norm", "mean", "min", "max", "nans", "infs"]}


def _run(tmp_path, monkeypatch, *, corrupt: str | None, steps: int = 8):
    from trainmon import TrainerMon, seed_all

    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(CONFIG))
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    monkeypatch.setenv("TRAINMON_RUN_ID", "corrupt" if corrupt else "healthy")
    seed_all(0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    params = dict(model.named_parameters())
    with TrainerMon(cfg) as monitor:
        monitor.set_monitor(model, optimizer=opt)
        for step in range(steps):
            if corrupt is not None and step == 4:
                with torch.no_grad():                      # between step 3's update and step 4
                    params[corrupt].mul_(1e4)
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
    return monitor.run_dir


def _json(capsys, *argv) -> dict:
    capsys.readouterr()
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_a_weight_changed_between_steps_is_found_at_the_step_and_layer(tmp_path, monkeypatch, capsys):
    run = _run(tmp_path, monkeypatch, corrupt="2.weight")
    docs = {e: _json(capsys, "anomalies", str(run), "--engine", e) for e in ENGINES}
    assert all(doc == docs["memory"] for doc in docs.values())
    first = docs["memory"]["anomalies"][0]
    assert (first["step"], first["kind"], first["name"], first["rule"]) == (4, "param_origin", "2.weight",
                                                                            "param_changed")
    # the value and its baseline: the recorded stat at step 4's start and at step 3's end
    table = load_table(run)
    rows = table.frame.set_index(["family", "name", "step"])
    op = first["op"]
    assert first["value"] == rows.loc[("param_origin", "2.weight", 4), op]
    assert first["baseline"] == rows.loc[("param_updated", "2.weight", 3), op]
    assert first["value"] != first["baseline"]
    # the spike rule could not judge step 4 (each series has 4 earlier values there): said so
    assert docs["memory"]["spike_unjudged"]["steps"] == [[0, 4]]
    changed = [a for a in docs["memory"]["anomalies"] if a["rule"] == "param_changed"]
    assert [(a["step"], a["name"]) for a in changed] == [(4, "2.weight")]
    capsys.readouterr()
    assert main(["anomalies", str(run)]) == 0
    assert "spike rule: " in (text := capsys.readouterr().out) and "at steps 0-4" in text


@pytest.mark.slow
def test_healthy_runs_param_updated_and_next_param_origin_are_bit_equal(tmp_path, monkeypatch):
    run = _run(tmp_path, monkeypatch, corrupt=None)
    table = load_table(run)
    up, origin = table.family("param_updated"), table.family("param_origin")
    both = up.assign(step=up["step"] + 1).merge(origin, on=["name", "step"], suffixes=("_u", "_o"))
    assert len(both) == 6 * 7                         # 3 layers x (weight, bias), steps 1-7
    for op in CONFIG["ops"]:                              # same tensor, same float64 arithmetic
        assert (both[f"{op}_u"].to_numpy() == both[f"{op}_o"].to_numpy()).all(), op
    assert param_changes(table).empty
