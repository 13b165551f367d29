"""No host sync on the accelerator path, counting the syncs made inside kernels too.

``OpCounter`` (a dispatch mode) sees only the ops trainmon calls, so it missed that
``segment_reduce`` checks its lengths with two ``item()`` calls per call unless ``unsafe=True``:
a GPU step of the all-on + xy config synced ~256 times in the hooks.  Here the profiler counts
every ``_local_scalar_dense`` (nested ones included) of a monitored step through the seam,
against the same step unmonitored (Adam's own step counters sync on the CPU)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from trainmon import TrainerMon
from trainmon.testing.op_counter import host_syncs

ALL_ON_XY = {"wg_distribution": True, "mv_distribution": True, "param_distribution": True,
             "xy_distribution": True, "all_xy": True, "ops": ["norm", "mean", "min", "max", "nans", "infs", "zeros"]}


def _model(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(16)])  # 32 small tensors: segment batches
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _step(model, opt, x) -> None:
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.slow
def test_a_monitored_step_through_the_seam_adds_no_host_sync_even_inside_kernels(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINMON_DEVICE_PATH", "1")
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    config = tmp_path / "config.json"
    config.write_text(json.dumps(ALL_ON_XY))
    model, opt = _model()
    plain, plain_opt = _model()
    monitor = TrainerMon(config).set_monitor(model, optimizer=opt)
    x = torch.randn(8, 4)
    for _ in range(3):  # layouts and plans built, first sights over
        _step(model, opt, x)
        _step(plain, plain_opt, x)
    monitored = host_syncs(lambda: _step(model, opt, x))
    unmonitored = host_syncs(lambda: _step(plain, plain_opt, x))
    monitor.close()
    assert unmonitored > 0  # the counter sees syncs inside kernels: Adam's step counters
    assert monitored == unmonitored
    rows = sum(1 for p in (tmp_path / "out").rglob("*.csv") for _ in p.open())
    assert rows > 5 * 200  # every family was recorded (not a step that recorded nothing)
