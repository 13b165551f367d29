"""Dynamic mode in one process, driven directly: the stager with an injected clock (no sleeps,
no watcher thread) and the controller switching real sessions on a real model."""
from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

from tests._support.runs import only_run_dir, read_family, reference_stats
from trainmon import ConfigError, TrainerMon
from trainmon.config import load_config
from trainmon.dynamic import ConfigStager, WatchSettings, dynamic_requested
from trainmon.testing.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches

SMALL = GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=2)


# ----------------------------------------------------------------------------- environment

@pytest.mark.parametrize("value, on", [("True", True), ("true", True), ("TRUE", True), ("1", True),
                                       ("false", False), ("0", False), ("", False), (None, False)])
def test_dynamic_monitor_switch_values(value, on):
    assert dynamic_requested({} if value is None else {"DYNAMIC_MONITOR": value}) is on


def test_bad_environment_values_are_errors_naming_the_variable():
    with pytest.raises(ConfigError) as err:
        dynamic_requested({"DYNAMIC_MONITOR": "yes"})
    assert str(err.value) == ("1 problem in environment\n  DYNAMIC_MONITOR: 'yes' is not a switch "
                              "(allowed, any case: true, 1, false, 0)")
    with pytest.raises(ConfigError, match=r"TRAINMON_WATCH_INTERVAL: '-1' is not a number of seconds "
                                          r"\(finite number > 0\)"):
        WatchSettings.from_env({"TRAINMON_WATCH_INTERVAL": "-1"})
    with pytest.raises(ConfigError, match="TRAINMON_WATCH_POLLING: 'on' is not a switch"):
        WatchSettings.from_env({"TRAINMON_WATCH_POLLING": "on"})
    s = WatchSettings.from_env({"TRAINMON_WATCH_POLLING": "1", "TRAINMON_WATCH_INTERVAL": "0.5",
                                "TRAINMON_WATCH_SETTLE": "2", "TRAINMON_DYNAMIC_TIMEOUT": "30"})
    assert s == WatchSettings(polling=True, interval_s=0.5, settle_s=2.0, timeout_s=30.0)


def test_polling_is_decided_by_the_file_system_unless_set_and_the_step_check_has_a_default():
    assert WatchSettings.from_env({}).polling is None                 # unset: by the file system
    assert WatchSettings.from_env({"TRAINMON_WATCH_POLLING": ""}).polling is None
    assert WatchSettings.from_env({"TRAINMON_WATCH_POLLING": "false"}).polling is False
    assert WatchSettings.from_env({}).step_check_s == 2.0
    assert WatchSettings.from_env({"TRAINMON_WATCH_STEP_CHECK": "0.5"}).step_check_s == 0.5
    with pytest.raises(ConfigError, match=r"TRAINMON_WATCH_STEP_CHECK: 'often' is not a number of seconds"):
        WatchSettings.from_env({"TRAINMON_WATCH_STEP_CHECK": "often"})


def test_trainer_mon_rejects_a_bad_dynamic_monitor_value(monkeypatch, make_config, output_root):
    monkeypatch.setenv("DYNAMIC_MONITOR", "maybe")
    with pytest.raises(ConfigError, match="DYNAMIC_MONITOR: 'maybe' is not a switch"):
        TrainerMon(make_config(dynamic_on=True))


# ----------------------------------------------------------------------------- the stager

@pytest.fixture
def conf(tmp_path):
    path = tmp_path / "monitor_config.json"

    def write(text: str | dict) -> None:
        path.write_text(text if isinstance(text, str) else json.dumps(text))
    write({"dynamic_on": False})
    return path, write


