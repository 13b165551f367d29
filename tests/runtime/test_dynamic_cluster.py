"""Dynamic mode on cluster file systems (issue 34, item 11): the file system type is read from the
mount table, a network file system is polled by default, and the step boundary's stat of the
config reads an edit that no observer reported, in a real training run."""

from __future__ import annotations

import json
import logging
import subprocess
import time

import pytest
import torch

import trainmon.dynamic as dynamic_module
from tests._support.runs import only_run_dir, read_family
from trainmon import TrainerMon
from trainmon.config import load_config
from trainmon.dynamic import ConfigStager, ConfigWatcher, WatchSettings, filesystem_type, network_filesystem
from trainmon.testing.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches

SMALL = GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=2)


def findmnt_type(path) -> str:
    """The type util-linux's findmnt reports for the mount holding ``path`` (independent truth)."""
    out = subprocess.run(["findmnt", "-n", "-o", "FSTYPE", "-T", str(path)], capture_output=True, text=True)
    if out.returncode != 0 or not out.stdout.strip():
        pytest.skip("findmnt is not available here")
    return out.stdout.split()[0]


@pytest.mark.parametrize("where", ["tmp", "proc", "dev"])
def test_filesystem_type_is_the_mount_tables(tmp_path, where):
    path = {"tmp": tmp_path, "proc": "/proc/self", "dev": "/dev"}[where]
    assert filesystem_type(path) == findmnt_type(path)


def test_the_statfs_fallback_names_a_local_file_system_as_not_network(tmp_path, monkeypatch):
    monkeypatch.setattr(dynamic_module, "_mountinfo_type", lambda real: None)  # no /proc
    fstype = filesystem_type(tmp_path)
    assert fstype and network_filesystem(tmp_path) == ""  # a magic number, not a network one


def test_mountinfo_escapes_and_the_innermost_mount_win(tmp_path, monkeypatch):
    table = tmp_path / "mountinfo"
    table.write_text(
        "22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
        "30 22 0:40 / /shared\\040data rw - nfs4 host:/export rw\n"
        "31 30 0:41 / /shared\\040data/scratch rw - lustre 10.0.0.1@tcp:/fs rw\n"
        "32 22 0:42 / /auto rw - autofs systemd-1 rw\n"
        "33 32 0:43 / /auto rw - nfs srv:/auto rw\n"
    )
    real_open = open
    monkeypatch.setattr(
        "builtins.open", lambda f, *a, **k: real_open(table if f == "/proc/self/mountinfo" else f, *a, **k)
    )
    monkeypatch.setattr(dynamic_module.os.path, "realpath", lambda p: str(p))
    assert filesystem_type("/shared data/cfg/monitor.json") == "nfs4"
    assert filesystem_type("/shared data/scratch/x.json") == "lustre"
    assert filesystem_type("/shared datax/x.json") == "ext4"  # a prefix of the name only
    assert filesystem_type("/auto/x.json") == "nfs"  # mounted over the autofs point
    assert network_filesystem("/shared data/scratch/x.json") == "lustre"


def _watch(path, settings: WatchSettings) -> ConfigWatcher:
    stager = ConfigStager(path, load_config, settle_s=settings.settle_s)
    watcher = ConfigWatcher(stager, settings).start()
    stager.stage_now(fallback=load_config(path))
    return watcher


@pytest.mark.slow
def test_a_network_file_system_is_polled_by_default_with_one_line(tmp_path, monkeypatch, caplog):
    config = tmp_path / "monitor_config.json"
    config.write_text(json.dumps({"dynamic_on": False, "wg_distribution": True}))
    monkeypatch.setattr(dynamic_module, "filesystem_type", lambda path: "nfs")  # the one seam
    settings = WatchSettings.from_env({})  # TRAINMON_WATCH_POLLING unset
    with caplog.at_level(logging.INFO, logger="trainmon"):
        watcher = _watch(config, settings)
    try:
        assert watcher.kind == "polling" and watcher.network == "nfs"
        said = [r.getMessage() for r in caplog.records if "network file system" in r.getMessage()]
        assert len(said) == 1 and "(nfs)" in said[0] and str(config) in said[0], said
        assert said[0].startswith("trainmon: ") and "TRAINMON_WATCH_POLLING=false" in said[0]
        config.write_text(json.dumps({"dynamic_on": True, "wg_distribution": True}))
        deadline = time.monotonic() + 15
        while not watcher.stager.decision.on and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watcher.stager.decision.on  # the poll read it
    finally:
        watcher.stop()
    forced = _watch(config, WatchSettings.from_env({"TRAINMON_WATCH_POLLING": "false"}))
    forced.stop()
    assert forced.kind == "native"  # the user's choice wins
    monkeypatch.setattr(dynamic_module, "filesystem_type", lambda path: "ext4")
    local = _watch(config, WatchSettings.from_env({}))
    local.stop()
    assert local.kind == "native" and local.network == ""


class Run:
    """A real dynamic-mode training run whose watcher is broken after set_monitor."""

    def __init__(self, config, monkeypatch):
        monkeypatch.setenv("DYNAMIC_MONITOR", "1")
        monkeypatch.setenv("TRAINMON_WATCH_SETTLE", "0.05")
        monkeypatch.setenv("TRAINMON_WATCH_INTERVAL", "1000")  # the watcher's own check never runs
        monkeypatch.setenv("TRAINMON_WATCH_STEP_CHECK", "0.05")
        torch.manual_seed(0)
        self.model = TinyGPT(SMALL)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.data = synthetic_batches(SMALL, 2, 10_000, seed=1)
        self.mon = TrainerMon(config)
        self.mon.set_monitor(self.model, optimizer=self.opt)
        self.step = 0

    @property
    def watcher(self) -> ConfigWatcher:
        return self.mon._driver.watcher

    def train_until(self, predicate, timeout: float = 20.0) -> int:
        """Train (slowly, as a real step takes time) until ``predicate()``; the step reached."""
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, "the edit was never applied"
            self.model.loss(next(self.data)).backward()
            self.opt.step()
            self.opt.zero_grad()
            self.step += 1
            time.sleep(0.02)
        return self.step


@pytest.mark.slow
@pytest.mark.parametrize("broken", ["observer stopped", "watcher thread gone"])
def test_an_edit_no_observer_reports_is_read_at_a_step_boundary(tmp_path, output_root, monkeypatch, broken):
    config = tmp_path / "monitor_config.json"
    config.write_text(json.dumps({"dynamic_on": False, "wg_distribution": True, "ops": ["norm"]}))
    run = Run(config, monkeypatch)
    try:
        run.train_until(lambda: run.step >= 2)
        if broken == "observer stopped":  # deaf observers: no event reaches the watcher any more
            for key in run.watcher._subscriptions.values():
                observer = dynamic_module._observers[key].observer
                observer.stop()
                observer.join(timeout=5)
        else:  # the observers and the watcher's thread are gone
            run.watcher.stop()
        config.write_text(json.dumps({"dynamic_on": True, "wg_distribution": True, "ops": ["norm"]}))
        on_at = run.train_until(lambda: run.mon._driver.session is not None)
        run.train_until(lambda: run.step >= on_at + 2)
        config.write_text(json.dumps({"dynamic_on": False, "wg_distribution": True}))
        off_at = run.train_until(lambda: run.mon._driver.session is None)
    finally:
        run.mon.close()
    df = read_family(only_run_dir(output_root) / "rank0", "grad_reduced")
    assert sorted(int(s) for s in df["step"].unique()) == list(range(on_at, off_at))
