"""TrainerMon end to end in one process: every value against the tensors themselves."""
from __future__ import annotations

import logging
import math
from collections import defaultdict

import pytest
import torch

from tests._support.runs import only_run_dir, read_family, reference_stats
from trainmon import ConfigError, TrainerMon
from trainmon.testing.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches
from trainmon.stats import _fused_cpu

OPS = ["norm", "mean", "min", "max", "std", "zeros", "nans", "infs"]
ALL_ON = dict(wg_distribution=True, mv_distribution=True, param_distribution=True, ur_distribution=True,
              ops=OPS)
SMALL = GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=2)


def make_model(dtype=torch.float32, cfg=SMALL, seed=0):
    torch.manual_seed(seed)
    return TinyGPT(cfg).to(dtype)


def train_with_reference(model, optimizer, steps, acc):
    """Train and record, for every step, the truth of each family straight from the tensors."""
    truth = defaultdict(dict)          # (family, step) -> name -> stats
    names = {p: n for n, p in model.named_parameters()}
    data = synthetic_batches(model.cfg, 4, steps * acc, seed=1)
    losses = []
    for step in range(steps):
        for _ in range(acc):
            loss = model.loss(next(data)) / acc
            loss.backward()
        losses.append(loss.item())
        before = {p: p.detach().clone() for p in names}
        inner = getattr(optimizer, "optimizer", optimizer)
        for p, n in names.items():
            truth[("grad_unreduced", step)][n] = reference_stats(p.grad)
            truth[("grad_reduced", step)][n] = reference_stats(p.grad)
            truth[("param_origin", step)][n] = reference_stats(p)
        optimizer.step()
        for p, n in names.items():
            truth[("param_updated", step)][n] = reference_stats(p)
            for k in ("exp_avg", "exp_avg_sq"):
                if k in inner.state.get(p, {}):
                    truth[(k, step)][n] = reference_stats(inner.state[p][k])
            delta = (p.detach().double() - before[p].double()).norm() / before[p].double().norm()
            truth[("update_ratio", step)][n] = {"update_ratio": delta.item()}
        optimizer.zero_grad()
    return truth, losses


def assert_matches(df, truth, family, steps, ops, rtol=1e-5):
    assert sorted(df["step"].unique()) == list(steps), family
    for row in df.itertuples(index=False):
        want = truth[(family, row.step)][row.name]
        for op in ops:
            got, exp = getattr(row, op), want[op]
            if isinstance(exp, float) and math.isnan(exp):
                assert math.isnan(got), (family, row.name, op)
            else:
                atol = want.get("_mean_atol", 0.0) if op == "mean" else 1e-30
                assert got == pytest.approx(exp, rel=rtol, abs=atol), (family, row.step, row.name, op)
    names_per_step = df.groupby("step")["name"].apply(set)
    for step in steps:
        assert names_per_step[step] == set(truth[(family, step)]), (family, step)


@pytest.mark.parametrize("acc", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_family_equals_the_tensor_stats(output_root, make_config, acc, dtype):
    model = make_model(dtype)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    monitor = TrainerMon(make_config(**ALL_ON))
    monitor.set_monitor(model, grad_acc_steps=acc, optimizer=optimizer)
    truth, _ = train_with_reference(model, optimizer, steps=3, acc=acc)
    monitor.close()
    rank0 = only_run_dir(output_root) / "rank0"
    for family in ("grad_unreduced", "grad_reduced", "param_origin", "param_updated", "exp_avg", "exp_avg_sq"):
        df = read_family(rank0, family)
        assert list(df.columns) == ["vpp_stage", "name", "step", *OPS, "shape", "dtype"]
        assert (df["dtype"] == str(dtype)).all()
        assert_matches(df, truth, family, range(3), OPS)
    # The fused kernel takes a bf16 param's difference in float (exact); torch's ops, without
    # it, round that difference to bf16: a looser check there.
    ur = read_family(rank0, "update_ratio")
    exact = dtype == torch.float32 or _fused_cpu.enabled()
    assert_matches(ur, truth, "update_ratio", range(3), ["update_ratio"], rtol=1e-5 if exact else 2e-2)


def test_shape_and_names_are_the_unwrapped_ones(output_root, make_config):
    model = make_model()
    compiled_like = torch.nn.Module()
    compiled_like._orig_mod = model  # the attribute torch.compile's wrapper uses
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with TrainerMon(make_config(wg_distribution=True, ops=["norm"])) as monitor:
        monitor.set_monitor(compiled_like, optimizer=optimizer)
        train_with_reference(model, optimizer, 1, 1)
    df = read_family(only_run_dir(output_root) / "rank0", "grad_reduced")
    assert set(df["name"]) == {n for n, _ in model.named_parameters()}
    assert df.loc[df["name"] == "output.weight", "shape"].item() == "[32, 16]"


def test_training_is_bitwise_identical_with_and_without_monitor(output_root, make_config):
    def run(with_monitor):
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        monitor = None
        if with_monitor:
            monitor = TrainerMon(make_config(**ALL_ON))
            monitor.set_monitor(model, grad_acc_steps=2, optimizer=optimizer)
        _, losses = train_with_reference(model, optimizer, steps=4, acc=2)
        if monitor:
            monitor.close()
        return losses, [p.detach().clone() for p in model.parameters()]

    base_losses, base_params = run(False)
    mon_losses, mon_params = run(True)
    assert base_losses == mon_losses
    assert all(torch.equal(a, b) for a, b in zip(base_params, mon_params))


def _hook_state(model, optimizer):
    return (dict(vars(optimizer)).keys(), len(optimizer._optimizer_step_pre_hooks),
            len(optimizer._optimizer_step_post_hooks), type(optimizer).step is optimizer.step.__func__,
            [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()],
            [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)) for m in model.modules()])


