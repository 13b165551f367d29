"""Params that join after ``set_monitor`` are recorded from the step they join (runtime.param_watch):
a param unfrozen at step 3, a module added to the model and the optimizer at step 2.  Every row
is checked against the tensor itself in float64."""

from __future__ import annotations

import logging
import math
import sys

import torch
import torch.nn as nn

from tests._support.runs import only_run_dir, read_family, reference_stats
from trainmon import TrainerMon
from trainmon.core.naming import TargetMatcher

OPS = ["norm", "mean", "min", "max"]
ALL_ON = dict(wg_distribution=True, param_distribution=True, ur_distribution=True, mv_distribution=True, ops=OPS)
STEPS = 6


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(6, 5)
        self.last = nn.Linear(5, 3)
        self.extra: nn.Module | None = None  # a module added during training

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.last(torch.tanh(self.first(x)))
        return h if self.extra is None else self.extra(h)


def _train(model: Net, optimizer, before_step: dict):
    """Train STEPS steps (``before_step[step](model, optimizer)`` runs before that step's forward);
    the truth of each family per (step, name), from the tensors in float64."""
    truth: dict[tuple[str, int], dict[str, dict]] = {}
    torch.manual_seed(1)
    for step in range(STEPS):
        if step in before_step:
            before_step[step](model, optimizer)
        names = {p: n for n, p in model.named_parameters() if p.requires_grad}
        model(torch.randn(4, 6)).square().mean().backward()
        before = {p: p.detach().clone() for p in names}
        for p, n in names.items():
            truth.setdefault(("grad", step), {})[n] = reference_stats(p.grad)
            truth.setdefault(("param_origin", step), {})[n] = reference_stats(p)
        optimizer.step()
        for p, n in names.items():
            truth.setdefault(("param_updated", step), {})[n] = reference_stats(p)
            truth.setdefault(("exp_avg", step), {})[n] = reference_stats(optimizer.state[p]["exp_avg"])
            ratio = (p.detach().double() - before[p].double()).norm() / before[p].double().norm()
            truth.setdefault(("update_ratio", step), {})[n] = {"update_ratio": ratio.item()}
        optimizer.zero_grad()
    return truth


def _check(rank0, family, truth_key, truth, name, steps, ops=OPS):
    df = read_family(rank0, family)
    rows = df[df["name"] == name].sort_values("step")
    assert list(rows["step"]) == list(steps), (family, name, list(rows["step"]))
    for row in rows.itertuples(index=False):
        want = truth[(truth_key, row.step)][name]
        for op in ops:
            assert math.isclose(getattr(row, op), want[op], rel_tol=1e-5, abs_tol=1e-7), (family, name, row, op)


def test_a_param_unfrozen_at_step_3_is_recorded_from_step_3(output_root, make_config, caplog):
    model = Net()
    model.first.requires_grad_(False)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)  # frozen params in it, as usual

    def unfreeze(m, _opt):
        m.first.requires_grad_(True)

    with caplog.at_level(logging.INFO, logger="trainmon"), TrainerMon(make_config(**ALL_ON)) as monitor:
        monitor.set_monitor(model, optimizer=optimizer)
        truth = _train(model, optimizer, {3: unfreeze})
    rank0 = only_run_dir(output_root) / "rank0"
    for name, steps in (
        ("first.weight", range(3, STEPS)),
        ("first.bias", range(3, STEPS)),
        ("last.weight", range(STEPS)),
    ):
        for family, key in (
            ("grad_unreduced", "grad"),
            ("grad_reduced", "grad"),
            ("param_origin", "param_origin"),
            ("param_updated", "param_updated"),
            ("exp_avg", "exp_avg"),
        ):
            _check(rank0, family, key, truth, name, steps)
        _check(rank0, "update_ratio", "update_ratio", truth, name, steps, ops=["update_ratio"])
    joined = [r.getMessage() for r in caplog.records if "joined the monitored set" in r.getMessage()]
    assert len(joined) == 1 and joined[0].startswith("trainmon: step 3: 2 params joined"), joined
    assert "first.weight" in joined[0] and "first.bias" in joined[0]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("trainmon")]


