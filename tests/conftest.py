"""Shared fixtures: temp configs, an isolated output root, reading a run back with pandas."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import pytest
import torch

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


def read_family(rank_dir: Path, family: str) -> pd.DataFrame:
    """All windows of one family, concatenated (files named ``<family>_<a>-<b>[.k].csv``)."""
    files = sorted(p for p in rank_dir.glob(f"{family}_*.csv")
                   if p.name[len(family) + 1].isdigit())
    if not files:
        return pd.DataFrame()
    return pd.concat([pd.read_csv(p) for p in files], ignore_index=True)


def only_run_dir(root: Path) -> Path:
    runs = [p for p in root.iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


def reference_stats(t: torch.Tensor, eps: float = 1e-8) -> dict[str, float]:
    """The statistics straight from the tensor, in float64: the independent truth."""
    x = t.detach().double().reshape(-1)
    return {"norm": x.norm().item(), "mean": x.mean().item(), "min": x.min().item(),
            "max": x.max().item(), "std": x.std().item() if x.numel() > 1 else float("nan"),
            "zeros": (x.abs() < eps).double().mean().item(),
            "nans": int(torch.isnan(x).sum()), "infs": int(torch.isinf(x).sum()),
            # scale for the mean's tolerance: a sum accumulated in fp32 is exact to ~1e-7 of
            # sum(|x|), not of a mean that cancels to ~0 (e.g. the grad of a softmax output layer)
            "_mean_atol": 1e-6 * x.abs().mean().item() if x.numel() else 0.0}


os.environ.setdefault("OMP_NUM_THREADS", "1")
