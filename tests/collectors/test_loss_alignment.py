"""loss_alignment and record_loss: the loss family, hyperparams and model_meta.json against what
the test itself recorded from the model and the optimizer."""
from __future__ import annotations

import json

import pytest
import torch

from tests._support.probe_runs import SMALL, train_run
from tests._support.runs import read_family
from trainmon import TrainerMon
from trainmon.testing.tiny_gpt import TinyGPT, synthetic_batches


@pytest.mark.slow
def test_the_loss_family_equals_the_losses_the_loop_recorded(tmp_path):
    truth = train_run(tmp_path, {}, steps=3, acc=2)
    loss = read_family(truth.run_dir / "rank0", "loss")
    assert list(loss.columns) == ["vpp_stage", "name", "step", "micro_step", "loss", "shape", "dtype"]
    got = {(r.step, r.micro_step): r.loss for r in loss.itertuples(index=False)}
    want = {(s, m): v for s, vs in truth.losses.items() for m, v in enumerate(vs)}
    assert got == want                                   # float32 losses, exactly, as float64
    assert set(loss["dtype"]) == {"torch.float32"} and set(loss["name"]) == {"loss"}


def test_a_loss_recorded_after_the_optimizer_step_belongs_to_that_step(make_config, output_root):
    torch.manual_seed(0)
    model = TinyGPT(SMALL)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(make_config(step_interval=2)).set_monitor(model, optimizer=opt)
    data = synthetic_batches(SMALL, 2, 4, seed=1)
    want = {}
    for step in range(4):
        loss = model.loss(next(data))
        loss.backward()
        opt.step()
        opt.zero_grad()
        monitor.record_loss(loss)                          # after the step, as HF's on_step_end sees it
        monitor.record_loss(loss.item() * 2)               # a plain number too
        want[step] = [loss.item(), loss.item() * 2]
    monitor.close()
    df = read_family(monitor.run_dir / "rank0", "loss")
    got = {(r.step, r.micro_step): r.loss for r in df.itertuples(index=False)}
    assert got == {(s, m): v for s, vs in want.items() if s % 2 == 0 for m, v in enumerate(vs)}


