"""Host-cost budgets per recorded row, as exact counts (issue: host cost independent of the
tensor count).  What a monitored step adds on the training thread, divided by the rows it
records, must not grow with the number of tensors: Python frames per weight-family row stay
under half a frame (a family is one multi-tensor call, not a Python call per tensor), at every
model size, on the CPU path and through the accelerator path's seam.  Timings live in
``benchmarks/host_cost.py``; these are the deterministic parts."""

from __future__ import annotations

import pytest

from tests._support.host_budget import ALL_ON, WEIGHT_CONFIGS, WEIGHT_FRAMES_PER_ROW, seam, step_cost

CONFIGS = WEIGHT_CONFIGS


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("n_tensors", [64, pytest.param(512, marks=pytest.mark.slow)])
@pytest.mark.parametrize("path", ["cpu", "seam"])
def test_weight_rows_cost_a_constant_number_of_python_frames(tmp_path, monkeypatch, config, n_tensors, path):
    seam(monkeypatch, path == "seam")
    settings, rows_per_param = CONFIGS[config]
    cost = step_cost(tmp_path, settings, n_tensors, monkeypatch)
    assert cost.weight_rows == rows_per_param * n_tensors
    assert cost.frames / cost.weight_rows <= WEIGHT_FRAMES_PER_ROW, cost


@pytest.mark.slow
def test_weight_rows_frames_do_not_grow_with_the_model(tmp_path, monkeypatch):
    """The whole step's added frames are (nearly) the same for 64 and 512 tensors."""
    seam(monkeypatch, False)
    small = step_cost(tmp_path / "64", ALL_ON, 64, monkeypatch)
    large = step_cost(tmp_path / "512", ALL_ON, 512, monkeypatch)
    assert large.frames <= small.frames + 64, (small, large)
