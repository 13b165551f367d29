"""Batched activations: values as they were at hook time despite later in-place ops, the bound on
the memory the pending batch holds, grad hooks that ride on another tensor's hook or skip torch's
handle objects (the Python-call budget per row: tests/test_host_budget_activations.py)."""

from __future__ import annotations

import logging

import pandas as pd
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


@pytest.mark.parametrize("bound", ["bytes", "tensors"])
def test_pending_batch_stays_under_its_bounds(output_root, make_config, monkeypatch, bound):
    """The pending batch never references more than TRAINMON_ACTV_BATCH_BYTES bytes of storage
    (or more than TRAINMON_ACTV_BATCH_TENSORS tensors), and every row is still recorded right."""
    max_bytes, max_tensors = (3000, 256) if bound == "bytes" else (64 << 20, 5)
    monkeypatch.setenv("TRAINMON_ACTV_BATCH_BYTES", str(max_bytes))
    monkeypatch.setenv("TRAINMON_ACTV_BATCH_TENSORS", str(max_tensors))
    peak_bytes, peak_len, flushes = [0], [0], [0]
    flush = ActivationCollector._flush

    def watched(self):
        # a batch only grows between flushes: what it holds here is its peak
        held = {e[3].untyped_storage().data_ptr(): e[3].untyped_storage().nbytes() for e in self._batch}
        peak_bytes[0] = max(peak_bytes[0], sum(held.values()))
        peak_len[0] = max(peak_len[0], len(self._batch))
        flushes[0] += bool(self._batch)
        flush(self)

    monkeypatch.setattr(ActivationCollector, "_flush", watched)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])  # 4*64*4 = 1 KiB per activation
    truth: dict = {}

    def see(name, out):
        truth[(truth["step"], name)] = reference_stats(out)

    for name, m in model.named_modules():
        if name:
            m.register_forward_hook(lambda mod, a, out, n=name: see(n, out))
    mon = TrainerMon(make_config(xy_distribution=True, all_xy=True, ops=OPS))
    mon.set_monitor(model)
    for step in range(3):
        truth["step"] = step
        model(torch.randn(4, 64, generator=torch.Generator().manual_seed(step))).sum().backward()
        model.zero_grad()
        mon.step()
    mon.close()
    assert 0 < peak_bytes[0] <= max_bytes and peak_len[0] <= max_tensors
    assert flushes[0] > 3 * 2  # more than one per forward and backward: the bound cut batches
    rank0 = only_run_dir(output_root) / "rank0"
    actv, grad = read_family(rank0, "actv"), read_family(rank0, "actv_grad")
    assert len(actv) == 3 * 16 and len(grad) == 3 * 15
    for row in actv[actv.name.str.endswith(".output")].itertuples():
        want = truth[(row.step, row.name.rsplit(".", 1)[0])]
        for op in OPS:
            assert getattr(row, op) == pytest.approx(want[op], rel=1e-5, abs=1e-6), (row.step, row.name, op)


def _net(inplace: bool) -> nn.Module:
    """A 2-D Linear (its output is no view) whose output an in-place ReLU changes, and a module
    returning a tuple."""

    class Pair(nn.Module):
        def forward(self, x):
            return x * 2, x.tanh()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.act, self.pair, self.out = nn.Linear(6, 8), nn.ReLU(inplace=inplace), Pair(), nn.Linear(8, 2)

        def forward(self, x):
            a, b = self.pair(self.act(self.lin(x)))
            return self.out(a + b)

    torch.manual_seed(0)
    return Net()


def _run_net(model, make_config, root, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(root))
    mon = TrainerMon(make_config(xy_distribution=True, all_xy=True, ops=OPS))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon.set_monitor(model, optimizer=opt)
    for step in range(3):
        model(torch.randn(4, 6, generator=torch.Generator().manual_seed(step))).square().sum().backward()
        opt.step()
        opt.zero_grad()
    mon.close()
    rank0 = only_run_dir(root) / "rank0"
    return read_family(rank0, "actv"), read_family(rank0, "actv_grad")


def test_input_grad_of_an_in_place_module_comes_from_its_input_hook(tmp_path, make_config, monkeypatch):
    """ReLU(inplace=True) changes the alias of its input, so the alias's hook is lost; the grad
    recorded for its input is then the one its input (the Linear's output, hooked already) gets:
    from that tensor's own hook, no second hook.  Truth: a twin without the in-place op, where
    the ReLU's input grad is the Linear output's grad (its only consumer)."""
    _, grad = _run_net(_net(inplace=True), make_config, tmp_path / "a", monkeypatch)
    _, want = _run_net(_net(inplace=False), make_config, tmp_path / "b", monkeypatch)
    for df in (grad, want):
        relu_in = df[df.name == "act.input"].reset_index(drop=True)
        lin_out = df[df.name == "lin.output"].reset_index(drop=True)
        assert len(relu_in) == 3
        for op in OPS:
            assert relu_in[op].tolist() == pytest.approx(lin_out[op].tolist(), rel=1e-6)
    got = grad.set_index(["step", "name"]).sort_index()
    exp = want.set_index(["step", "name"]).sort_index()
    assert list(got.index) == list(exp.index)
    for op in OPS:
        assert got[op].tolist() == pytest.approx(exp[op].tolist(), rel=1e-5, abs=1e-7)


def test_hooks_without_torch_handles_record_what_register_hook_records(tmp_path, make_config, monkeypatch):
    """The shortcut that registers grad hooks without torch's handle objects writes the very rows
    ``Tensor.register_hook`` gives (checked against a run that uses it)."""
    from trainmon.collectors import activations

    fast = _run_net(_net(inplace=True), make_config, tmp_path / "fast", monkeypatch)
    assert activations._FAST_HOOKS is True  # this torch takes the shortcut
    monkeypatch.setattr(activations, "_FAST_HOOKS", False)
    slow = _run_net(_net(inplace=True), make_config, tmp_path / "slow", monkeypatch)
    for a, b in zip(fast, slow):
        assert not a.empty
        pd.testing.assert_frame_equal(a, b)


