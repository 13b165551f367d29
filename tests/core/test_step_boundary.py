"""The step boundary: closures, LBFGS, facades and duck-typed optimizers record what is applied."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import torch.nn as nn

from tests._support.applied import AppliedRecorder, assert_recorded_as_applied, recorded_norms
from tests._support.runs import only_run_dir
from trainmon import TrainerMon
from trainmon.core.hooks import step_optimizer
from trainmon.output.layout import rank_dir_name

CFG = dict(wg_distribution=True, mv_distribution=True, param_distribution=True, ops=["norm"])


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)) for _ in range(n)]


def loss_of(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def rank0(output_root):
    return only_run_dir(output_root) / rank_dir_name(0)


@pytest.mark.parametrize("as_kwarg", [False, True], ids=["positional", "keyword"])
def test_step_with_a_closure_records_the_grads_its_backward_made_from_step_zero(
        output_root, make_config, caplog, as_kwarg):
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = TrainerMon(make_config(**CFG)).set_monitor(model, optimizer=opt)
    recorder = AppliedRecorder(opt, model)
    data = batches(4)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        for batch in data:
            def closure(batch=batch):
                opt.zero_grad()
                loss = loss_of(model, batch)
                loss.backward()
                return loss
            opt.step(closure=closure) if as_kwarg else opt.step(closure)
        monitor.close()
    assert_recorded_as_applied(output_root, recorder, steps=4)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_accumulation_with_the_last_backward_inside_the_closure_records_the_accumulated_grad(
        output_root, make_config, caplog):
    """Lightning's automatic optimization with accumulation: micro-batch 0 outside, 1 inside step."""
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    monitor = TrainerMon(make_config(**CFG)).set_monitor(model, grad_acc_steps=2, optimizer=opt)
    recorder = AppliedRecorder(opt, model)
    data = batches(6)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        for step in range(3):
            opt.zero_grad()
            (loss_of(model, data[2 * step]) / 2).backward()

            def closure(batch=data[2 * step + 1]):
                loss = loss_of(model, batch) / 2
                loss.backward()
                return loss
            opt.step(closure)
        monitor.close()
    assert_recorded_as_applied(output_root, recorder, steps=3)
    # single process: nothing reduces, so the pre-reduce grad is the applied one too
    unreduced = recorded_norms(rank0(output_root), "grad_unreduced")
    for step in range(3):
        names = sorted(recorder.grad[step])
        np.testing.assert_allclose([unreduced[step][n] for n in names], [recorder.grad[step][n] for n in names],
                                   rtol=1e-6)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_lbfgs_records_the_grad_and_params_of_its_first_closure_call_and_warns_once(
        output_root, make_config, caplog):
    model = tiny_model()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=3)
    monitor = TrainerMon(make_config(**CFG)).set_monitor(model, optimizer=opt)
    names = {p: n for n, p in model.named_parameters()}
    first_grad: list[dict[str, float]] = []
    origin: list[dict[str, float]] = []
    calls: list[int] = []
    data = batches(3)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        for batch in data:
            origin.append({n: p.detach().double().norm().item() for p, n in names.items()})
            calls.append(0)

            def closure(batch=batch):
                opt.zero_grad()
                loss = loss_of(model, batch)
                loss.backward()
                if calls[-1] == 0:
                    first_grad.append({n: p.grad.double().norm().item() for p, n in names.items()})
                calls[-1] += 1
                return loss
            opt.step(closure)
        monitor.close()
    assert min(calls) > 1, "LBFGS should re-evaluate the closure in these steps"
    got_grad = recorded_norms(rank0(output_root), "grad_reduced")
    got_origin = recorded_norms(rank0(output_root), "param_origin")
    for step in range(3):
        keys = sorted(first_grad[step])
        np.testing.assert_allclose([got_grad[step][k] for k in keys], [first_grad[step][k] for k in keys], rtol=1e-6)
        np.testing.assert_allclose([got_origin[step][k] for k in keys], [origin[step][k] for k in keys], rtol=1e-6)
    passes = [r for r in caplog.records if "backward passes" in r.getMessage()]
    assert len(passes) == 1 and "LBFGS" in passes[0].getMessage(), caplog.text
    assert any("exp_avg" in r.getMessage() for r in caplog.records)  # LBFGS has no moments: said once


def test_a_wrong_grad_acc_steps_warns_once_not_every_step(output_root, make_config, caplog):
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    monitor = TrainerMon(make_config(wg_distribution=True, ops=["norm"])).set_monitor(model, optimizer=opt)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        for step in range(4):
            for batch in batches(3, seed=step):
                loss_of(model, batch).backward()
            opt.step()
            opt.zero_grad()
        monitor.close()
    assert len([r for r in caplog.records if "backward passes" in r.getMessage()]) == 1, caplog.text