def test_a_module_added_with_add_param_group_at_step_2_is_recorded_from_step_2(output_root, make_config):
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    seen: dict[tuple[str, int], dict[str, dict]] = {}

    def add_module(m, opt):
        torch.manual_seed(2)
        m.extra = nn.Linear(3, 3)
        opt.add_param_group({"params": list(m.extra.parameters())})
        step = iter(range(2, STEPS))

        def record(_mod, args, out):  # the test's own hook: what extra sees and returns
            s = next(step)
            seen.setdefault(("actv", s), {})["extra.input"] = reference_stats(args[0])
            seen[("actv", s)]["extra.output"] = reference_stats(out)

        m.extra.register_forward_hook(record)

    with TrainerMon(make_config(xy_distribution=True, all_xy=True, **ALL_ON)) as monitor:
        monitor.set_monitor(model, optimizer=optimizer)
        truth = _train(model, optimizer, {2: add_module})
    truth.update(seen)
    rank0 = only_run_dir(output_root) / "rank0"
    for name in ("extra.weight", "extra.bias"):
        for family, key in (
            ("grad_unreduced", "grad"),
            ("grad_reduced", "grad"),
            ("param_origin", "param_origin"),
            ("param_updated", "param_updated"),
            ("exp_avg", "exp_avg"),
        ):
            _check(rank0, family, key, truth, name, range(2, STEPS))
        _check(rank0, "update_ratio", "update_ratio", truth, name, range(2, STEPS), ops=["update_ratio"])
    _check(rank0, "param_origin", "param_origin", truth, "first.weight", range(STEPS))
    for name in ("extra.input", "extra.output"):
        _check(rank0, "actv", "actv", truth, name, range(2, STEPS))
    actv_grad = read_family(rank0, "actv_grad")
    assert sorted(actv_grad[actv_grad["name"] == "extra.output"]["step"]) == list(range(2, STEPS))


def test_a_param_joining_only_at_optimizer_step_gets_its_rows_there(output_root, make_config, caplog):
    """add_param_group between backward and step (no forward saw it): param rows at that step, no
    misleading 'grads missed' warning."""
    model = Net()
    model.first.requires_grad_(False)
    optimizer = torch.optim.Adam(model.last.parameters(), lr=0.01)
    torch.manual_seed(1)
    with caplog.at_level(logging.INFO, logger="trainmon"), TrainerMon(make_config(**ALL_ON)) as monitor:
        monitor.set_monitor(model, optimizer=optimizer)
        for step in range(3):
            model(torch.randn(4, 6)).square().mean().backward()
            if step == 1:
                model.first.requires_grad_(True)  # after backward: no grad this step
                optimizer.add_param_group({"params": list(model.first.parameters())})
            optimizer.step()
            optimizer.zero_grad()
    rank0 = only_run_dir(output_root) / "rank0"
    df = read_family(rank0, "param_origin")
    assert sorted(df[df["name"] == "first.weight"]["step"]) == [1, 2]
    grads = read_family(rank0, "grad_unreduced")
    assert sorted(grads[grads["name"] == "first.weight"]["step"]) == [2]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("trainmon")]


def test_the_watch_costs_no_per_param_work_when_nothing_changed():
    """With nothing frozen, a step's check is a few len() calls whatever the model's size."""
    from trainmon.collectors.base import CollectorContext
    from trainmon.core.naming import selected_params
    from trainmon.core.schedule import Schedule, StepClock
    from trainmon.integrations import select_integration
    from trainmon.runtime.param_watch import ParamWatch

    def watch_for(n_layers: int) -> ParamWatch:
        model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(n_layers)])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ctx = CollectorContext(
            config=None,  # type: ignore[arg-type]
            chunks=[model],
            params=selected_params([model], TargetMatcher([])),
            matcher=TargetMatcher([]),
            engine=None,  # type: ignore[arg-type]
            clock=StepClock(Schedule(0, 1, 10**9), 1),
            optimizer=optimizer,
            integration=select_integration([model], optimizer, False),
        )
        return ParamWatch(ctx, lambda joined: None)

    def calls(watch: ParamWatch) -> list[str]:
        """Every Python frame and C call of one check, in order (exact, unlike a timing)."""
        seen: list[str] = []

        def profile(frame, event, arg):
            if event in ("call", "c_call"):
                seen.append(frame.f_code.co_name if event == "call" else arg.__name__)

        sys.setprofile(profile)
        try:
            watch.check()
        finally:
            sys.setprofile(None)
        return seen

    small, large = watch_for(2), watch_for(2000)
    small.check(), large.check()  # the first check derives the tracked set
    assert calls(large) == calls(small)  # 2000x the params, the same calls
    assert calls(large).count("check") == 1 and len(calls(large)) < 10
