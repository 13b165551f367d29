"""Deterministic host-cost counters for the budget tests (``tests/test_host_budget.py``).

One monitored training step against the same step of an identical unmonitored model: Python
function frames on this thread (``sys.setprofile`` 'call' events; list comprehensions count one
frame each, generator expressions one per item), non-view aten ops, and young-generation garbage
collections, each monitored minus unmonitored.  ``benchmarks/host_cost.py`` measures the same
things with timings; these are the exact parts, for tests.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from trainmon.testing.gc_counter import young_collections
from trainmon.testing.op_counter import OpCounter

OPS = ["norm", "mean", "min", "max", "nans"]  # the shipped configs' list
WG = {"wg_distribution": True}
ALL_ON = {"wg_distribution": True, "mv_distribution": True, "param_distribution": True}
ALL_ON_UR = {**ALL_ON, "ur_distribution": True}  # + update_ratio: the seventh weight family
# (config, weight rows per param): grads un/reduced; + param origin/updated, 2 moments; + update_ratio
WEIGHT_CONFIGS = {"wg": (WG, 2), "all-on": (ALL_ON, 6), "all-on+ur": (ALL_ON_UR, 7)}
# Python frames per weight-family row (the target: <= 0.5, the baseline 10-20).
WEIGHT_FRAMES_PER_ROW = 0.5


@dataclass(frozen=True)
class StepCost:
    frames: int
    aten_ops: int
    gen0_collections: int
    weight_rows: int
    activation_rows: int


def chain(n_tensors: int, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """N parameter tensors in N/2 tiny Linear layers (their arithmetic is nothing: what is left
    is per-tensor bookkeeping), trained with Adam."""
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(max(1, n_tensors // 2))])
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def frames(fn: Callable[[], None]) -> int:
    count = [0]

    def profile(_frame, event, _arg):
        if event == "call":
            count[0] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count[0]


def aten_ops(fn: Callable[[], None]) -> int:
    with OpCounter() as counter:
        fn()
    return counter.ops


def step_cost(tmp: Path, config: dict, n_tensors: int, monkeypatch) -> StepCost:
    """The monitor's cost of one step of ``chain(n_tensors)`` under ``config`` (after warm-up)."""
    from trainmon import TrainerMon

    tmp.mkdir(parents=True, exist_ok=True)
    cfg = tmp / "config.json"
    cfg.write_text(json.dumps({"ops": OPS, "step_count_per_record": 1000, **config}))
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp / "out"))
    base_model, base_opt = chain(n_tensors)
    model, opt = chain(n_tensors)
    monitor = TrainerMon(str(cfg)).set_monitor(model, optimizer=opt)
    x = torch.randn(8, 4)
    try:
        for _ in range(3):  # warm-up: kernels built, layouts made
            train_step(base_model, base_opt, x)
            train_step(model, opt, x)

        def base() -> None:
            train_step(base_model, base_opt, x)

        def mon() -> None:
            train_step(model, opt, x)

        cost = (
            frames(mon) - frames(base),
            aten_ops(mon) - aten_ops(base),
            young_collections(mon) - young_collections(base),
        )
    finally:
        monitor.close()
    weight, activation = _rows_of_last_step(tmp / "out")
    return StepCost(*cost, weight, activation)


def _rows_of_last_step(root: Path) -> tuple[int, int]:
    """(weight rows, activation rows) of the last recorded step, read from the CSV files."""
    import pandas as pd

    weight = activation = 0
    for path in root.rglob("*.csv"):
        frame = pd.read_csv(path)
        if "step" not in frame or frame.empty:
            continue
        last = int(frame["step"].max())
        n = int((frame["step"] == last).sum())
        family = path.name.rsplit("_", 1)[0]
        if family in ("actv", "actv_grad"):
            activation += n
        elif family not in ("steps", "loss"):
            weight += n
    return weight, activation


def seam(monkeypatch, on: bool) -> None:
    if on:
        monkeypatch.setenv("TRAINMON_DEVICE_PATH", "1")
    else:
        monkeypatch.delenv("TRAINMON_DEVICE_PATH", raising=False)
    os.environ.pop("TRAINMON_FUSED_CPU", None)
