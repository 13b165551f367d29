"""The config watcher with real watchdog observers (native inotify and polling) against symlinked
configs, Kubernetes ConfigMap swaps and a removed/recreated folder (issue 12, item 4).

Each case edits the file the way the tool in question does and waits until the stager holds the
new version read from the new text; nothing is driven by hand.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import pytest

from trainmon.config import load_config
from trainmon.dynamic import ConfigStager, ConfigWatcher, WatchSettings, resolution_chain

pytestmark = pytest.mark.slow


def text(on: bool, ops: list[str]) -> str:
    return json.dumps({"dynamic_on": on, "wg_distribution": True, "ops": ops})


class Watched:
    def __init__(self, path: Path, observer: str):
        self.stager = ConfigStager(path, load_config, settle_s=0.05)
        settings = WatchSettings(polling=observer == "polling", interval_s=0.1, settle_s=0.05)
        self.watcher = ConfigWatcher(self.stager, settings).start()
        assert self.watcher.kind == observer
        self.stager.stage_now(fallback=load_config(path))

    def wait_version(self, version: int, timeout: float = 10.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.stager.decision.version >= version:
                return self.stager.decision
            time.sleep(0.02)
        raise AssertionError(f"version {version} never staged (have {self.stager.decision.version})")

    def quiet(self, seconds: float = 0.6) -> int:
        """The version after ``seconds`` without edits (no spurious re-reads)."""
        time.sleep(seconds)
        return self.stager.decision.version

    def close(self) -> None:
        self.watcher.stop()


@pytest.fixture(params=["native", "polling"])
def observer(request):
    return request.param


def _ops(decision) -> tuple[str, ...]:
    assert decision.config is not None
    return tuple(decision.config.ops)


def test_edits_of_a_symlinked_configs_target_and_through_the_link_are_read(tmp_path, observer):
    real = tmp_path / "elsewhere" / "real.json"
    real.parent.mkdir()
    real.write_text(text(True, ["norm"]))
    link = tmp_path / "conf" / "config.json"
    link.parent.mkdir()
    link.symlink_to(real)
    w = Watched(link, observer)
    try:
        real.write_text(text(True, ["min"]))                     # the target, edited where it is
        assert _ops(w.wait_version(2)) == ("min",)
        with open(link, "w") as fh:                               # written through the link
            fh.write(text(True, ["max"]))
        assert _ops(w.wait_version(3)) == ("max",)
        other = tmp_path / "elsewhere" / "other.json"
        other.write_text(text(False, ["norm"]))
        tmp_link = link.with_name("config.json.tmp")
        tmp_link.symlink_to(other)
        os.replace(tmp_link, link)                                # the link now points elsewhere
        assert not w.wait_version(4).on
        other.write_text(text(True, ["mean"]))                    # ...and the new target is watched
        assert _ops(w.wait_version(5)) == ("mean",)
        real.write_text(text(True, ["norm"]))                     # the old target no longer matters
        assert w.quiet() == 5
    finally:
        w.close()


def _configmap_swap(mount: Path, version: int, content: str) -> None:
    """What the kubelet does: a new timestamped folder, then ``..data`` swapped by a rename."""
    new = mount / f"..2026_12_02_06_00_{version:02d}.0000"
    new.mkdir()
    (new / "config.json").write_text(content)
    tmp = mount / "..data_tmp"
    tmp.symlink_to(new.name)
    old = os.readlink(mount / "..data") if (mount / "..data").is_symlink() else None
    os.replace(tmp, mount / "..data")
    if old:
        shutil.rmtree(mount / old)


def test_kubernetes_configmap_swaps_of_data_are_read_every_time(tmp_path, observer):
    mount = tmp_path / "etc-config"
    mount.mkdir()
    _configmap_swap(mount, 1, text(True, ["norm"]))
    (mount / "config.json").symlink_to("..data/config.json")
    chain = resolution_chain(mount / "config.json")
    assert str(mount / "..data") in chain and chain[-1].endswith("01.0000/config.json")
    w = Watched(mount / "config.json", observer)
    try:
        _configmap_swap(mount, 2, text(True, ["min"]))
        assert _ops(w.wait_version(2)) == ("min",)
        _configmap_swap(mount, 3, text(False, ["min"]))
        assert not w.wait_version(3).on
        _configmap_swap(mount, 4, text(True, ["max", "norm"]))
        assert _ops(w.wait_version(4)) == ("max", "norm")
        assert w.quiet() == 4, "one version per swap"
    finally:
        w.close()


def test_a_removed_and_recreated_config_folder_is_watched_again(tmp_path, observer, caplog):
    folder = tmp_path / "conf"
    folder.mkdir()
    path = folder / "config.json"
    path.write_text(text(True, ["norm"]))
    w = Watched(path, observer)
    try:
        with caplog.at_level(logging.INFO, logger="trainmon"):
            shutil.rmtree(folder)
            deadline = time.monotonic() + 10
            while not any("is gone" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert w.stager.decision.version == 1 and w.stager.decision.on, "a missing file changes nothing"
            folder.mkdir()
            path.write_text(text(False, ["norm"]))
            assert not w.wait_version(2).on, "the recreated file says off: monitoring stops"
            path.write_text(text(True, ["min"]))
            assert _ops(w.wait_version(3)) == ("min",), "and later edits are still seen"
        gone = [r for r in caplog.records if "is gone" in r.getMessage()]
        assert len(gone) == 1 and gone[0].levelno == logging.WARNING, [r.getMessage() for r in caplog.records]
        assert any("is back" in r.getMessage() for r in caplog.records)
    finally:
        w.close()


def test_a_folder_swapped_for_a_new_one_between_two_checks_is_watched_anew(tmp_path, observer):
    folder = tmp_path / "conf"
    folder.mkdir()
    path = folder / "config.json"
    path.write_text(text(True, ["norm"]))
    w = Watched(path, observer)
    try:
        staged = tmp_path / "conf.new"
        staged.mkdir()
        (staged / "config.json").write_text(text(True, ["min"]))
        shutil.rmtree(folder)
        os.rename(staged, folder)                                 # same name, a new folder
        assert _ops(w.wait_version(2)) == ("min",)
        path.write_text(text(True, ["max"]))
        assert _ops(w.wait_version(3)) == ("max",)
    finally:
        w.close()


def test_a_monitored_run_follows_configmap_swaps_and_a_recreated_folder(tmp_path, observer, monkeypatch):
    """End to end in one process: real training, the real watcher, and the steps recorded."""
    import torch

    from tests._support.runs import only_run_dir, read_family
    from trainmon import TrainerMon
    from trainmon.testing.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches

    root = tmp_path / "out"
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(root))
    monkeypatch.delenv("TRAINMON_RUN_ID", raising=False)
    monkeypatch.setenv("DYNAMIC_MONITOR", "true")
    monkeypatch.setenv("TRAINMON_WATCH_POLLING", "1" if observer == "polling" else "0")
    monkeypatch.setenv("TRAINMON_WATCH_INTERVAL", "0.1")
    monkeypatch.setenv("TRAINMON_WATCH_SETTLE", "0.05")
    mount = tmp_path / "etc-config"
    mount.mkdir()
    _configmap_swap(mount, 1, text(False, ["norm"]))
    (mount / "config.json").symlink_to("..data/config.json")
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    mon = TrainerMon(mount / "config.json")
    mon.set_monitor(model, optimizer=opt)
    stager = mon._driver.stager
    batches = synthetic_batches(model.cfg, 2, 100)

    def train(n: int) -> None:
        for _ in range(n):
            model.loss(next(batches)).backward()
            opt.step()
            opt.zero_grad()

    def staged(version: int) -> None:
        deadline = time.monotonic() + 10
        while stager.decision.version < version and time.monotonic() < deadline:
            time.sleep(0.02)
        assert stager.decision.version >= version

    train(2)                                        # steps 0-1: off
    _configmap_swap(mount, 2, text(True, ["norm"]))
    staged(2)
    train(3)                                        # applied at the boundary after step 2: on for 3-4
    shutil.rmtree(mount)                            # the whole ConfigMap mount goes away ...
    mount.mkdir()                                   # ... and comes back saying off
    _configmap_swap(mount, 3, text(False, ["norm"]))
    (mount / "config.json").symlink_to("..data/config.json")
    staged(3)
    train(3)
    mon.close()
    steps = sorted(set(read_family(only_run_dir(root) / "rank0", "grad_reduced")["step"]))
    assert steps == [3, 4, 5], steps


def test_an_edit_reported_twice_is_one_version_and_saving_again_is_another(tmp_path, observer):
    path = tmp_path / "config.json"
    path.write_text(text(True, ["norm"]))
    w = Watched(path, observer)
    try:
        path.write_text(text(True, ["min"]))
        assert _ops(w.wait_version(2)) == ("min",)
        w.watcher._on_change()          # what a polling observer's late event for that edit does
        assert w.quiet() == 2, "the same file with the same text is not read again"
        time.sleep(0.02)
        path.write_text(text(True, ["min"]))   # saved again, same text: a user asking for a new collection
        assert _ops(w.wait_version(3)) == ("min",)
        assert w.quiet() == 3
    finally:
        w.close()