def test_close_restores_optimizer_and_model(output_root, make_config):
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters())
    before = _hook_state(model, optimizer)
    monitor = TrainerMon(make_config(**ALL_ON))
    monitor.set_monitor(model, optimizer=optimizer)
    assert _hook_state(model, optimizer) != before
    train_with_reference(model, optimizer, 1, 1)
    monitor.close()
    monitor.close()  # idempotent
    assert _hook_state(model, optimizer) == before


def test_close_restores_a_wrapper_optimizer_step(output_root, make_config):
    class Wrapper:  # like Megatron's optimizers: not a torch Optimizer, has .step()
        def __init__(self, inner):
            self.optimizer = inner

        def step(self):
            self.optimizer.step()
            return True, None, None

        def zero_grad(self):
            self.optimizer.zero_grad()

    model = make_model()
    wrapper = Wrapper(torch.optim.Adam(model.parameters()))
    monitor = TrainerMon(make_config(wg_distribution=True, param_distribution=True, ops=["norm"]))
    monitor.set_monitor(model, optimizer=wrapper)
    assert "step" in vars(wrapper)
    train_with_reference(model, wrapper, 2, 1)
    assert wrapper.step() == (True, None, None)
    monitor.close()
    assert "step" not in vars(wrapper)
    assert set(read_family(only_run_dir(output_root) / "rank0", "param_updated")["step"]) == {0, 1, 2}


def test_schedule_selects_steps_and_goes_idle(output_root, make_config):
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters())
    monitor = TrainerMon(make_config(wg_distribution=True, start_step=2, step_interval=3, collect_times=3,
                                     ops=["norm"]))
    monitor.set_monitor(model, optimizer=optimizer)
    train_with_reference(model, optimizer, 9, 1)
    # collect_times reached at step 8: every hook is gone while training goes on
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    assert not optimizer._optimizer_step_pre_hooks
    train_with_reference(model, optimizer, 3, 1)
    monitor.close()
    rank0 = only_run_dir(output_root) / "rank0"
    for family in ("grad_unreduced", "grad_reduced"):
        assert sorted(read_family(rank0, family)["step"].unique()) == [2, 5, 8]


def test_step_windows_and_start_iteration(output_root, make_config):
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters())
    with TrainerMon(make_config(param_distribution=True, step_count_per_record=3, ops=["max"])) as monitor:
        monitor.set_monitor(model, optimizer=optimizer, start_iteration=100)
        train_with_reference(model, optimizer, 5, 1)
    rank0 = only_run_dir(output_root) / "rank0"
    files = sorted(p.name for p in rank0.glob("param_updated_*.csv"))
    assert files == ["param_updated_102-104.csv", "param_updated_99-101.csv"]
    import pandas as pd
    assert sorted(pd.read_csv(rank0 / "param_updated_99-101.csv")["step"].unique()) == [100, 101]
    assert sorted(pd.read_csv(rank0 / "param_updated_102-104.csv")["step"].unique()) == [102, 103, 104]


def test_grad_acc_steps_callable_is_read_once_per_step(output_root, make_config):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = [1, 2, 3]
    reads = iter(plan + [3])           # batch-size ramp-up: read at each step start
    monitor = TrainerMon(make_config(wg_distribution=True, ops=["norm"]))
    monitor.set_monitor(model, grad_acc_steps=lambda: next(reads), optimizer=optimizer)
    truth = {}
    for step, n in enumerate(plan):
        t, _ = train_with_reference(model, optimizer, 1, n)
        truth[step] = t[("grad_unreduced", 0)]
    monitor.close()
    df = read_family(only_run_dir(output_root) / "rank0", "grad_unreduced")
    for row in df.itertuples():
        assert row.norm == pytest.approx(truth[row.step][row.name]["norm"], rel=1e-5)
    assert sorted(df["step"].unique()) == [0, 1, 2]


def test_targets_select_on_dotted_boundaries(output_root, make_config):
    model = make_model(cfg=GPTConfig(vocab=16, seq=4, dim=8, heads=2, layers=11))
    optimizer = torch.optim.Adam(model.parameters())
    with TrainerMon(make_config(param_distribution=True, targets=["module.layers.1", "output"],
                                ops=["norm"])) as monitor:
        monitor.set_monitor(model, optimizer=optimizer)
        train_with_reference(model, optimizer, 1, 1)
    names = set(read_family(only_run_dir(output_root) / "rank0", "param_origin")["name"])
    assert names == {n for n, _ in model.named_parameters() if n.startswith("layers.1.")} | {"output.weight"}


