"""Injected faults in real monitored training runs: each command's first entry names the start.

Multi-rank faults run under torch DDP on gloo (one spawn for all of them, tests/_support/real_runs.py);
the learning-rate and activation faults compare two single-process runs; the healthy run is
``trainmon demo`` for 200 steps.  The truth comes from the test's own hooks and choices, never
from trainmon.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._support import real_runs as _real
from tests.diagnosis.test_diag_alerts import _steps_of
from trainmon.cli import main
from trainmon.diagnosis.engine_buckets import load_table
from trainmon.sinks.alerts import AlertSink
from trainmon.sinks.base import SinkOptions

REPO = Path(__file__).resolve().parents[2]
ACTV = _real.activations_supported()


def _json(capsys, *argv) -> dict:
    capsys.readouterr()
    assert main(list(argv) + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _where(entry: dict) -> tuple:
    return entry["step"], entry["kind"], entry["name"], entry["rank"]


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> Path:
    return _real.spawn_faults(tmp_path_factory.mktemp("ddp_faults"))


@pytest.mark.slow
def test_nan_entering_one_ranks_input(ddp_runs, capsys):
    rank = _real.FAULT_RANK["nan_input"]
    truth = _real.truth(ddp_runs, "nan_input", rank)
    run = ddp_runs / "nan_input"
    anomalies = _json(capsys, "anomalies", str(run))["anomalies"]
    ranks = _json(capsys, "ranks", str(run))["issues"]
    if ACTV:   # the NaN is visible first where it enters: the input of the first module
        for entry in (anomalies[0], ranks[0]):
            assert _where(entry) == (_real.FAULT_STEP, "actv", "inp.input", rank)
            assert entry["phase"] == "forward" and entry["micro_step"] == 0
    else:      # else in the first grad that became NaN on that rank (backward order)
        want = (_real.FAULT_STEP, "grad_unreduced", truth["nan_grad_order"][0], rank)
        assert _where(anomalies[0]) == want and anomalies[0]["rule"] == "nonfinite"
        assert _where(ranks[0]) == want and ranks[0]["check"] == "nonfinite_some_ranks"
    assert anomalies[0]["phase"] in ("forward", "pre_reduce")
    assert all(a["step"] >= _real.FAULT_STEP for a in anomalies)


@pytest.mark.slow
def test_one_params_grad_blown_up_on_one_rank(ddp_runs, capsys):
    rank = _real.FAULT_RANK["blow_grad"]
    run = ddp_runs / "blow_grad"
    want = (_real.FAULT_STEP, "grad_unreduced", _real.BLOW_PARAM, rank)
    anomalies = _json(capsys, "anomalies", str(run))["anomalies"]
    assert _where(anomalies[0]) == want and anomalies[0]["rule"] == "spike"
    assert all(a["step"] >= _real.FAULT_STEP for a in anomalies)     # quiet before the fault
    issues = _json(capsys, "ranks", str(run))["issues"]
    assert _where(issues[0]) == want and issues[0]["check"] == "pre_reduce_outlier"


@pytest.mark.slow
def test_corrupted_post_reduce_grad_on_one_rank(ddp_runs, capsys):
    rank = _real.FAULT_RANK["corrupt_reduced"]
    run = ddp_runs / "corrupt_reduced"
    doc = _json(capsys, "ranks", str(run))
    want = (_real.FAULT_STEP, "grad_reduced", _real.CORRUPT_PARAM, rank)
    assert _where(doc["issues"][0]) == want and doc["issues"][0]["check"] == "post_reduce_mismatch"
    assert doc["by_check"]["reduce_average"] == 1
    assert all(i["step"] >= _real.FAULT_STEP for i in doc["issues"])
    # the healthy ranks' grads were really averaged: the check is not just noise
    assert doc["issues"][1]["expected"] == pytest.approx(doc["issues"][1]["value"] / 3, rel=1e-5)


def _gpt_run(out: Path, run_id: str, monkeypatch, *, group_lr: float | None = None,
             relu_layer: int | None = None, steps: int = 3, xy: bool = False) -> Path:
    from trainmon import TrainerMon, seed_all
    from trainmon.testing.tiny_gpt import TinyGPT, train

    cfg = out / f"{run_id}.json"
    cfg.write_text(json.dumps({"wg_distribution": True, "mv_distribution": True, "param_distribution": True,
                               "xy_distribution": xy, "all_xy": xy, "ops": ["norm", "mean", "min", "max"]}))
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    monkeypatch.setenv("TRAINMON_RUN_ID", run_id)
    seed_all(1234)
    model = TinyGPT()
    if relu_layer is not None:
        model.layers[relu_layer].mlp[1] = torch.nn.ReLU()
    named = list(model.named_parameters())
    if group_lr is None:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    else:
        rest = [p for n, p in named if not n.startswith("layers.1.")]
        group = [p for n, p in named if n.startswith("layers.1.")]
        opt = torch.optim.AdamW([{"params": rest}, {"params": group, "lr": group_lr}], lr=3e-3)
    with TrainerMon(cfg) as monitor:
        monitor.set_monitor(model, optimizer=opt)
        train(model, opt, steps)
    return monitor.run_dir


def test_different_learning_rate_for_one_param_group(tmp_path, monkeypatch, capsys):
    from trainmon.testing.tiny_gpt import TinyGPT

    base = _gpt_run(tmp_path, "base", monkeypatch)
    again = _gpt_run(tmp_path, "again", monkeypatch)
    target = _gpt_run(tmp_path, "target", monkeypatch, group_lr=3e-2)
    assert _json(capsys, "compare", str(base), str(again))["first_divergence"] is None   # deterministic
    doc = _json(capsys, "compare", str(base), str(target))
    d = doc["first_divergence"]
    first_of_group = next(n for n, _ in TinyGPT().named_parameters() if n.startswith("layers.1."))
    assert (d["step"], d["phase"], d["kind"], d["name"], d["rank"]) == \
        (0, "optimizer", "param_updated", first_of_group, 0)
    assert d["rel_diff"] > 1e-3 and doc["aligned_rows"] > 0


@pytest.mark.skipif(not ACTV, reason="activation monitoring (xy_distribution) has not landed yet")
def test_different_activation_function_in_one_layer(tmp_path, monkeypatch, capsys):
    base = _gpt_run(tmp_path, "base", monkeypatch, xy=True, steps=2)
    target = _gpt_run(tmp_path, "target", monkeypatch, xy=True, steps=2, relu_layer=1)
    d = _json(capsys, "compare", str(base), str(target))["first_divergence"]
    # its input (the output of mlp.0) is still identical: the output is where the runs part
    assert (d["step"], d["phase"], d["kind"], d["name"], d["rank"]) == \
        (0, "forward", "actv", "layers.1.mlp.1.output", 0)


@pytest.mark.slow
def test_healthy_200_step_demo_has_no_alerts(tmp_path, capsys):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("TRAINMON_RUN_ID", None)
    subprocess.run([sys.executable, "-m", "trainmon", "demo", "--steps", "200", "--output", str(tmp_path)],
                   env=env, check=True, capture_output=True, timeout=240)
    doc = _json(capsys, "anomalies", str(tmp_path))
    assert doc["count"] == 0, doc["anomalies"][:5]
    table = load_table(tmp_path)
    assert set(table.frame["step"]) == set(range(200)) and len(table.families) >= 6
    # the run-time rules (default settings) agree: nothing to report
    sink = AlertSink(SinkOptions(rank_dir=tmp_path / "alerts"))
    for step, rows in _steps_of(table, 0):
        sink.write(rows, step)
    sink.close()
    assert sink.count == 0


def test_run_time_alerts_of_a_real_run(tmp_path, monkeypatch, capsys):
    from trainmon import TrainerMon, seed_all
    from trainmon.testing.tiny_gpt import TinyGPT, synthetic_batches

    cfg = tmp_path / "alerts.json"
    cfg.write_text(json.dumps({"wg_distribution": True, "ops": ["norm", "mean", "nans"], "alert": {"rules": [
        {"rule_name": "AnomalyNan"}, {"rule_name": "AnomalyTurbulence", "args": {"threshold": 9}}]}}))
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    monkeypatch.setenv("TRAINMON_RUN_ID", "alerts")
    seed_all(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    target = dict(model.named_parameters())["layers.1.mlp.0.weight"]
    with TrainerMon(cfg) as monitor:
        monitor.set_monitor(model, optimizer=opt)
        for step, batch in enumerate(synthetic_batches(model.cfg, 8, 8)):
            hook = target.register_hook(lambda g: g * 1e4) if step == 6 else None
            model.loss(batch).backward()
            if hook is not None:
                hook.remove()
            opt.step()
            opt.zero_grad()
    jsonl = tmp_path / "alerts" / "rank0" / "anomalies.jsonl"
    lines = [json.loads(x) for x in jsonl.read_text().splitlines()]
    assert (lines[0]["step"], lines[0]["kind"], lines[0]["name"], lines[0]["rule"]) == \
        (6, "grad_unreduced", "layers.1.mlp.0.weight", "spike")
    doc = _json(capsys, "anomalies", str(tmp_path / "alerts"))
    assert _where(doc["anomalies"][0]) == (6, "grad_unreduced", "layers.1.mlp.0.weight", 0)
