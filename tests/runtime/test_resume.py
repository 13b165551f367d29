"""A resumed run reusing ``TRAINMON_RUN_ID`` continues the step numbering from what is on disk."""

from __future__ import annotations

import logging

import pandas as pd
import pytest
import torch
import torch.nn as nn

from trainmon import TrainerMon
from trainmon.output.load import load_run
from trainmon.runtime.run_dir import highest_recorded_step


def _train(cfg, steps: int, **set_monitor_kwargs) -> int:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters())
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt, **set_monitor_kwargs)
    first = monitor.current_step
    for _ in range(steps):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    monitor.close()
    return first


def _resume_warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "continuing the step numbering" in r.getMessage()
    ]


@pytest.mark.slow
@pytest.mark.parametrize("fmt,window", [("csv", 1), ("csv", 4), ("parquet", 4)])
def test_two_runs_in_one_run_id_continue_the_steps(output_root, make_config, monkeypatch, caplog, fmt, window):
    pytest.importorskip("pyarrow") if fmt == "parquet" else None
    monkeypatch.setenv("TRAINMON_RUN_ID", "resumed")
    cfg = make_config(
        wg_distribution=True, param_distribution=True, ops=["norm", "max"], format=[fmt], step_count_per_record=window
    )
    caplog.set_level(logging.WARNING, logger="trainmon")
    assert _train(cfg, 6) == 0
    assert _resume_warnings(caplog) == []
    assert highest_recorded_step(output_root / "resumed" / "rank0") == 5
    assert _train(cfg, 3) == 6  # no start_iteration: continues after step 5
    warned = _resume_warnings(caplog)
    assert len(warned) == 1 and "at 6" in warned[0] and "start_iteration=N" in warned[0]
    df = load_run(output_root / "resumed", families=["grad_unreduced", "param_origin"], engine="pandas")
    assert not df.duplicated(["family", "name", "step"]).any()
    assert sorted(df["step"].unique()) == list(range(9))
    assert (df.groupby(["family", "step"]).size() == 4).all()  # 4 params per step


@pytest.mark.slow
def test_an_explicit_start_iteration_overlapping_steps_on_disk_is_warned(output_root, make_config, monkeypatch, caplog):
    monkeypatch.setenv("TRAINMON_RUN_ID", "resumed")
    cfg = make_config(wg_distribution=True, ops=["norm"])
    _train(cfg, 5)
    caplog.set_level(logging.WARNING, logger="trainmon")
    assert _train(cfg, 2, start_iteration=3) == 3
    overlap = [r.getMessage() for r in caplog.records if "overlaps steps 3..4" in r.getMessage()]
    assert len(overlap) == 1 and "start_iteration=3" in overlap[0]
    caplog.clear()
    assert _train(cfg, 1, start_iteration=10) == 10  # past what is on disk: no warning
    assert not [r for r in caplog.records if "overlaps" in r.getMessage()]
    df = pd.concat(pd.read_csv(p) for p in (output_root / "resumed" / "rank0").glob("grad_unreduced_*.csv"))
    assert sorted(df["step"].unique()) == [0, 1, 2, 3, 4, 10]


def test_a_fresh_run_starts_at_zero_and_a_csv_tail_gives_the_last_step(tmp_path):
    assert highest_recorded_step(tmp_path / "missing") is None
    rank = tmp_path / "rank0"
    rank.mkdir()
    assert highest_recorded_step(rank) is None
    (rank / "actv_0-9.csv").write_text(
        'vpp_stage,name,step,norm,shape,dtype\n0,"a,\nb",3,1.0,"[2, 2]",torch.float32\n'
        '0,"x\n0,y,99,",7,2.0,"[2]",torch.float32\n'
    )
    (rank / "actv_0-0.csv").write_text("vpp_stage,name,step,norm,shape,dtype\n")
    assert highest_recorded_step(rank) == 7  # only the last window is read; a newline in a name is no row
