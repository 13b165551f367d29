"""Every torch.optim optimizer's per-param state is recorded (``mv_distribution``): each family's
rows equal ``optimizer.state[param][key]`` after that step, computed in float64."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn as nn

from tests._support.runs import only_run_dir, read_family, reference_stats
from trainmon import TrainerMon
from trainmon.families import FAMILIES, OPTIMIZER_STATE, Family

OPS = ["norm", "mean", "min", "max"]
STEPS = 3

# optimizer factory -> {family: state key} it must produce
CASES = {
    "sgd_momentum": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), {"momentum_buffer": "momentum_buffer"}),
    "adagrad": (lambda ps: torch.optim.Adagrad(ps, lr=0.1), {"adagrad_sum": "sum"}),
    "rmsprop": (
        lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5, centered=True),
        {"square_avg": "square_avg", "momentum_buffer": "momentum_buffer", "grad_avg": "grad_avg"},
    ),
    "adam_amsgrad": (
        lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True),
        {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "max_exp_avg_sq": "max_exp_avg_sq"},
    ),
    "adadelta": (lambda ps: torch.optim.Adadelta(ps), {"square_avg": "square_avg", "acc_delta": "acc_delta"}),
    "adamax": (lambda ps: torch.optim.Adamax(ps, lr=0.01), {"exp_avg": "exp_avg", "exp_inf": "exp_inf"}),
    "rprop": (lambda ps: torch.optim.Rprop(ps, lr=0.01), {"rprop_prev": "prev", "rprop_step_size": "step_size"}),
    "asgd": (lambda ps: torch.optim.ASGD(ps, lr=0.01), {"asgd_ax": "ax"}),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _train(model, optimizer, steps=STEPS):
    """Train; the truth of every state tensor after each step, straight from optimizer.state."""
    names = {p: n for n, p in model.named_parameters()}
    torch.manual_seed(1)
    truth: dict[tuple[str, int], dict[str, dict]] = {}
    for step in range(steps):
        x = torch.randn(4, 6)
        model(x).square().mean().backward()
        optimizer.step()
        for p, n in names.items():
            for key, value in optimizer.state[p].items():
                if isinstance(value, torch.Tensor) and value.shape == p.shape:
                    truth.setdefault((key, step), {})[n] = reference_stats(value)
        optimizer.zero_grad()
    return truth


@pytest.mark.parametrize("case", sorted(CASES))
def test_state_rows_equal_the_optimizer_state(case, output_root, make_config):
    make_opt, families = CASES[case]
    model = _model()
    optimizer = make_opt(model.parameters())
    with TrainerMon(make_config(mv_distribution=True, ops=OPS)) as monitor:
        monitor.set_monitor(model, optimizer=optimizer)
        truth = _train(model, optimizer)
    rank0 = only_run_dir(output_root) / "rank0"
    written = {p.name.split("_0-")[0] for p in rank0.glob("*_0-*.csv")}
    assert written == set(families), written  # nothing else, nothing missing
    for family, key in families.items():
        df = read_family(rank0, family)
        assert sorted(df["step"].unique()) == list(range(STEPS)), family
        assert len(df) == STEPS * 4
        for row in df.itertuples(index=False):
            want = truth[(key, row.step)][row.name]
            for op in OPS:
                assert math.isclose(getattr(row, op), want[op], rel_tol=1e-5, abs_tol=1e-7), (family, row, op)


def test_every_state_family_is_known_to_the_readers():
    """The flow order (anomalies) puts them in the optimizer phase, between param_origin and
    param_updated; the writer's file-name pattern parses them back."""
    from pathlib import Path

    from trainmon.analysis.flow import family_rank, phase_of
    from trainmon.output.layout import parse_family_file

    for family in OPTIMIZER_STATE:
        assert phase_of(str(family)) == "optimizer"
        assert family_rank(Family.PARAM_ORIGIN) < family_rank(family) < family_rank(Family.PARAM_UPDATED)
        assert FAMILIES[family].config_flag == "mv_distribution" and FAMILIES[family].replicated
        parsed = parse_family_file(Path(f"{family}_0-9.csv"))
        assert parsed is not None and parsed.family == str(family)


def test_anomalies_finds_a_nan_in_momentum_buffer(output_root, make_config, capsys):
    """A NaN grad reaches the momentum buffer: `trainmon anomalies` reports it from that family."""
    import json

    from trainmon.cli import main

    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with TrainerMon(make_config(mv_distribution=True, ops=["norm", "nans"])) as monitor:
        monitor.set_monitor(model, optimizer=optimizer)
        for step in range(3):
            model(torch.randn(4, 6)).square().mean().backward()
            if step == 1:
                model[0].bias.grad[0] = float("nan")
            optimizer.step()
            optimizer.zero_grad()
    run = only_run_dir(output_root)
    df = read_family(run / "rank0", "momentum_buffer")
    assert df[(df.step == 1) & (df.name == "0.bias")]["nans"].item() == 1
    capsys.readouterr()
    assert main(["anomalies", str(run), "--json"]) == 0
    first = json.loads(capsys.readouterr().out)["anomalies"][0]
    assert (first["kind"], first["name"], first["step"], first["phase"]) == (
        "momentum_buffer",
        "0.bias",
        1,
        "optimizer",
    )


def test_state_outside_torch_optim_is_named_once(output_root, make_config, caplog):
    """A param-shaped state key no family records gets one INFO line naming it."""

    class Lion(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.01})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    state = self.state[p]
                    avg = state.setdefault("lion_avg", torch.zeros_like(p))
                    avg.mul_(0.9).add_(p.grad, alpha=0.1)
                    p.sub_(avg.sign(), alpha=group["lr"])

    model = _model()
    optimizer = Lion(model.parameters())
    with (
        caplog.at_level(logging.INFO, logger="trainmon"),
        TrainerMon(make_config(mv_distribution=True, ops=["norm"])) as monitor,
    ):
        monitor.set_monitor(model, optimizer=optimizer)
        _train(model, optimizer)
    lines = [r.getMessage() for r in caplog.records if "'lion_avg'" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("trainmon: ")
