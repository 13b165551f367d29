"""Shared fixtures: temp configs and an isolated output root (helpers live in tests/_support)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests._support.runs import only_run_dir, read_family, reference_stats  # noqa: F401 - old import path

torch.set_num_threads(1)


@pytest.fixture
def output_root(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "monitor_output"
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(root))
    monkeypatch.delenv("TRAINMON_RUN_ID", raising=False)
    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    return root


@pytest.fixture
def make_config(tmp_path):
    def make(**cfg) -> Path:
        path = tmp_path / f"config_{len(list(tmp_path.glob('config_*.json')))}.json"
        path.write_text(json.dumps(cfg))
        return path
    return make


os.environ.setdefault("OMP_NUM_THREADS", "1")


# The fast tier (`-m "not slow"`) stays fast: in that run, an unmarked test that runs longer than this fails
# and says to mark it slow (or make it faster).  Wall time of the test's own call, on a loaded
# 2-core CI machine; TRAINMON_FAST_TEST_LIMIT_S moves it (0 turns the check off).
FAST_TEST_LIMIT_S = float(os.environ.get("TRAINMON_FAST_TEST_LIMIT_S", "3"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if (
        call.when == "call"
        and report.passed
        and FAST_TEST_LIMIT_S > 0
        and "not slow" in (item.config.getoption("markexpr") or "")  # the fast tier's own run
        and call.duration > FAST_TEST_LIMIT_S
        and item.get_closest_marker("slow") is None
    ):
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} took {call.duration:.1f} s, over the fast tier's {FAST_TEST_LIMIT_S:g} s: "
            "mark it @pytest.mark.slow or make it faster (TRAINMON_FAST_TEST_LIMIT_S)"
        )
