"""Batched activations: values as they were at hook time despite later in-place ops, the bound on
the memory the pending batch holds, and the Python-call budget per activation row."""

from __future__ import annotations

import logging
import sys

import pytest
import torch
import torch.nn as nn

from tests._support.runs import only_run_dir, read_family, reference_stats
from trainmon import TrainerMon
from trainmon.collectors.activations import ActivationCollector

OPS = ["norm", "mean", "min", "max"]


class AddOne(nn.Module):
    def __init__(self, when=lambda: True):
        super().__init__()
        self.when = when

    def forward(self, x):
        if self.when():
            x.add_(1)  # changes the previous module's output in place
        return x * 2


def _model(when=lambda: True):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(inplace=True), nn.Linear(8, 8), AddOne(when), nn.Linear(8, 3))


def _run(model, make_config, steps=3, truth=None):
    mon = TrainerMon(make_config(xy_distribution=True, all_xy=True, forward_only=True, ops=OPS))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon.set_monitor(model, optimizer=opt)
    for step in range(steps):
        if truth is not None:
            truth["step"] = step
        model(torch.randn(4, 6, generator=torch.Generator().manual_seed(step))).sum().backward()
        opt.step()
        opt.zero_grad()
    mon.close()


def _truth_hooks(model, truth):
    """float64 stats of every output taken in a forward hook: the values at hook time."""

    def see(name, out):
        truth[(truth["step"], f"{name}.output")] = reference_stats(out)

    for name, m in model.named_modules():
        if name:
            m.register_forward_hook(lambda mod, a, out, n=name: see(n, out))


def test_in_place_change_before_the_batch_keeps_hook_time_values(output_root, make_config):
    model, truth = _model(), {"step": 0}
    _truth_hooks(model, truth)  # fires right after the monitor's hook, before the in-place ops
    _run(model, make_config, truth=truth)
    actv = read_family(only_run_dir(output_root) / "rank0", "actv")
    outs = actv[actv.name.str.endswith(".output")]
    assert sorted(set(outs.step)) == [0, 1, 2]
    for row in outs.itertuples():
        want = truth[(row.step, row.name)]
        for op in OPS:
            assert getattr(row, op) == pytest.approx(want[op], rel=1e-5, abs=1e-7), (row.step, row.name, op)
    assert len(outs) == 3 * 5  # every output of every step is there


def test_data_dependent_in_place_change_drops_the_row_not_the_truth(output_root, make_config, caplog):
    steps_seen = {"n": 0}

    def when():
        steps_seen["n"] += 1
        return steps_seen["n"] == 3  # only on the third forward: the slot was learned safe

    model, truth = _model(when), {"step": 0}
    _truth_hooks(model, truth)
    with caplog.at_level(logging.WARNING):
        _run(model, make_config, truth=truth)
    actv = read_family(only_run_dir(output_root) / "rank0", "actv")
    lost = actv[(actv.step == 2) & (actv.name == "2.output")]
    assert lost.empty  # changed in place before its batch ran: not recorded with wrong values
    assert "changed in place before their batch" in caplog.text
    for row in actv[actv.name.str.endswith(".output")].itertuples():
        want = truth[(row.step, row.name)]
        assert row.max == pytest.approx(want["max"], rel=1e-5), (row.step, row.name)


def test_pending_batch_memory_stays_under_the_bound(output_root, make_config, monkeypatch):
    bound = 3000
    monkeypatch.setenv("TRAINMON_ACTV_BATCH_BYTES", str(bound))
    peak = [0]
    enqueue = ActivationCollector._enqueue

    def watched(self, *a):
        enqueue(self, *a)
        # bytes of the distinct storages the pending batch references right now
        held = {e[3].untyped_storage().data_ptr(): e[3].untyped_storage().nbytes() for e in self._batch}
        peak[0] = max(peak[0], sum(held.values()))

    monkeypatch.setattr(ActivationCollector, "_enqueue", watched)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])  # 4*64*4 = 1 KiB per activation
    mon = TrainerMon(make_config(xy_distribution=True, all_xy=True, ops=OPS))
    mon.set_monitor(model)
    for _ in range(3):
        model(torch.randn(4, 64)).sum().backward()
        model.zero_grad()
    mon.close()
    assert 0 < peak[0] <= bound
    assert not read_family(only_run_dir(output_root) / "rank0", "actv").empty


def _calls_of_one_step(model, monitored, make_config):
    """Python 'call' events on this thread over one forward+backward, after two warm-up steps
    (the first collected step learns which slots are batchable)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = TrainerMon(make_config(xy_distribution=True, all_xy=True, ops=OPS)) if monitored else None
    if mon:
        mon.set_monitor(model, optimizer=opt)
    x = torch.randn(2, 4)
    for _ in range(2):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    calls = [0]

    def count(frame, event, arg):
        if event == "call":
            calls[0] += 1

    sys.setprofile(count)
    try:
        model(x).sum().backward()
    finally:
        sys.setprofile(None)
    opt.step()
    opt.zero_grad()
    if mon:
        mon.close()
    return calls[0]


def _calls_per_row(n, make_config):
    """trainmon's Python calls per activation row: monitored minus unmonitored (paired, as in
    benchmarks/host_cost.py), over the rows: input and output of every Linear, forward and backward."""
    base = _calls_of_one_step(nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)]), False, make_config)
    monitored = _calls_of_one_step(nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)]), True, make_config)
    return (monitored - base) / (4 * n)


@pytest.mark.slow
@pytest.mark.parametrize("seam", [False, True])
@pytest.mark.parametrize("n", [64, 512])
def test_python_calls_per_activation_row(output_root, make_config, monkeypatch, n, seam):
    if seam:
        monkeypatch.setenv("TRAINMON_DEVICE_PATH", "1")
    per_row = _calls_per_row(n, make_config)
    print(f"n={n} seam={seam}: {per_row:.2f} Python calls per activation row")
    # Target (issue 31): <= 4.  Today ~9: torch's own hook registration (register_hook, its handle,
    # is_dynamo_compiling: ~3.7 a row) and the guard's gated wrapper (1.25) are most of what is left.
    assert per_row <= 10
