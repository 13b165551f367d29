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