@pytest.mark.parametrize("batch_tensors", [2, 256])
def test_each_memory_is_read_once_across_batches_and_values_stay_hook_time(
    output_root, make_config, monkeypatch, batch_tensors
):
    """A module's output and the next module's input (an alias) are one memory: read once, also
    when they land in consecutive batches (2 tensors a batch: every flush splits such a pair).
    Truth: the tensors handed to the reductions, all kept alive for the step (so no memory is
    reused), hold no two of the same data pointer, size, dtype and version; every input and
    output row still equals float64 stats taken in the modules' own hooks, in-place ops included."""
    from trainmon.stats.engine import StatsEngine

    monkeypatch.setenv("TRAINMON_ACTV_BATCH_TENSORS", str(batch_tensors))
    read: list[tuple] = []  # (tensor, its key when read): the tensor kept alive for the step
    partials = StatsEngine.partials

    def spy(self, tensors, no_sync=False):
        read.extend((t, (t.data_ptr(), t.numel(), t.dtype, t._version)) for t in tensors)
        return partials(self, tensors, no_sync=no_sync)

    monkeypatch.setattr(StatsEngine, "partials", spy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 3))
    truth: dict = {"step": 0}
    for name, m in model.named_modules():
        if name:
            m.register_forward_pre_hook(lambda mod, a, n=name: truth.update({(truth["step"], f"{n}.input"): reference_stats(a[0])}))
            m.register_forward_hook(lambda mod, a, out, n=name: truth.update({(truth["step"], f"{n}.output"): reference_stats(out)}))
    mon = TrainerMon(make_config(xy_distribution=True, all_xy=True, ops=OPS))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon.set_monitor(model, optimizer=opt)
    per_step = []
    for step in range(3):
        truth["step"] = step
        read.clear()
        model(torch.randn(4, 6, generator=torch.Generator().manual_seed(step))).sum().backward()
        opt.step()
        opt.zero_grad()
        keys = [key for _, key in read]
        assert len(keys) == len(set(keys)), f"step {step}: a memory read twice"
        per_step.append(len(keys))
    mon.close()
    actv = read_family(only_run_dir(output_root) / "rank0", "actv")
    # forward: x, 3 output/input pairs, ReLU's output (its input changed in place: a version of its
    # own) shared with the last input, the last output: 6 of 10 rows (ReLU's input is reduced in
    # its hook, learned at step 0); backward: at most 5 distinct grads of 10 rows
    assert all(n <= 6 + 5 for n in per_step[1:]), per_step
    names = {f"{i}.{io}" for i in range(5) for io in ("input", "output")}
    assert all(set(actv[actv.step == s].name) == names for s in (1, 2))
    for row in actv.itertuples():
        want = truth[(row.step, row.name)]
        for op in OPS:
            assert getattr(row, op) == pytest.approx(want[op], rel=1e-5, abs=1e-7), (row.step, row.name, op)


@pytest.mark.parametrize("bound", [4096, 4095])
def test_an_activation_as_big_as_the_bound_is_read_once_a_step(output_root, make_config, monkeypatch, bound):
    """A tensor of the batch bound or more flushes the batch before it joins.  That flush used to
    forget the row just reduced in its hook, so the next flush read it again and its slot never
    learned batchable: two reads of every such activation on every step (TinyGPT's MLP hidden
    layer, 8 x 64 x 1024 fp32, hit this at the 2 MiB default).  Reads per step are those of the
    same run with a bound nothing reaches, and the values are the tensors' at hook time."""
    from trainmon.stats.engine import StatsEngine

    counts = [0]  # tensors handed to the stats engine
    partial, partials = StatsEngine.partial, StatsEngine.partials

    def one(self, t):
        counts[0] += 1
        return partial(self, t)

    def many(self, tensors, **kw):
        counts[0] += len(tensors)
        return partials(self, tensors, **kw)

    monkeypatch.setattr(StatsEngine, "partial", one)
    monkeypatch.setattr(StatsEngine, "partials", many)

    def reads_per_step(max_bytes: int, out_dir) -> tuple[list[int], pd.DataFrame]:
        monkeypatch.setenv("TRAINMON_ACTV_BATCH_BYTES", str(max_bytes))
        monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out_dir))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))  # 4 x 256 fp32: 4 KiB
        mon = TrainerMon(make_config(xy_distribution=True, all_xy=True, ops=OPS))
        mon.set_monitor(model)
        per_step = []
        for step in range(4):
            counts[0] = 0
            model(torch.randn(4, 64, generator=torch.Generator().manual_seed(step))).sum().backward()
            model.zero_grad()
            mon.step()
            per_step.append(counts[0])
        mon.close()
        rank0 = only_run_dir(out_dir) / "rank0"
        return per_step, pd.concat([read_family(rank0, "actv"), read_family(rank0, "actv_grad")])

    bounded, rows = reads_per_step(bound, output_root / "bounded")
    unbounded, want = reads_per_step(64 << 20, output_root / "unbounded")
    assert bounded[1:] == unbounded[1:], (bounded, unbounded)
    key = ["step", "name"]
    got = rows.sort_values(key).reset_index(drop=True)
    want = want.sort_values(key).reset_index(drop=True)
    assert len(got) == len(want) == 4 * 11  # 6 inputs and outputs, 5 grads (the input has none)
    for op in OPS:
        assert got[op].to_numpy() == pytest.approx(want[op].to_numpy(), rel=1e-6, abs=1e-9), op
