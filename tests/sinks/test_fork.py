"""``os.fork`` after ``set_monitor``: the child records nothing and never touches the parent's
writer thread, locks or files; the parent's files hold exactly the parent's rows."""

from __future__ import annotations

import os
import signal
import time

import pandas as pd
import pytest
import torch

from tests._support.runs import only_run_dir
from trainmon import TrainerMon
from trainmon.testing.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches

STEPS = 8
FORK_AFTER = (1, 2, 3, 4, 5)  # right after opt.step(): the writer thread is writing that step
PER_PARAM = ("grad_unreduced", "grad_reduced", "param_origin", "param_updated", "exp_avg", "exp_avg_sq", "update_ratio")


def _wait_or_kill(pid: int, deadline_s: float = 60.0) -> int:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung (deadlock on the parent's writer or lock?)")


def _child_trains(model, opt, batches, monitor) -> None:
    """The child runs training steps with the inherited monitor and exits; never returns."""
    code = 1
    try:
        for _ in range(2):
            model.loss(next(batches)).backward()
            opt.step()
            opt.zero_grad()
        monitor.record_loss(torch.tensor(1.0))
        monitor.close()
        code = 0
    finally:
        os._exit(code)


def _read(rank_dir, family: str) -> pd.DataFrame:
    files = sorted(rank_dir.glob(f"{family}_[0-9]*.csv"))
    return pd.concat([pd.read_csv(p) for p in files], ignore_index=True)


def _train_forking(cfg, model, opt, batches) -> None:
    """Train STEPS monitored steps, forking a child that trains on after each step in FORK_AFTER."""
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    for step in range(STEPS):
        model.loss(next(batches)).backward()
        opt.step()
        opt.zero_grad()
        if step in FORK_AFTER:
            pid = os.fork()
            if pid == 0:
                _child_trains(model, opt, batches, monitor)
            assert _wait_or_kill(pid) == 0
    monitor.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("window", [1, 4])
def test_forked_children_record_nothing_and_parent_rows_are_exact(output_root, make_config, window):
    cfg = make_config(
        wg_distribution=True,
        mv_distribution=True,
        param_distribution=True,
        ur_distribution=True,
        xy_distribution=True,
        all_xy=True,
        ops=["norm", "mean", "max"],
        step_count_per_record=window,
    )
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=2))
    opt = torch.optim.Adam(model.parameters())
    batches = iter(synthetic_batches(model.cfg, 4, 1000))
    _train_forking(cfg, model, opt, batches)

    rank0 = only_run_dir(output_root) / "rank0"
    n_params = sum(1 for p in model.parameters() if p.requires_grad)
    for family in PER_PARAM:
        df = _read(rank0, family)
        assert not df.duplicated(["name", "step"]).any(), family
        assert sorted(df["step"].unique()) == list(range(STEPS)), family  # the parent kept recording
        assert (df.groupby("step").size() == n_params).all(), family
    for family in ("actv", "actv_grad"):
        df = _read(rank0, family)
        assert not df.duplicated(["name", "step", "micro_step"]).any(), family
        per_step = df.groupby("step").size()
        assert sorted(per_step.index) == list(range(STEPS)), family
        assert (per_step == per_step.iloc[0]).all(), family
    assert not list(rank0.glob(".*.tmp"))  # no child left a half-made file


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_forked_child_of_a_dynamic_monitor_decides_and_records_nothing(output_root, make_config, monkeypatch):
    monkeypatch.setenv("DYNAMIC_MONITOR", "true")
    cfg = make_config(dynamic_on=True, wg_distribution=True, param_distribution=True, ops=["norm"])
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=1))
    opt = torch.optim.Adam(model.parameters())
    batches = iter(synthetic_batches(model.cfg, 4, 1000))
    _train_forking(cfg, model, opt, batches)
    rank0 = only_run_dir(output_root) / "rank0"
    n_params = sum(1 for p in model.parameters() if p.requires_grad)
    for family in ("grad_unreduced", "param_origin"):
        df = _read(rank0, family)
        assert not df.duplicated(["name", "step"]).any(), family
        assert sorted(df["step"].unique()) == list(range(STEPS)), family
        assert (df.groupby("step").size() == n_params).all(), family