def test_record_loss_before_set_monitor_or_with_junk_never_raises(make_config, output_root, caplog):
    monitor = TrainerMon(make_config())
    monitor.record_loss(torch.tensor(1.0))                 # nothing attached yet: ignored
    model = TinyGPT(SMALL)
    monitor.set_monitor(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    monitor.record_loss("not a loss")
    monitor.close()
    assert "record_loss takes a non-empty real tensor or a number, got str" in caplog.text


@pytest.mark.slow
def test_hyperparams_are_every_group_setting_as_the_step_applied_it(tmp_path):
    truth = train_run(tmp_path, {"loss_alignment": True}, steps=3, acc=1, schedule=True)
    hp = read_family(truth.run_dir / "rank0", "hyperparams")
    assert list(hp.columns) == ["vpp_stage", "name", "step", "group", "value", "shape", "dtype"]
    for step, groups in truth.groups.items():
        rows = hp[hp["step"] == step]
        want = {}
        for g, group in enumerate(groups):
            for key, value in group.items():
                if isinstance(value, tuple):
                    want.update({(g, f"{key}[{i}]"): float(v) for i, v in enumerate(value)})
                elif isinstance(value, (bool, int, float)):
                    want[(g, key)] = float(value)
        assert {(r.group, r.name): r.value for r in rows.itertuples(index=False)} == want
    lrs = hp[hp["name"] == "lr"].sort_values("step")["value"].tolist()
    assert lrs == [1e-3, 5e-4, 2.5e-4]                     # as StepLR left it for each step
    assert hp[(hp["name"] == "initial_lr")]["value"].tolist() == [1e-3] * 3


@pytest.mark.slow
def test_model_meta_describes_the_model_once(tmp_path):
    truth = train_run(tmp_path, {"loss_alignment": True}, steps=1, acc=1)
    meta = json.loads((truth.run_dir / "rank0" / "model_meta.json").read_text())
    torch.manual_seed(0)
    model = TinyGPT(SMALL)                                 # the same seed: the initial params
    (chunk,) = meta["chunks"]
    assert chunk["type"] == "TinyGPT" and chunk["vpp_stage"] == 0
    assert [m["name"] for m in chunk["modules"]] == ["root"] + [n for n, _ in model.named_modules()][1:]
    assert [(p["name"], p["shape"], p["dtype"], p["requires_grad"]) for p in chunk["params"]] == \
        [(n, list(p.shape), str(p.dtype), True) for n, p in model.named_parameters()]
    for p, (_, t) in zip(chunk["params"], model.named_parameters()):
        x = t.detach().double()
        assert p["init"] == {"norm": x.norm().item(), "mean": x.mean().item(), "min": x.min().item(),
                             "max": x.max().item()}


@pytest.mark.slow
def test_model_input_rows_are_the_batches_fed_to_the_model(tmp_path):
    truth = train_run(tmp_path, {"loss_alignment": True}, steps=2, acc=2)
    df = read_family(truth.run_dir / "rank0", "model_input")
    batches = synthetic_batches(SMALL, 4, 4, seed=1)
    for row in df.sort_values(["step", "micro_step"]).itertuples(index=False):
        x = next(batches)[:, :-1].double()           # TinyGPT.loss feeds all but the last token
        assert (row.name, row.dtype, row.shape) == ("input.0", "torch.int64", str(list(x.shape)))
        assert (row.mean, row.min, row.max) == (x.mean().item(), x.min().item(), x.max().item())
    assert sorted(zip(df["step"], df["micro_step"])) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def _loss_frames(fn) -> int:
    """Python frames of the loss collector's own code while ``fn`` runs."""
    import sys

    seen = [0]

    def profile(frame, event, _arg):
        if event == "call" and frame.f_code.co_filename.endswith("collectors/loss.py"):
            seen[0] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen[0]


@pytest.mark.parametrize("where", ["within the step", "after the step"])
def test_loss_recording_that_starts_mid_run_files_each_value_under_its_step(make_config, output_root, where):
    """Nothing of the loss collector runs until the first record_loss; that call, made steps after
    set_monitor, is filed under the right step whichever side of optimizer.step() it is on."""
    torch.manual_seed(0)
    model = TinyGPT(SMALL)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(make_config()).set_monitor(model, optimizer=opt)
    data = synthetic_batches(SMALL, 2, 6, seed=1)
    want, frames = {}, []

    def step(number: int) -> None:
        loss = model.loss(next(data))
        loss.backward()
        if number >= 3 and where == "within the step":
            monitor.record_loss(loss)
        opt.step()
        opt.zero_grad()
        if number >= 3 and where == "after the step":
            monitor.record_loss(loss)
            monitor.record_loss(loss.item() * 2)  # a second call before the step is known
        if number >= 3:
            want[(number, 0)] = loss.item()
            if where == "after the step":
                want[(number, 1)] = loss.item() * 2

    for number in range(6):
        frames.append(_loss_frames(lambda number=number: step(number)))
    monitor.close()
    assert frames[1] == frames[2] == 0  # before record_loss: no forward hook, no step-end call
    df = read_family(monitor.run_dir / "rank0", "loss")
    assert {(r.step, r.micro_step): r.loss for r in df.itertuples(index=False)} == pytest.approx(want)


def test_a_first_late_call_on_the_last_step_is_filed_at_close(make_config, output_root):
    torch.manual_seed(0)
    model = TinyGPT(SMALL)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(make_config()).set_monitor(model, optimizer=opt)
    data = synthetic_batches(SMALL, 2, 4, seed=1)
    for _ in range(3):
        loss = model.loss(next(data))
        loss.backward()
        opt.step()
        opt.zero_grad()
    monitor.record_loss(loss)  # after the last step, as a Trainer's final on_step_end
    monitor.close()
    df = read_family(monitor.run_dir / "rank0", "loss")
    assert [(r.step, r.micro_step, r.loss) for r in df.itertuples(index=False)] == [(2, 0, pytest.approx(loss.item()))]
