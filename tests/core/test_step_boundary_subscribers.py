"""core.step_boundary: one wrapping per optimizer whatever the number of subscribers, every
subscriber called at each boundary (GradScaler skips included), everything restored after the last."""

from __future__ import annotations

import torch
import torch.nn as nn

from tests._support import fake_megatron as fm
from trainmon.core import step_boundary


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(4, 2)


def _recorder(log: list, name: str):
    def cb(phase: str):
        return lambda: log.append((name, phase, step_boundary.skipping()))

    return cb("before"), cb("after"), cb("entry")


def _hook_counts(opt: torch.optim.Optimizer) -> tuple[int, int]:
    return len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)


def test_two_subscribers_share_one_pair_of_hooks_and_the_last_one_restores_everything():
    model = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    original_scaler_step = torch.amp.GradScaler.step
    log: list = []
    b1, a1, e1 = _recorder(log, "one")
    b2, a2, _ = _recorder(log, "two")
    first = step_boundary.subscribe(opt, b1, a1, entry=e1)
    second = step_boundary.subscribe(opt, b2, a2)
    assert _hook_counts(opt) == (1, 1)  # installed once
    assert torch.amp.GradScaler.step is not original_scaler_step
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    assert log == [
        ("one", "entry", False),
        ("one", "before", False),
        ("two", "before", False),
        ("one", "after", False),
        ("two", "after", False),
    ]
    first.remove()
    log.clear()
    opt.step()
    assert log == [("two", "before", False), ("two", "after", False)]
    assert _hook_counts(opt) == (1, 1) and torch.amp.GradScaler.step is not original_scaler_step
    second.remove()
    second.remove()  # a handle undoes once
    assert _hook_counts(opt) == (0, 0)
    assert torch.amp.GradScaler.step is original_scaler_step
    assert step_boundary._boundaries == {}


def test_a_grad_scaler_skip_is_one_boundary_for_every_subscriber_and_training_is_unchanged():
    def train(subscribe: bool):
        model = _linear()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        log: list = []
        handles = [step_boundary.subscribe(opt, *_recorder(log, n)[:2]) for n in ("one", "two")] if subscribe else []
        for step in range(3):
            opt.zero_grad()
            scaler.scale(model(torch.ones(1, 4)).sum()).backward()
            if step == 1:
                model.weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
        for h in handles:
            h.remove()
        return model, log

    plain, _ = train(False)
    model, log = train(True)
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters()))  # bitwise
    step = [("one", "before"), ("two", "before"), ("one", "after"), ("two", "after")]
    assert [(n, p) for n, p, _ in log] == step * 3
    assert [s for _, _, s in log] == [False] * 4 + [True] * 4 + [False] * 4  # the skipped step is step 1


def test_a_megatron_loss_scaler_skip_is_noted_once_for_all_subscribers_and_the_instance_restored():
    model = _linear()
    opt = fm.Float16OptimizerWithFloat16Params(
        torch.optim.Adam(model.parameters(), lr=0.1), fm.optimizer_config(fp16=True), fm.ConstantGradScaler(8.0)
    )
    assert "step" not in vars(opt)
    seen: list = []
    handles = [
        step_boundary.subscribe(opt, lambda: None, lambda n=n: seen.append((n, step_boundary.skipped(opt))))
        for n in ("one", "two")
    ]
    assert float(step_boundary.current_scale(opt)) == 8.0
    for step in range(3):
        model.zero_grad()
        (model(torch.ones(1, 4)).sum() * 8.0).backward()
        for p in model.parameters():
            p.main_grad = p.grad.detach().clone()
        if step == 1:
            model.weight.main_grad[0, 0] = float("inf")
        opt.step()
    assert seen == [("one", False), ("two", False), ("one", True), ("two", True), ("one", False), ("two", False)]
    for h in handles:
        h.remove()
    assert "step" not in vars(opt)  # both wrappers (boundary and skip watch) gone
    assert step_boundary.current_scale(opt) is None and not step_boundary.skipped(opt)
