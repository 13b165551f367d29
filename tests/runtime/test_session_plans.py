"""The session's step plans: which collectors' step methods run at each boundary is worked out
once (``Session._plan``), without the methods a collector says do nothing under its config
(``Collector.quiet_hooks``), and worked out again when a collector is switched off."""

from __future__ import annotations

import json
import logging

import torch
import torch.nn as nn

from tests._support.runs import only_run_dir, read_family
from trainmon import TrainerMon
from trainmon.collectors.optimizer_state import OptimizerStateCollector
from trainmon.collectors.params import ParamCollector
from trainmon.collectors.weight_grads import WeightGradCollector

CONFIG = {"ops": ["norm"], "wg_distribution": True, "mv_distribution": True, "param_distribution": True}


def _run(tmp_path, monkeypatch, steps: int = 3) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CONFIG, "step_count_per_record": 100}))
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    monitor = TrainerMon(str(path)).set_monitor(model, optimizer=opt)
    for _ in range(steps):
        model(torch.randn(3, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    monitor.close()


def _steps(tmp_path, family: str) -> list[int]:
    return sorted(set(read_family(only_run_dir(tmp_path / "out") / "rank0", family)["step"]))


def test_a_quiet_step_method_is_never_called_and_the_others_every_step(tmp_path, monkeypatch):
    calls = {"weight_grads": 0, "params": 0}
    wg_end, params_end = WeightGradCollector.on_step_end, ParamCollector.on_step_end

    def counted_wg(self):
        calls["weight_grads"] += 1
        wg_end(self)

    def counted_params(self):
        calls["params"] += 1
        params_end(self)

    monkeypatch.setattr(WeightGradCollector, "on_step_end", counted_wg)
    monkeypatch.setattr(ParamCollector, "on_step_end", counted_params)
    _run(tmp_path, monkeypatch)
    # plain torch reads grad_reduced at step entry: its step-end check has nothing to check
    assert calls == {"weight_grads": 0, "params": 3}
    assert _steps(tmp_path, "param_updated") == [0, 1, 2]


def test_a_collector_that_fails_is_switched_off_and_the_plan_goes_on_without_it(tmp_path, monkeypatch, caplog):
    calls = []
    original = OptimizerStateCollector.on_step_end

    def fails_at_step_1(self):
        calls.append(self.ctx.clock.step)
        if self.ctx.clock.step == 1:
            raise RuntimeError("boom")
        original(self)

    monkeypatch.setattr(OptimizerStateCollector, "on_step_end", fails_at_step_1)
    with caplog.at_level(logging.WARNING):
        _run(tmp_path, monkeypatch, steps=4)
    assert calls == [0, 1]  # never called again once switched off
    failed = [r.getMessage() for r in caplog.records if "switched off" in r.getMessage()]
    assert failed == ["trainmon: collector 'optimizer_state' failed at step 1 and is switched off; training continues"]
    assert _steps(tmp_path, "exp_avg") == [0]
    assert _steps(tmp_path, "grad_reduced") == [0, 1, 2, 3]  # the others go on
    assert _steps(tmp_path, "param_updated") == [0, 1, 2, 3]
