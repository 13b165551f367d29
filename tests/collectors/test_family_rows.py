"""Weight families read as whole families (``collectors.base.FamilyRows``): one multi-tensor call
per family, the layout kept step after step and rebuilt when the tensors no longer fit it.
Every row is checked against the tensor it describes, read in float64 at the moment the family
is defined (``grad_unreduced``: when backward ends, before a clip; ``exp_avg``: after the step)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn as nn

from tests._support.runs import only_run_dir, read_family, reference_stats, trainmon_warnings
from trainmon import TrainerMon

OPS = ["norm", "mean", "min", "max", "nans"]


def _monitor(tmp_path, monkeypatch, model, opt, **cfg):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"ops": OPS, "step_count_per_record": 100, **cfg}))
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    return TrainerMon(str(path)).set_monitor(model, optimizer=opt)


def _rows(tmp_path, family):
    return read_family(only_run_dir(tmp_path / "out") / "rank0", family)


def _check(frame, truth):
    """Every (step, name) of ``truth`` is a row of ``frame`` with the tensor's statistics."""
    assert len(frame) == len(truth), (len(frame), len(truth))
    for (step, name), t in truth.items():
        row = frame[(frame.step == step) & (frame.name == name)]
        assert len(row) == 1, (step, name)
        ref = reference_stats(t)
        for op in ("norm", "min", "max"):
            np.testing.assert_allclose(row[op].item(), ref[op], rtol=1e-6, atol=1e-12, err_msg=f"{step} {name} {op}")
        np.testing.assert_allclose(row["mean"].item(), ref["mean"], rtol=1e-6, atol=ref["_mean_atol"])
        assert row["nans"].item() == ref["nans"]


class Branches(nn.Module):
    """A trunk ``a`` and branches; ``head`` picks which ones the output goes through.  The
    sentinel params (first, middle, last) are a.weight, c.weight and d.bias."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)
        self.d = nn.Linear(4, 4)
        self.head = "cd"

    def forward(self, x):
        y = self.b(self.a(x))
        return self.c(y) if self.head == "cd" else y


def test_grad_unreduced_is_every_grad_as_backward_left_it_before_a_clip(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    mon = _monitor(tmp_path, monkeypatch, model, opt, wg_distribution=True)
    unreduced, reduced = {}, {}
    for step in range(3):
        model(torch.randn(8, 4)).square().mean().backward()
        for name, p in model.named_parameters():
            unreduced[(step, name)] = p.grad.clone()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # changes every grad in place
        for name, p in model.named_parameters():
            reduced[(step, name)] = p.grad.clone()
        opt.step()
        opt.zero_grad(set_to_none=True)  # the grads move: new tensors every step
    mon.close()
    frame = _rows(tmp_path, "grad_unreduced")
    _check(frame, unreduced)
    assert list(frame[frame.step == 0].name) == [n for n, _ in model.named_parameters()]  # model order
    _check(_rows(tmp_path, "grad_reduced"), reduced)


def test_grads_that_come_and_go_rebuild_the_layout(tmp_path, monkeypatch):
    """A head used on some steps only: its params have grads on those steps alone."""
    torch.manual_seed(1)
    model = Branches()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    mon = _monitor(tmp_path, monkeypatch, model, opt, wg_distribution=True)
    truth = {}
    for step, head in enumerate(["cd", "b", "cd", "b"]):
        model.head = head
        model(torch.randn(8, 4)).square().mean().backward()
        for name, p in model.named_parameters():
            if p.grad is not None:
                truth[(step, name)] = p.grad.clone()
        opt.step()
        opt.zero_grad(set_to_none=True)
    mon.close()
    _check(_rows(tmp_path, "grad_reduced"), truth)
    _check(_rows(tmp_path, "grad_unreduced"), truth)


def test_a_backward_that_reaches_no_sentinel_is_said_and_later_steps_are_recorded(tmp_path, monkeypatch):
    """A loss through ``b`` alone reaches none of the sentinels (a.weight, c.weight, d.bias): step 0
    has no grad_unreduced rows and one warning; from step 1 every param has its own hook."""
    torch.manual_seed(2)
    model = Branches()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    mon = _monitor(tmp_path, monkeypatch, model, opt, wg_distribution=True)
    truth = {}
    with trainmon_warnings() as warned:
        for step in range(3):
            x = torch.randn(8, 4)
            loss = model.b(x).square().mean()
            loss.backward()
            for name, p in model.named_parameters():
                if p.grad is not None and step > 0:
                    truth[(step, name)] = p.grad.clone()
            opt.step()
            opt.zero_grad(set_to_none=True)
    mon.close()
    assert sum("reached none of the params" in w for w in warned) == 1, warned
    _check(_rows(tmp_path, "grad_unreduced"), truth)


def test_moments_follow_a_state_replaced_by_load_state_dict(tmp_path, monkeypatch):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    mon = _monitor(tmp_path, monkeypatch, model, opt, mv_distribution=True)
    truth = {}
    for step in range(4):
        model(torch.randn(8, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if step == 1:  # a checkpoint round trip: new state dicts, new tensors
            saved = opt.state_dict()
            for group in saved["state"].values():
                group["exp_avg"] = group["exp_avg"] * 2
            opt.load_state_dict(saved)
        for name, p in model.named_parameters():
            truth[(step, name)] = opt.state[p]["exp_avg"].clone()
    mon.close()
    frame = _rows(tmp_path, "exp_avg")
    # step 1's rows were written before the reload changed the state
    for name, p in model.named_parameters():
        truth[(1, name)] = truth[(1, name)] / 2
    _check(frame, truth)


@pytest.mark.parametrize("dtype", [torch.complex64])
def test_complex_params_still_take_the_modulus(tmp_path, monkeypatch, dtype):
    torch.manual_seed(4)
    w = nn.Parameter(torch.randn(5, 3, dtype=dtype))
    model = nn.Module()
    model.w = w
    opt = torch.optim.SGD([w], lr=1e-2)
    mon = _monitor(tmp_path, monkeypatch, model, opt, param_distribution=True)
    truth = {}
    for step in range(2):
        truth[(step, "w")] = w.detach().abs().clone()
        (w.abs() ** 2).sum().backward()
        opt.step()
        opt.zero_grad()
    mon.close()
    _check(_rows(tmp_path, "param_origin"), truth)
