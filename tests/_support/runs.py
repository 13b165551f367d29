"""Reading a run back with plain pandas (independent of trainmon's own reader) and the truth."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
import torch

REPO = Path(__file__).resolve().parents[2]


def read_family(rank_dir: Path, family: str) -> pd.DataFrame:
    """All windows of one family, concatenated (files named ``<family>_<a>-<b>[.k].csv``)."""
    files = sorted(p for p in rank_dir.glob(f"{family}_*.csv")
                   if p.name[len(family) + 1].isdigit())
    if not files:
        return pd.DataFrame()
    return pd.concat([pd.read_csv(p) for p in files], ignore_index=True)


@contextmanager
def trainmon_warnings():
    """The messages of trainmon's warnings logged inside the block (a list, filled as they come;
    for rank processes, where pytest's caplog does not reach)."""
    warned: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("trainmon").addHandler(handler)
    try:
        yield warned
    finally:
        logging.getLogger("trainmon").removeHandler(handler)


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


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m trainmon ARGS`` in a fresh process, as a user runs it."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "trainmon", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=timeout)


def _engine_installed() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("duckdb", "pyarrow"))


# The analysis engines a test can run here: DuckDB is the optional [engine] extra, absent from a
# fresh README install, where tests of it must skip (or run the in-memory engine alone).
ENGINES: tuple[str, ...] = ("memory", "duckdb") if _engine_installed() else ("memory",)


def compare_runs(base: Path, target: Path, **options):
    """``trainmon compare``'s comparison of two run folders (each family aligned in groups of
    ``engine.unit_rows()`` rows: one group for the tests' small runs)."""
    from trainmon.diagnosis.engine import run_files
    from trainmon.diagnosis.engine_compare import engine_compare

    return engine_compare(run_files(base), run_files(target), **options)