class FacadeOptimizer(torch.optim.Optimizer):
    """Like accelerate's AcceleratedOptimizer: passes as a torch optimizer, never calls its __init__."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    @property
    def state(self):
        return self.optimizer.state

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self, closure=None):
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none)


class DuckOptimizer:
    """Any object with a step(): the boundary is its step."""

    def __init__(self, params):
        self.inner = torch.optim.Adam(params, lr=1e-2)

    def step(self):
        self.inner.step()

    def zero_grad(self):
        self.inner.zero_grad()


def test_a_facade_that_passes_as_a_torch_optimizer_is_unwrapped_and_records_the_applied_values(
        output_root, make_config):
    model = tiny_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    facade = FacadeOptimizer(inner)
    assert step_optimizer(facade) is inner
    monitor = TrainerMon(make_config(**CFG)).set_monitor(model, optimizer=facade)
    recorder = AppliedRecorder(inner, model)
    for batch in batches(3):
        facade.zero_grad()
        loss_of(model, batch).backward()
        facade.step()
    monitor.close()
    assert_recorded_as_applied(output_root, recorder, steps=3)
    assert not inner._optimizer_step_pre_hooks and "step" not in vars(facade)  # close removed everything


def test_a_duck_typed_optimizer_is_the_step_boundary(output_root, make_config):
    model = tiny_model()
    duck = DuckOptimizer(model.parameters())
    monitor = TrainerMon(make_config(wg_distribution=True, ops=["norm"])).set_monitor(model, optimizer=duck)
    recorder = AppliedRecorder(duck.inner, model)
    for batch in batches(3):
        duck.zero_grad()
        loss_of(model, batch).backward()
        duck.step()
    monitor.close()
    got = recorded_norms(rank0(output_root), "grad_reduced")
    assert sorted(got) == [0, 1, 2]
    for step in range(3):
        keys = sorted(recorder.grad[step])
        np.testing.assert_allclose([got[step][k] for k in keys], [recorder.grad[step][k] for k in keys], rtol=1e-6)
    assert "step" not in vars(duck)


def test_an_optimizer_without_step_is_refused_at_set_monitor_in_one_line(output_root, make_config):
    model = tiny_model()
    with pytest.raises(TypeError, match=r"got a dict, which has no step\(\) method") as info:
        TrainerMon(make_config(**CFG)).set_monitor(model, optimizer={"lr": 1e-3})
    assert "\n" not in str(info.value)


def test_a_closure_changes_nothing_in_training(output_root, make_config):
    def train(monitored: bool):
        model = tiny_model()
        opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
        monitor = TrainerMon(make_config(**CFG)).set_monitor(model, optimizer=opt) if monitored else None
        for batch in batches(3):
            def closure(batch=batch):
                opt.zero_grad()
                loss = loss_of(model, batch)
                loss.backward()
                return loss
            opt.step(closure)
        if monitor:
            monitor.close()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(train(False), train(True)):
        assert torch.equal(a, b)


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimization, as usually written: the closure runs at perturbed params."""

    def __init__(self, params, lr=0.05, rho=0.5):
        super().__init__(params, {"lr": lr, "rho": rho})

    @torch.no_grad()
    def step(self, closure):
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
        moves = [p.grad * (self.param_groups[0]["rho"] / norm) for p in params]
        for p, e in zip(params, moves):
            p.add_(e)                          # to the perturbed point
        with torch.enable_grad():
            loss = closure()                   # grads there: what the update applies
        for p, e in zip(params, moves):
            p.sub_(e)                          # back, then the update
            p.add_(p.grad, alpha=-self.param_groups[0]["lr"])
        return loss


def test_an_optimizer_that_moves_params_before_its_closure_records_the_origin_and_the_applied_grad(
        output_root, make_config):
    model = tiny_model()
    opt = SAM(model.parameters())
    monitor = TrainerMon(make_config(**CFG)).set_monitor(model, grad_acc_steps=2, optimizer=opt)
    recorder = AppliedRecorder(opt, model)
    names = {p: n for n, p in model.named_parameters()}
    origin = []
    for batch in batches(3):
        opt.zero_grad()
        loss_of(model, batch).backward()       # first pass, at the params themselves
        origin.append({n: p.detach().double().norm().item() for p, n in names.items()})

        def closure(batch=batch):
            opt.zero_grad()
            loss = loss_of(model, batch)
            loss.backward()
            return loss
        opt.step(closure)
    monitor.close()
    got_origin = recorded_norms(rank0(output_root), "param_origin")
    got_grad = recorded_norms(rank0(output_root), "grad_reduced")
    for step in range(3):
        keys = sorted(origin[step])
        np.testing.assert_allclose([got_origin[step][k] for k in keys], [origin[step][k] for k in keys], rtol=1e-6)
        np.testing.assert_allclose([got_grad[step][k] for k in keys], [recorder.grad[step][k] for k in keys],
                                   rtol=1e-6)