def test_changes_are_read_once_after_they_rest(conf):
    path, write = conf
    reads = []
    stager = ConfigStager(path, lambda p: reads.append(p) or load_config(p), settle_s=1.0)
    assert stager.settle(100.0) is None and stager.due_in(100.0) is None  # nothing changed yet
    write({"dynamic_on": True, "wg_distribution": True})
    stager.note_change(10.0)
    stager.note_change(10.5)                    # a save arriving as several events
    assert stager.due_in(11.0) == pytest.approx(0.5)
    assert stager.settle(11.0) is None and not reads
    decision = stager.settle(11.5)
    assert decision.version == 1 and decision.on and decision.config.wg_distribution
    assert stager.decision is decision and len(reads) == 1
    assert stager.settle(50.0) is None and len(reads) == 1  # consumed
    write({"dynamic_on": False, "wg_distribution": True})
    stager.note_change(60.0)
    off = stager.settle(61.0)
    assert off.version == 2 and not off.on and off.config is None
    stager.note_change(70.0)                    # saved again, same text: a new version
    assert stager.settle(71.0).version == 3


def test_invalid_file_is_logged_once_and_keeps_the_state(conf, caplog):
    path, write = conf
    stager = ConfigStager(path, load_config, settle_s=0.0)
    write({"dynamic_on": True, "param_distribution": True})
    stager.note_change(0.0)
    good = stager.settle(0.0)
    write('{"dynamic_on": true, "ops": ["norm"')
    stager.note_change(1.0)
    with caplog.at_level(logging.ERROR, logger="trainmon"):
        assert stager.settle(1.0) is None
        assert stager.settle(2.0) is None       # not retried until the next change
    assert stager.decision is good
    [record] = caplog.records
    assert record.getMessage() == (
        "trainmon: dynamic: the edited config is NOT applied; monitoring stays as it was (last valid "
        f"version: 1) until the next change. 1 problem in {path}\n"
        "  invalid JSON at line 1, column 36: Expecting ',' delimiter")
    write({"dynamic_on": True, "param_distribution": True, "step_interval": 0, "opps": []})
    stager.note_change(3.0)
    with caplog.at_level(logging.ERROR, logger="trainmon"):
        assert stager.settle(3.0) is None
    assert "step_interval: 0 is out of range" in caplog.records[-1].getMessage()
    assert "opps: unknown key (did you mean 'ops'?)" in caplog.records[-1].getMessage()
    write({"dynamic_on": True, "param_distribution": True, "ops": ["max"]})
    stager.note_change(4.0)
    fixed = stager.settle(4.0)
    assert fixed.version == 2 and fixed.config.ops == ("max",)


def test_a_read_overtaken_by_a_newer_write_is_dropped(conf):
    path, write = conf
    stager = None

    def validate(p):
        cfg = load_config(p)
        if cfg.step_interval == 1:               # a newer save lands while we read this one
            write({"dynamic_on": True, "wg_distribution": True, "step_interval": 2})
            stager.note_change(5.0)
        return cfg

    stager = ConfigStager(path, validate, settle_s=1.0)
    write({"dynamic_on": True, "wg_distribution": True})
    stager.note_change(0.0)
    assert stager.settle(1.0) is None and stager.decision.version == 0
    decision = stager.settle(6.0)
    assert decision.version == 1 and decision.config.step_interval == 2


def test_a_validator_bug_is_logged_and_not_raised(conf, caplog):
    path, _ = conf
    stager = ConfigStager(path, lambda p: 1 / 0, settle_s=0.0)
    stager.note_change(0.0)
    with caplog.at_level(logging.ERROR, logger="trainmon"):
        assert stager.settle(0.0) is None
    assert "reading" in caplog.records[0].getMessage() and caplog.records[0].exc_info


# ----------------------------------------------------------------------------- the controller

@pytest.fixture
def dynamic(monkeypatch, output_root):
    monkeypatch.setenv("DYNAMIC_MONITOR", "1")
    return output_root


