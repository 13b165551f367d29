"""msprobe's Python calls, positional forms included, work unchanged (docs/msprobe_migration.md).

msprobe: ``TrainerMon(config_file_path, process_group=None, params_have_main_grad=True, opt_ty=None)``
and ``set_monitor(model, optimizer, grad_acc_steps=1, tp_group=None, dp_group=None, start_iteration=0)``.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from tests._support.runs import only_run_dir, read_family, reference_stats
from trainmon import TrainerMon

CONFIG = {"wg_distribution": True, "xy_distribution": True, "all_xy": True, "ops": ["norm", "max"]}


def _setup(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    (tmp_path / "c.json").write_text(json.dumps(CONFIG))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), tmp_path / "c.json"


def _train(model, opt, steps, acc):
    """Train; the truth: each step's grads (sum of its ``acc`` micro-batches) as the optimizer sees them."""
    truth = {}
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        for _ in range(acc):
            model(torch.randn(3, 4, generator=gen)).pow(2).mean().backward()
        truth[step] = {n: reference_stats(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return truth


def _check(tmp_path, truth, acc):
    rank = only_run_dir(tmp_path / "out") / "rank0"
    grads = read_family(rank, "grad_reduced")
    for step, by_name in truth.items():
        rows = grads[grads["step"] == step].set_index("name")
        for name, stats in by_name.items():
            assert rows.loc[name, "norm"] == pytest.approx(stats["norm"], rel=1e-12), (step, name)
    micro = read_family(rank, "actv")["micro_step"]
    assert sorted(micro.unique()) == list(range(acc))  # grad_acc_steps reached the clock


@pytest.mark.parametrize(
    ("call", "acc"),
    [
        (lambda mon, model, opt: mon.set_monitor(model, opt), 1),  # msprobe's order
        (lambda mon, model, opt: mon.set_monitor(model, opt, 2), 2),
        (lambda mon, model, opt: mon.set_monitor(model, opt, 2, None, None, 0), 2),
        (lambda mon, model, opt: mon.set_monitor(model, opt, grad_acc_steps=2), 2),
        (lambda mon, model, opt: mon.set_monitor(model, 2, opt), 2),  # trainmon's earlier order
        (lambda mon, model, opt: mon.set_monitor(model, optimizer=opt, grad_acc_steps=2), 2),
    ],
    ids=["msprobe-2", "msprobe-3", "msprobe-6", "msprobe-kw", "own-positional", "keywords"],
)
def test_each_call_form_records_the_same_right_values(tmp_path, monkeypatch, call, acc):
    model, opt, cfg = _setup(tmp_path, monkeypatch)
    mon = TrainerMon(cfg)
    call(mon, model, opt)
    truth = _train(model, opt, 3, acc)
    mon.close()
    _check(tmp_path, truth, acc)


def test_msprobes_four_argument_constructor(tmp_path, monkeypatch):
    model, opt, cfg = _setup(tmp_path, monkeypatch)
    mon = TrainerMon(cfg, None, None, "Megatron_DistributedOptimizer")  # opt_ty: read off the optimizer
    mon.set_monitor(model, opt)
    truth = _train(model, opt, 2, 1)
    mon.close()
    _check(tmp_path, truth, 1)


def test_msprobes_group_order_tp_then_dp(tmp_path, monkeypatch):
    model, opt, cfg = _setup(tmp_path, monkeypatch)
    tp, dp = object(), object()  # no process group is used on one process: only where each lands
    mon = TrainerMon(cfg).set_monitor(model, opt, 1, tp, dp)
    ctx = mon._driver.session.ctx
    assert (ctx.tp_group, ctx.dp_group, ctx.optimizer) == (tp, dp, opt)
    mon.close()
    mon = TrainerMon(cfg).set_monitor(model, 1, opt, dp, tp)  # trainmon's own order: dp, then tp
    ctx = mon._driver.session.ctx
    assert (ctx.tp_group, ctx.dp_group) == (tp, dp)
    mon.close()


def test_a_value_given_twice_or_too_many_is_a_type_error(tmp_path, monkeypatch):
    model, opt, cfg = _setup(tmp_path, monkeypatch)
    mon = TrainerMon(cfg)
    with pytest.raises(TypeError, match="multiple values for argument 'optimizer'"):
        mon.set_monitor(model, opt, optimizer=opt)
    with pytest.raises(TypeError, match="at most 6 positional"):
        mon.set_monitor(model, opt, 1, None, None, 0, 7)
    mon.close()
