"""Per-module input grads, deep copies of a monitored model, per-target specs, one reduction per
distinct grad.  Truths: ``register_full_backward_hook``'s ``grad_input`` (msprobe's definition)
and tensor hooks on the outputs, taken by the test in a separate copy of the model; training
compared bitwise with a run without the monitor."""
from __future__ import annotations

import copy
import logging
from collections import defaultdict

import pytest
import torch
import torch.nn as nn

from tests._support.runs import only_run_dir, read_family, reference_stats
from trainmon import TrainerMon
from trainmon.stats.engine import StatsEngine
from trainmon.testing.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches

CFG = GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=2)
OPS = ["norm", "mean", "min", "max"]
ACC, STEPS = 2, 2
# modules with one tensor input and one tensor output, inside the residual blocks
MODULES = [f"layers.{i}{m}" for i in range(CFG.layers)
           for m in ("", ".ln1", ".attn", ".attn.qkv", ".attn.proj", ".ln2", ".mlp", ".mlp.0", ".mlp.1", ".mlp.2")]


def _fresh():
    torch.manual_seed(0)
    return TinyGPT(CFG)


def _train(model, monitor_cfg=None, on_micro=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(monitor_cfg).set_monitor(model, optimizer=opt, grad_acc_steps=ACC) if monitor_cfg else None
    data = synthetic_batches(CFG, 4, STEPS * ACC, seed=3)
    for step in range(STEPS):
        for micro in range(ACC):
            if on_micro:
                on_micro(step, micro)
            (model.loss(next(data)) / ACC).backward()
        opt.step()
        opt.zero_grad()
    if monitor:
        monitor.close()
    return [p.detach().clone() for p in model.parameters()]


class FullHookTruth:
    """grad_input of every module via register_full_backward_hook; output grads via tensor hooks."""

    def __init__(self, model):
        self.rows = {}
        self.at = (0, 0)
        mods = dict(model.named_modules())
        for name in MODULES:
            mods[name].register_full_backward_hook(
                lambda m, gin, gout, n=name: self.rows.__setitem__(("in", *self.at, n), reference_stats(gin[0])))
            mods[name].register_forward_hook(lambda m, a, out, n=name: self._out(n, out))

    def _out(self, name, out):
        at = self.at
        out.register_hook(lambda g: self.rows.__setitem__(("out", *at, name), reference_stats(g)))

    def set(self, step, micro):
        self.at = (step, micro)


@pytest.mark.slow
def test_input_grads_are_the_modules_own_grad_input_and_training_is_bitwise_unchanged(output_root, make_config):
    plain = _train(_fresh())
    truth_model = _fresh()
    truth = FullHookTruth(truth_model)
    _train(truth_model, on_micro=truth.set)
    monitored = _train(_fresh(), make_config(xy_distribution=True, all_xy=True, ops=OPS))
    assert all(torch.equal(a, b) for a, b in zip(plain, monitored))   # training bitwise unchanged

    grads = read_family(only_run_dir(output_root) / "rank0", "actv_grad").set_index(["step", "micro_step", "name"])
    for (kind, step, micro, name), ref in truth.rows.items():
        row = grads.loc[(step, micro, f"{name}.{'input' if kind == 'in' else 'output'}")]
        for op in OPS:
            atol = ref["_mean_atol"] if op == "mean" else 1e-12
            assert row[op] == pytest.approx(ref[op], rel=1e-5, abs=atol), (kind, step, micro, name, op)
    # the residual stream: the block's first LayerNorm gets a different gradient from the one
    # the block's input receives (the skip connection carries the rest)
    ln = grads.loc[(0, 0, "layers.1.ln1.input"), "norm"]
    block = grads.loc[(0, 0, "layers.1.input"), "norm"]
    assert ln < 0.9 * block


class Pair(nn.Module):
    """Takes (x, mask) and returns (y, aux)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, mask):
        y = self.lin(x) * mask
        return y, y.sum(-1)


class PairNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 4)
        self.pair = Pair()

    def forward(self, x):
        h = self.inp(x)
        y, aux = self.pair(h, torch.ones_like(h).requires_grad_())
        return y.sum() + aux.sum()


def test_per_target_spec_records_only_the_chosen_tensors_and_warns_once_when_it_does_not_fit(
        output_root, make_config, caplog):
    spec = {"input": "tuple[2]:0", "output": "tuple[2]:1", "input_grad": "tuple[2]:1", "output_grad": "tensor"}
    model = PairNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        monitor = TrainerMon(make_config(xy_distribution=True, targets={"pair": spec})).set_monitor(model, optimizer=opt)
        for _ in range(2):
            model(torch.randn(3, 4)).backward()
            opt.step()
            opt.zero_grad()
        monitor.close()
    rank0 = only_run_dir(output_root) / "rank0"
    assert set(read_family(rank0, "actv")["name"]) == {"pair.input.0", "pair.output.1"}
    assert set(read_family(rank0, "actv_grad")["name"]) == {"pair.input.1", "pair.output.0"}
    # "tensor" says one output, the module returns two: recorded as output 0, said once
    warned = [r.getMessage() for r in caplog.records if "targets['pair'].output_grad" in r.getMessage()]
    assert len(warned) == 1 and "called with 2 output tensor(s); recording output_grad [0]" in warned[0]


@pytest.mark.slow
def test_a_deep_copy_of_the_monitored_model_records_nothing(tmp_path, monkeypatch, make_config):
    """The EMA idiom: copy.deepcopy(model) after set_monitor, the copy run forward and backward
    every micro-batch.  Every file equals the run without the copy."""
    frames = {}
    for with_copy in (False, True):
        out = tmp_path / f"copy_{with_copy}"
        monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
        model = _fresh()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        cfg = make_config(xy_distribution=True, all_xy=True, wg_distribution=True, stack_info=True, ops=OPS)
        monitor = TrainerMon(cfg).set_monitor(model, optimizer=opt, grad_acc_steps=ACC)
        ema = copy.deepcopy(model) if with_copy else None
        data = synthetic_batches(CFG, 4, STEPS * ACC, seed=3)
        for _ in range(STEPS):
            for _ in range(ACC):
                batch = next(data)
                (model.loss(batch) / ACC).backward()
                if ema is not None:
                    ema.loss(batch).backward()
            opt.step()
            opt.zero_grad()
        monitor.close()
        rank0 = only_run_dir(out) / "rank0"
        frames[with_copy] = {f: read_family(rank0, f) for f in ("actv", "actv_grad", "grad_unreduced", "grad_reduced")}
        frames[with_copy]["stack"] = (rank0 / "stack_info.csv").read_text().count("\n")
    for family, df in frames[False].items():
        if family == "stack":
            assert frames[True][family] == df
            continue
        assert not df.empty and df.equals(frames[True][family]), family


def test_a_grad_with_two_names_is_reduced_once(output_root, make_config, monkeypatch):
    """layers.0.mlp's output is layers.0.mlp.2's output: one tensor, one reduction, two rows."""
    seen = defaultdict(list)
    real, real_one = StatsEngine.partials, StatsEngine.partial

    def counting(self, tensors, *args, **kwargs):
        if torch._C._current_graph_task_id() != -1:  # in backward
            seen["calls"].append([id(t) for t in tensors])
        with monkeypatch.context() as m:  # partial() may fall back to partials(): count once
            m.setattr(StatsEngine, "partial", real_one)
            return real(self, tensors, *args, **kwargs)

    def counting_one(self, t):
        if torch._C._current_graph_task_id() != -1:
            seen["calls"].append([id(t)])
        with monkeypatch.context() as m:
            m.setattr(StatsEngine, "partials", real)
            return real_one(self, t)

    monkeypatch.setattr(StatsEngine, "partials", counting)
    monkeypatch.setattr(StatsEngine, "partial", counting_one)
    model = _fresh()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(make_config(xy_distribution=True, targets=["layers.0.mlp", "layers.0.mlp.2"], ops=OPS)
                         ).set_monitor(model, optimizer=opt)
    model.loss(next(synthetic_batches(CFG, 4, 1))).backward()
    opt.step()
    monitor.close()
    assert seen["calls"] and all(len(ids) == len(set(ids)) for ids in seen["calls"])
    grads = read_family(only_run_dir(output_root) / "rank0", "actv_grad").set_index("name")
    assert grads.loc["layers.0.mlp.output", "norm"] == grads.loc["layers.0.mlp.2.output", "norm"]
    # 4 rows (2 outputs, 2 inputs); the two outputs share one reduction
    assert len(grads) == 4 and sum(len(ids) for ids in seen["calls"]) == 3
