"""Steps a real ``torch.amp.GradScaler`` skips, with fp16 autocast on the CPU.

A large initial loss scale makes the fp16 backward overflow for the first iterations (the scaler
skips them and halves the scale each time, as in any AMP run's first steps); one more Inf is
injected into a grad later.  The truth comes from the training loop itself: a step was skipped
when the params did not change, and the grads' Inf/NaN counts are counted in the test.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn

from tests._support.runs import only_run_dir, read_family, run_cli

STEPS, INJECT = 14, 10
CONFIG = {"wg_distribution": True, "param_distribution": True, "mv_distribution": True,
          "ops": ["norm", "nans", "infs"], "alert": {"rules": [{"rule_name": "AnomalyNan"}]}}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _train(model, monitor=None):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    if monitor is not None:
        monitor.set_monitor(model, optimizer=opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 18, growth_interval=1000)
    gen = torch.Generator().manual_seed(1)
    truth = []
    for step in range(STEPS):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if step == INJECT:
            model[0].weight.grad[0, 0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        scale = scaler.get_scale()
        scaler.step(opt)
        skipped = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        bad = {n: (int(torch.isnan(p.grad).sum()), int(torch.isinf(p.grad).sum()))
               for n, p in model.named_parameters()}
        truth.append((skipped, scale, bad))
        scaler.update()
        opt.zero_grad()
    return truth


def test_skipped_steps_keep_their_number_their_grads_and_no_param_rows(tmp_path, monkeypatch):
    from trainmon import TrainerMon

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    plain = _model()
    expected = _train(plain)
    skipped = [s for s, (sk, _, _) in enumerate(expected) if sk]
    assert skipped[:2] == [0, 1] and INJECT in skipped and len(skipped) < STEPS - 3  # the setup is real
    (tmp_path / "c.json").write_text(json.dumps(CONFIG))
    model, mon = _model(), TrainerMon(tmp_path / "c.json")
    truth = _train(model, mon)
    assert mon.current_step == STEPS
    mon.close()
    assert [t[:2] for t in truth] == [e[:2] for e in expected]                   # same skips, same scales
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))  # bitwise
    rank = only_run_dir(tmp_path / "out") / "rank0"
    steps = read_family(rank, "steps").sort_values("step")
    assert list(steps["step"]) == list(range(STEPS)) and set(steps["name"]) == {"optimizer"}
    assert list(steps["skipped"]) == [int(sk) for sk, _, _ in truth]
    assert list(steps["loss_scale"]) == [scale for _, scale, _ in truth]
    # the file as docs/amp.md shows it: these columns, ``skipped`` an integer cell (not "1.0")
    first = min(rank.glob("steps_0-*.csv")).read_text().splitlines()[:2]
    assert first == ["vpp_stage,name,step,skipped,loss_scale,shape,dtype", f"0,optimizer,0,1,{truth[0][1]!r},[],"]
    done = [s for s in range(STEPS) if s not in skipped]
    for family in ("param_origin", "param_updated", "exp_avg", "exp_avg_sq"):
        assert sorted(read_family(rank, family)["step"].unique()) == done, family
    grads = read_family(rank, "grad_reduced")
    assert sorted(grads["step"].unique()) == list(range(STEPS))
    for step, (_, _, bad) in enumerate(truth):       # each iteration's own grads, under its own number
        rows = grads[grads["step"] == step].set_index("name")
        for name, (nans, infs) in bad.items():
            assert (rows.loc[name, "nans"], rows.loc[name, "infs"]) == (nans, infs), (step, name)
    assert grads[grads["step"] == INJECT].set_index("name").loc["0.weight", "infs"] >= 1
    unreduced = read_family(rank, "grad_unreduced")
    assert sorted(unreduced["step"].unique()) == list(range(STEPS))
    assert len(unreduced) == 4 * STEPS                 # one row per param per step: nothing merged


def test_the_grad_scaler_patch_is_removed_with_the_last_monitor(tmp_path, monkeypatch):
    from trainmon import TrainerMon

    original = torch.amp.GradScaler.step
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    (tmp_path / "c.json").write_text(json.dumps(CONFIG))
    mon = TrainerMon(tmp_path / "c.json")
    model = _model()
    mon.set_monitor(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert torch.amp.GradScaler.step is not original
    mon.close()
    assert torch.amp.GradScaler.step is original


@pytest.mark.slow   # runs the command in fresh processes
def test_anomalies_report_skipped_steps_as_such_and_a_run_of_them_as_a_finding(tmp_path, monkeypatch):
    from trainmon import TrainerMon

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    (tmp_path / "c.json").write_text(json.dumps(CONFIG))
    mon = TrainerMon(tmp_path / "c.json")
    truth = _train(_model(), mon)
    mon.close()
    skipped = [s for s, (sk, _, _) in enumerate(truth) if sk]
    assert skipped == [0, 1, INJECT]
    expect = [(0, "skipped", truth[0][1]), (1, "skipped_run", truth[1][1]), (INJECT, "skipped", truth[INJECT][1])]
    run = only_run_dir(tmp_path / "out")
    # the run-time alerts: the skip is reported once, on the steps row; its Inf grads are not
    lines = [json.loads(x) for x in (run / "rank0" / "anomalies.jsonl").read_text().splitlines()]
    assert [(a["step"], a["rule"], a["value"]) for a in lines] == expect
    assert {(a["kind"], a["name"], a["op"]) for a in lines} == {("steps", "optimizer", "skipped")}
    # the offline scan finds the same, and merging the two adds nothing
    for extra in ((), ("--no-runtime",)):
        out = run_cli("anomalies", str(run), "--json", *extra)
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        assert [(a["step"], a["rule"], a["value"]) for a in doc["anomalies"]] == expect
    text = run_cli("anomalies", str(run)).stdout
    assert "skipped_run" in text and "first: step 0" in text


def test_a_step_megatrons_loss_scaler_skips_has_its_grads_and_no_param_rows(tmp_path, monkeypatch):
    """The Megatron stand-in (tests/_support/fake_megatron.py: the real classes' names and step()
    contract, (False, None, None) on an fp16 overflow) with a constant loss scale of 8."""
    from tests._support import fake_megatron as fm
    from trainmon import TrainerMon

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    (tmp_path / "c.json").write_text(json.dumps(CONFIG))
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = fm.Float16OptimizerWithFloat16Params(torch.optim.Adam(model.parameters(), lr=0.1),
                                               fm.optimizer_config(fp16=True), fm.ConstantGradScaler(8.0))
    mon = TrainerMon(tmp_path / "c.json", params_have_main_grad=True)
    mon.set_monitor(model, optimizer=opt)
    gen = torch.Generator().manual_seed(2)
    results, grads = [], []
    for step in range(4):
        x = torch.randn(5, 3, generator=gen)
        model.zero_grad()
        (model(x).pow(2).mean() * 8.0).backward()          # Megatron scales the loss by the scale
        for p in model.parameters():
            p.main_grad = p.grad.detach().clone()
        if step == 2:
            model.weight.main_grad[0, 0] = float("inf")
        grads.append({n: p.main_grad / 8.0 for n, p in model.named_parameters()})
        results.append(opt.step()[0])
    mon.close()
    assert results == [True, True, False, True]
    rank = only_run_dir(tmp_path / "out") / "rank0"
    steps = read_family(rank, "steps").sort_values("step")
    assert list(steps["skipped"]) == [0, 0, 1, 0] and list(steps["loss_scale"]) == [8.0] * 4
    for family in ("param_origin", "param_updated", "exp_avg", "exp_avg_sq"):
        assert sorted(read_family(rank, family)["step"].unique()) == [0, 1, 3], family
    # grad_reduced is read where Megatron's optimizer applies the grads (after its unscale and clip);
    # a step its loss scaler skips applies none, so that step has no grad_reduced rows
    reduced = read_family(rank, "grad_reduced")
    assert sorted(reduced["step"].unique()) == [0, 1, 3]
    for step in (0, 1, 3):
        at = reduced[reduced["step"] == step].set_index("name")
        assert math.isclose(at.loc["bias", "norm"], grads[step]["bias"].double().norm().item(), rel_tol=1e-6)


def _deepspeed_job(rank, world, root):
    import os

    import deepspeed

    from trainmon import TrainerMon

    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
          "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True,
          "bf16": {"enabled": True, "check_grad_overflow": True}}
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.1),
                                             config=ds)
    os.environ["MONITOR_OUTPUT_DIR"] = str(root / "out")
    (root / "c.json").write_text(json.dumps(CONFIG))
    mon = TrainerMon(root / "c.json").set_monitor(engine, optimizer=opt)
    gen = torch.Generator().manual_seed(3)
    skipped = []
    for step in range(4):
        loss = engine(torch.randn(2, 5, generator=gen).to(torch.bfloat16)).float().pow(2).mean()
        engine.backward(loss * float("inf") if step == 2 else loss)
        before = [p.detach().clone() for p in model.parameters()]
        engine.step()
        skipped.append(all(torch.equal(a, b) for a, b in zip(before, model.parameters())))
    mon.close()
    return skipped


@pytest.mark.slow
def test_a_step_deepspeeds_overflow_check_skips_is_recorded_as_skipped(tmp_path):
    """Real DeepSpeed ZeRO-1 (bf16 with check_grad_overflow, which runs on the CPU): an Inf loss at
    step 2 makes DeepSpeed skip that step ("OVERFLOW! Skipping step")."""
    # The child process imports deepspeed: without it this test skips (a fresh README install has none).
    pytest.importorskip("deepspeed", reason="DeepSpeed not installed (.ci/run installs it)")
    from tests._support.distributed import run_distributed

    [skipped] = run_distributed(_deepspeed_job, 1, timeout=240, args=(tmp_path,))
    assert skipped == [False, False, True, False]
    rank = only_run_dir(tmp_path / "out") / "rank0"
    steps = read_family(rank, "steps").sort_values("step")
    assert list(steps["skipped"]) == [0, 0, 1, 0] and list(steps["loss_scale"]) == [1.0] * 4
    for family in ("param_origin", "param_updated", "exp_avg", "exp_avg_sq"):
        assert sorted(read_family(rank, family)["step"].unique()) == [0, 1, 3], family
    # the skipped iteration's grads are its pre-reduce rows, with their non-finite counts; DeepSpeed
    # applied none, so grad_reduced (read where its optimizer applies the clipped grads) has no rows then
    unreduced = read_family(rank, "grad_unreduced")
    assert sorted(unreduced["step"].unique()) == [0, 1, 2, 3]
    assert (unreduced[unreduced["step"] == 2]["nans"] + unreduced[unreduced["step"] == 2]["infs"] > 0).all()
    assert sorted(read_family(rank, "grad_reduced")["step"].unique()) == [0, 1, 3]
