"""Host-cost budgets per activation row, as exact counts (issue: host cost independent of the
tensor count).  A monitored step's Python frames on the training thread (monitored minus an
identical unmonitored model, ``tests/_support/host_budget.py``), over the activation rows it
records (inputs, outputs and their grads of every module, ``xy_distribution``), stay at or under
4 at every model size, on the CPU path and through the accelerator path's seam.  torch's own
module-hook machinery (``_call_impl``'s hook path) counts against the budget too.  Timings live in
``benchmarks/host_cost.py``; these are the deterministic parts."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from tests._support.host_budget import OPS, frames, seam, step_cost
from tests._support.runs import only_run_dir, read_family
from trainmon import TrainerMon

XY = {"xy_distribution": True, "all_xy": True}

# Python frames per activation row (the target: <= 4; 9-10 before batching's hot paths
# were inlined).
ACTIVATION_FRAMES_PER_ROW = 4


def _activation_rows(n_tensors: int) -> int:
    # n/2 Linear layers x (input, output, input grad, output grad); the model's input needs no grad
    return 4 * (n_tensors // 2) - 1


@pytest.mark.parametrize("n_tensors", [64, pytest.param(512, marks=pytest.mark.slow)])
@pytest.mark.parametrize("path", ["cpu", "seam"])
def test_activation_rows_cost_at_most_four_python_frames(tmp_path, monkeypatch, n_tensors, path):
    seam(monkeypatch, path == "seam")
    cost = step_cost(tmp_path, XY, n_tensors, monkeypatch)
    assert cost.activation_rows == _activation_rows(n_tensors)
    assert cost.weight_rows == 0
    assert cost.frames / cost.activation_rows <= ACTIVATION_FRAMES_PER_ROW, cost


@pytest.mark.slow
def test_activation_frames_per_row_do_not_grow_with_the_model(tmp_path, monkeypatch):
    seam(monkeypatch, False)
    small = step_cost(tmp_path / "64", XY, 64, monkeypatch)
    large = step_cost(tmp_path / "512", XY, 512, monkeypatch)
    assert large.frames / large.activation_rows <= small.frames / small.activation_rows, (small, large)


class Fan(nn.Module):
    """Returns a tuple of three tensors (and a None, which names skip)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple:
        y = self.lin(x)
        return y, y * 2, y.tanh(), None


class FanChain(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.fans = nn.ModuleList(Fan() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for fan in self.fans:
            a, b, c, _ = fan(x)
            x = a + b + c
        return x


def test_tuple_outputs_cost_no_python_frame_per_tensor(tmp_path, monkeypatch, make_config):
    """A module returning a tuple: its outputs are recorded without a Python call per tensor."""
    n = 16
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    seam(monkeypatch, False)
    torch.manual_seed(0)
    base, model = FanChain(n), FanChain(n)
    cfg = tmp_path / "c.json"
    # only the Fans: their Linear children would add plain single-tensor rows
    cfg.write_text(json.dumps({"xy_distribution": True, "targets": [f"fans.{i}" for i in range(n)], "ops": OPS}))
    monitor = TrainerMon(str(cfg)).set_monitor(model)
    x = torch.randn(8, 4, requires_grad=True)

    def step(m: nn.Module) -> None:
        m(x).sum().backward()
        m.zero_grad()
        if m is model:
            monitor.step()

    for _ in range(3):
        step(base)
        step(model)
    added = frames(lambda: step(model)) - frames(lambda: step(base))
    monitor.close()
    rank0 = only_run_dir(tmp_path / "out") / "rank0"
    actv, grad = read_family(rank0, "actv"), read_family(rank0, "actv_grad")
    last = actv.step.max()
    rows = (actv.step == last).sum() + (grad.step == last).sum()
    assert rows == n * 8  # input + 3 outputs, and their grads
    assert set(actv[actv.step == last].name) >= {"fans.0.output.0", "fans.0.output.1", "fans.0.output.2"}
    assert added / rows <= ACTIVATION_FRAMES_PER_ROW, (added, rows)


# Python frames of one batch flush beyond its rows' own (29 before the flush's common case was
# made lean: a pending entry per flush, three dict/list passes more, a frame per kernel array).
FRAMES_PER_FLUSH = 16


def test_a_batch_flush_costs_a_bounded_number_of_python_frames(tmp_path, monkeypatch):
    """Medium activations (nanoGPT's 0.4-1.5 MB) fill the 2 MiB batch every two or three rows, so
    a flush's fixed cost counts per row there.  Batches of two tensors force a flush every two
    rows of the chain; the frames they add over the default batches, per flush, stay bounded."""
    from tests._support.host_budget import chain, train_step
    from trainmon.collectors.activations import ActivationCollector

    seam(monkeypatch, False)
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"ops": OPS, "step_count_per_record": 1000, **XY}))
    x = torch.randn(8, 4)

    def cost(max_tensors: int) -> tuple[int, int]:
        """(frames of a monitored step, flushes of a non-empty batch in it)"""
        monkeypatch.setenv("TRAINMON_ACTV_BATCH_TENSORS", str(max_tensors))
        monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / f"out{max_tensors}"))
        model, opt = chain(64)
        monitor = TrainerMon(str(cfg)).set_monitor(model, optimizer=opt)
        try:
            for _ in range(3):
                train_step(model, opt, x)
            flushes = []
            original = ActivationCollector._flush

            def counted(self) -> None:
                flushes.append(len(self._batch))
                original(self)

            monkeypatch.setattr(ActivationCollector, "_flush", counted)
            train_step(model, opt, x)
            monkeypatch.setattr(ActivationCollector, "_flush", original)
            return frames(lambda: train_step(model, opt, x)), sum(1 for n in flushes if n)
        finally:
            monitor.close()

    default_frames, default_flushes = cost(256)
    small_frames, small_flushes = cost(2)
    assert small_flushes >= 60 and default_flushes <= 4, (small_flushes, default_flushes)
    per_flush = (small_frames - default_frames) / (small_flushes - default_flushes)
    assert per_flush <= FRAMES_PER_FLUSH, (per_flush, small_flushes, default_flushes)