class Job:
    """A model, its optimizer and a dynamic monitor whose stager the test drives by hand."""

    def __init__(self, path, seed=0, optimizer=True, start_iteration=0):
        torch.manual_seed(seed)
        self.model = TinyGPT(SMALL)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.data = synthetic_batches(SMALL, 4, 10_000, seed=1)
        self.path = path
        self.mon = TrainerMon(path)
        self.mon.watch_settings = dataclasses.replace(self.mon.watch_settings, watch=False)
        self.mon.set_monitor(self.model, optimizer=self.opt if optimizer else None,
                             start_iteration=start_iteration)
        self.stager = self.mon._driver.stager
        self.clock = 0.0
        self.truth = {}
        self.losses = []

    def edit(self, keys: dict | str) -> None:
        self.path.write_text(keys if isinstance(keys, str) else json.dumps(keys))
        self.clock += 10.0
        self.stager.note_change(self.clock)
        self.stager.settle(self.clock + 10.0)

    def train(self, steps: int) -> None:
        names = {p: n for n, p in self.model.named_parameters()}
        for _ in range(steps):
            loss = self.model.loss(next(self.data))
            loss.backward()
            self.losses.append(loss.item())
            step = self.mon.current_step
            self.truth[step] = {n: reference_stats(p.grad)["norm"] for p, n in names.items()}
            self.opt.step()
            self.opt.zero_grad()

    def grad_hooks(self) -> int:
        return sum(len(p._post_accumulate_grad_hooks or {}) for p in self.model.parameters())


def steps_of(root, family):
    df = read_family(only_run_dir(root) / "rank0", family)
    return [] if df.empty else sorted(int(s) for s in df["step"].unique())


def test_off_on_change_off_with_real_steps_and_values(dynamic, make_config, caplog):
    job = Job(make_config(dynamic_on=False, wg_distribution=True))
    job.train(3)
    assert job.grad_hooks() == 0 and len(job.opt._optimizer_step_pre_hooks) == 1
    with caplog.at_level(logging.INFO, logger="trainmon"):
        caplog.clear()                           # set_monitor's "staying off" is not asked about here
        job.edit({"dynamic_on": True, "wg_distribution": True, "ops": ["norm"]})
        job.train(1)                             # the boundary after step 3 applies it
        assert job.grad_hooks() > 0
        job.train(3)                             # steps 4, 5, 6 collected
        job.edit({"dynamic_on": True, "param_distribution": True, "ops": ["max"]})
        job.train(3)                             # 7 still weight grads; 8, 9 params
        job.edit({"dynamic_on": False, "param_distribution": True})
        job.train(3)                             # 10 still params, then off
    assert job.grad_hooks() == 0
    job.mon.close()
    assert len(job.opt._optimizer_step_pre_hooks) == 0  # close removes the boundary hook too
    assert steps_of(dynamic, "grad_reduced") == [4, 5, 6, 7]
    assert steps_of(dynamic, "param_updated") == [8, 9, 10]
    df = read_family(only_run_dir(dynamic) / "rank0", "grad_reduced")
    for row in df.itertuples():                  # each row holds the stats of its real step
        assert row.norm == pytest.approx(job.truth[row.step][row.name], rel=1e-5)
    messages = [r.getMessage() for r in caplog.records if "dynamic: step" in r.getMessage()]
    assert [m.split(":", 3)[2].strip() for m in messages] == ["step 4", "step 8", "step 11"]
    assert "weight grads; ops norm; targets all; from step 4 every step, until switched off; " \
           "format csv" in messages[0]
    assert "config version 4 sets dynamic_on false" in messages[2]


def test_collect_times_counts_from_the_switch_and_start_step(dynamic, make_config):
    job = Job(make_config(dynamic_on=False), start_iteration=100)
    job.train(2)
    job.edit({"dynamic_on": True, "wg_distribution": True, "collect_times": 2, "step_interval": 2,
              "start_step": 5, "ops": ["norm"]})  # start_step long passed: from the next step
    job.train(8)                                 # applied after 102: collects 103, 105; idle after
    assert job.grad_hooks() == 0 and job.mon._driver.session is None
    job.edit({"dynamic_on": True, "wg_distribution": True, "collect_times": 1, "start_step": 115,
              "ops": ["norm"]})                  # a future start_step is honoured
    job.train(8)
    job.mon.close()
    assert steps_of(dynamic, "grad_reduced") == [103, 105, 115]


