"""actv over a training loop's life: evaluation passes (no_grad, inference_mode) are no training
micro-batches, and a forward that raises leaves no rows.  Every written row is checked against
float64 stats the test takes with its own hooks from the very tensors of that step's real
forwards, and the (step, micro_step, name) keys must be exactly those forwards'."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

from tests._support.runs import only_run_dir, read_family, reference_stats
from trainmon import TrainerMon
from trainmon.output.layout import rank_dir_name

OPS = ["norm", "mean", "min", "max"]
D = 8


class Flaky(nn.Module):
    """A module in the middle of the model that raises while ``armed`` (bad data, OOM...)."""

    def __init__(self):
        super().__init__()
        self.armed = False

    def forward(self, x):
        if self.armed:
            raise RuntimeError("bad batch")
        return x * 2.0


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D, D)
        self.flaky = Flaky()
        self.fc2 = nn.Linear(D, 1)

    def forward(self, x):
        return self.fc2(self.flaky(torch.relu(self.fc1(x))))


class Truth:
    """actv stats of the forwards that returned and ran with grad on, by (step, micro, name).
    A forward's rows are kept only when the model's forward returns."""

    def __init__(self, model: Net):
        self.rows: dict[tuple[int, int, str], dict] = {}
        self.step = 0
        self.micro = 0
        self._open: list[tuple[str, dict]] = []
        for name in ("fc1", "flaky", "fc2"):
            m = getattr(model, name)
            m.register_forward_pre_hook(lambda mod, a, n=name: self._see(f"{n}.input", a[0]))
            m.register_forward_hook(lambda mod, a, out, n=name: self._see(f"{n}.output", out))
        model.register_forward_pre_hook(lambda *_: self._open.clear())
        model.register_forward_hook(lambda *_: self._commit())

    def _see(self, name, t):
        if torch.is_grad_enabled():
            self._open.append((name, reference_stats(t)))

    def _commit(self):
        if torch.is_grad_enabled():
            for name, stats in self._open:
                self.rows[(self.step, self.micro, name)] = stats
            self.micro += 1
        self._open.clear()

    def next_step(self):
        self.step += 1
        self.micro = 0


def _monitor(make_config, model, optimizer):
    monitor = TrainerMon(make_config(xy_distribution=True, all_xy=True, ops=OPS))
    monitor.set_monitor(model, optimizer=optimizer)
    return monitor


def _actv(output_root):
    return read_family(only_run_dir(output_root) / rank_dir_name(0), "actv")


def assert_rows_are_the_truth(df, truth: Truth):
    keys = list(zip(df["step"], df["micro_step"], df["name"]))
    assert len(keys) == len(set(keys)), "a (step, micro_step, name) row written twice"
    assert sorted(keys) == sorted(truth.rows), sorted(set(keys) ^ set(truth.rows))
    for (step, micro, name), row in zip(keys, df.itertuples()):
        want = truth.rows[(step, micro, name)]
        for op in OPS:
            assert getattr(row, op) == pytest.approx(want[op], rel=1e-5, abs=1e-6), (step, micro, name, op)


def _train(model, optimizer, batches):
    for x in batches:
        model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_evaluation_forwards_are_not_recorded_as_micro_batches(output_root, make_config):
    """train step / model.eval() + no_grad and inference_mode forwards / model.train(): each
    step has exactly its training micro-batches, and the step after the last one (evaluated,
    never trained) has no rows."""
    torch.manual_seed(0)
    model = Net()
    truth = Truth(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = _monitor(make_config, model, optimizer)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        _train(model, optimizer, [torch.randn(4, D, generator=g) for _ in range(2)])
        truth.next_step()
        model.eval()
        with torch.no_grad():
            for _ in range(2):
                model(torch.randn(4, D, generator=g))
        with torch.inference_mode():
            model(torch.randn(4, D, generator=g))
        model.train()
    monitor.close()
    df = _actv(output_root)
    assert sorted(set(df["step"])) == [0, 1, 2]
    assert sorted(set(df["micro_step"])) == [0, 1]
    assert_rows_are_the_truth(df, truth)


def test_a_forward_in_eval_mode_with_grad_on_is_recorded(output_root, make_config):
    """The documented choice: model.eval() alone does not mean evaluation (training with dropout
    off or frozen BatchNorm runs in eval mode); only a forward without autograd is skipped."""
    torch.manual_seed(0)
    model = Net()
    truth = Truth(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = _monitor(make_config, model, optimizer)
    model.eval()
    _train(model, optimizer, [torch.randn(4, D) for _ in range(2)])
    monitor.close()
    df = _actv(output_root)
    assert sorted(set(df["micro_step"])) == [0, 1]
    assert_rows_are_the_truth(df, truth)


def test_a_forward_that_raises_leaves_no_rows_and_takes_no_micro_step(output_root, make_config, caplog):
    """A module in the middle of the model raises (caught by the loop) as the first forward of a
    step, between micro-batches, and after the last micro-batch before the optimizer step."""
    torch.manual_seed(0)
    model = Net()
    truth = Truth(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = _monitor(make_config, model, optimizer)
    g = torch.Generator().manual_seed(2)

    def fails():
        model.flaky.armed = True
        with pytest.raises(RuntimeError, match="bad batch"):
            model(torch.randn(4, D, generator=g))
        model.flaky.armed = False

    plans = [
        ["ok", "ok"],
        ["fail", "ok", "ok"],  # first forward of the step raises
        ["ok", "fail", "ok"],  # between micro-batches
        ["ok", "ok", "fail"],  # last thing before the optimizer step
        ["ok", "ok"],
    ]
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        for plan in plans:
            for what in plan:
                if what == "fail":
                    fails()
                else:
                    model(torch.randn(4, D, generator=g)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            truth.next_step()
        monitor.close()
    df = _actv(output_root)
    assert sorted(set(df["step"])) == list(range(len(plans)))
    assert df.groupby("step")["micro_step"].max().tolist() == [1] * len(plans)
    assert_rows_are_the_truth(df, truth)
    grads = read_family(only_run_dir(output_root) / rank_dir_name(0), "actv_grad")
    assert df.groupby("step")["micro_step"].nunique().tolist() == grads.groupby("step")["micro_step"].nunique().tolist()
    raised = [r for r in caplog.records if "raised before returning" in r.getMessage()]
    assert len(raised) == 1, caplog.text  # warned once