def test_unmatched_target_is_an_error_with_close_matches(output_root, make_config):
    model = make_model()
    monitor = TrainerMon(make_config(param_distribution=True, targets=["layers.1.atn", "layers.0"]))
    with pytest.raises(ConfigError) as err:
        monitor.set_monitor(model, optimizer=torch.optim.Adam(model.parameters()))
    assert err.value.problems[0].key == "targets[0]"
    assert "'layers.1.atn' matches no module or parameter of the model (did you mean 'layers.1.attn'" \
        in str(err.value)
    assert len(err.value.problems) == 1


def test_bad_config_raises_before_training(output_root, make_config):
    with pytest.raises(ConfigError, match="wg_distrbution: unknown key"):
        TrainerMon(make_config(wg_distrbution=True))


def test_failing_collector_is_switched_off_and_training_continues(output_root, make_config, caplog):
    from trainmon.collectors import optimizer_state

    class Broken:
        def moments(self, param):
            raise RuntimeError("adapter bug")

    optimizer_state.register_moment_adapter(lambda opt: Broken() if getattr(opt, "_broken", False) else None)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters())
    optimizer._broken = True
    with caplog.at_level(logging.ERROR, logger="trainmon"):
        with TrainerMon(make_config(mv_distribution=True, param_distribution=True, ops=["norm"])) as monitor:
            monitor.set_monitor(model, optimizer=optimizer)
            _, losses = train_with_reference(model, optimizer, 3, 1)
    failures = [r for r in caplog.records if "collector 'optimizer_state' failed" in r.getMessage()]
    assert len(failures) == 1
    rank0 = only_run_dir(output_root) / "rank0"
    assert read_family(rank0, "exp_avg").empty
    assert sorted(read_family(rank0, "param_updated")["step"].unique()) == [0, 1, 2]
    assert len(losses) == 3


def test_unwritable_output_warns_once_and_training_continues(tmp_path, monkeypatch, make_config, caplog):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(blocker / "out"))
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters())
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        with TrainerMon(make_config(**ALL_ON)) as monitor:
            monitor.set_monitor(model, optimizer=optimizer)
            _, losses = train_with_reference(model, optimizer, 2, 1)
    assert monitor.run_dir is None and len(losses) == 2
    assert len([r for r in caplog.records if "cannot create output directory" in r.getMessage()]) == 1


def test_main_grad_is_read_when_params_carry_it(output_root, make_config):
    model = make_model()
    for p in model.parameters():
        p.main_grad = torch.full_like(p, 2.0)   # what Megatron's DDP attaches
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with TrainerMon(make_config(wg_distribution=True, ops=["max", "min"])) as monitor:
        monitor.set_monitor(model, optimizer=optimizer)
        train_with_reference(model, optimizer, 1, 1)
    df = read_family(only_run_dir(output_root) / "rank0", "grad_reduced")
    assert (df["max"] == 2.0).all() and (df["min"] == 2.0).all()
    assert read_family(only_run_dir(output_root) / "rank0", "grad_unreduced").empty


def test_optimizer_without_moments_gets_a_warning(output_root, make_config, caplog):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        with TrainerMon(make_config(mv_distribution=True, param_distribution=True, ops=["norm"])) as monitor:
            monitor.set_monitor(model, optimizer=optimizer)
            train_with_reference(model, optimizer, 2, 1)
    assert any("has no exp_avg/exp_avg_sq state" in r.getMessage() for r in caplog.records)
    assert not read_family(only_run_dir(output_root) / "rank0", "param_updated").empty


def test_ndigits_means_significant_digits(output_root, make_config):
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters())
    with TrainerMon(make_config(mv_distribution=True, ndigits=3, ops=["norm"])) as monitor:
        monitor.set_monitor(model, optimizer=optimizer)
        truth, _ = train_with_reference(model, optimizer, 1, 1)
    df = read_family(only_run_dir(output_root) / "rank0", "exp_avg_sq")
    for row in df.itertuples():
        exp = truth[("exp_avg_sq", 0)][row.name]["norm"]
        assert row.norm != 0 and row.norm == float(f"{exp:.3g}")


def test_manual_step_without_optimizer(output_root, make_config):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with TrainerMon(make_config(wg_distribution=True, ops=["norm"])) as monitor:
        monitor.set_monitor(model)
        for step in range(2):
            model.loss(next(synthetic_batches(model.cfg, 2, 1))).backward()
            monitor.step()
            optimizer.step()
            optimizer.zero_grad()
    assert sorted(read_family(only_run_dir(output_root) / "rank0", "grad_reduced")["step"].unique()) == [0, 1]


def test_ranks_outside_module_ranks_do_no_work(output_root, make_config):
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters())
    before = _hook_state(model, optimizer)
    with TrainerMon(make_config(wg_distribution=True, module_ranks=[1])) as monitor:
        monitor.set_monitor(model, optimizer=optimizer)
        assert [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()] == before[4]
        train_with_reference(model, optimizer, 2, 1)
    assert not list(only_run_dir(output_root).glob("rank*/*.csv"))