def test_initial_file_with_dynamic_on_collects_from_the_first_step(dynamic, make_config):
    job = Job(make_config(dynamic_on=True, param_distribution=True, collect_times=2, ops=["norm"]))
    job.train(4)
    job.mon.close()
    assert steps_of(dynamic, "param_origin") == [0, 1]


def test_config_that_does_not_fit_the_model_keeps_the_state(dynamic, make_config, caplog):
    job = Job(make_config(dynamic_on=True, param_distribution=True, ops=["norm"]))
    job.train(2)
    with caplog.at_level(logging.ERROR, logger="trainmon"):
        job.edit({"dynamic_on": True, "wg_distribution": True, "targets": ["layers.7"]})
        job.edit({"dynamic_on": True, "xy_distribution": True})
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert "'layers.7' matches no module or parameter of the model" in errors[0]
    assert "xy_distribution: true needs targets (the modules to record) or all_xy: true" in errors[1]
    job.train(2)
    job.mon.close()
    assert steps_of(dynamic, "param_origin") == [0, 1, 2, 3]
    assert steps_of(dynamic, "grad_reduced") == []


def test_training_is_identical_with_dynamic_switching(dynamic, make_config):
    def run(switch: bool):
        job = Job(make_config(dynamic_on=False, wg_distribution=True))
        for _ in range(3):
            if switch:
                job.edit({"dynamic_on": True, "wg_distribution": True, "mv_distribution": True,
                          "param_distribution": True, "ur_distribution": True})
            job.train(2)
            if switch:
                job.edit({"dynamic_on": False})
            job.train(1)
        job.mon.close()
        return job.losses, [p.detach().clone() for p in job.model.parameters()]

    base_losses, base_params = run(False)
    dyn_losses, dyn_params = run(True)
    assert base_losses == dyn_losses
    assert all(torch.equal(a, b) for a, b in zip(base_params, dyn_params))


def test_manual_step_boundary_in_dynamic_mode(dynamic, make_config):
    job = Job(make_config(dynamic_on=True, wg_distribution=True, ops=["norm"]), optimizer=False)
    for _ in range(2):
        job.model.loss(next(job.data)).backward()
        job.mon.step()
        job.opt.step()
        job.opt.zero_grad()
    assert job.mon.current_step == 2
    job.mon.close()
    assert steps_of(dynamic, "grad_reduced") == [0, 1]


def test_dynamic_on_without_dynamic_monitor_warns_and_monitors(output_root, make_config, caplog):
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        mon = TrainerMon(make_config(dynamic_on=True, wg_distribution=True, ops=["norm"]))
    assert "has an effect only with DYNAMIC_MONITOR=true" in caplog.records[0].getMessage()
    model = TinyGPT(SMALL)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon.set_monitor(model, optimizer=opt)
    model.loss(next(synthetic_batches(SMALL, 2, 1))).backward()
    opt.step()
    mon.close()
    assert steps_of(output_root, "grad_reduced") == [0]


def test_native_observer_failure_falls_back_to_polling(dynamic, make_config, monkeypatch, caplog):
    import watchdog.observers

    class Unavailable:  # what a full inotify watch table looks like to us: scheduling raises
        def __init__(self, *a, **k):
            pass

        def schedule(self, *a, **k):
            raise OSError(28, "inotify watch limit reached")

    monkeypatch.setattr(watchdog.observers, "Observer", Unavailable)
    mon = TrainerMon(make_config(dynamic_on=False))
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        mon.set_monitor(TinyGPT(SMALL))
    assert mon._driver.watcher.kind == "polling"
    assert any("the native file watcher cannot start" in r.getMessage() and "inotify watch limit" in r.getMessage()
               for r in caplog.records)
    mon.close()
    assert mon._driver is None
