"""A monitored training process killed with SIGKILL leaves only parseable, contiguous CSVs."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests._support.runs import only_run_dir, read_family

REPO = Path(__file__).resolve().parents[1]   # the checkout under test, not an installed copy
SCRIPT = textwrap.dedent("""
    import json, sys, torch
    torch.set_num_threads(1)
    from trainmon import TrainerMon
    from trainmon.testing.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches
    model = TinyGPT(GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=2))
    opt = torch.optim.Adam(model.parameters())
    mon = TrainerMon(sys.argv[1])
    mon.set_monitor(model, optimizer=opt)
    for step, batch in enumerate(synthetic_batches(model.cfg, 4, 100000)):
        model.loss(batch).backward()
        opt.step(); opt.zero_grad()
        if step == 5:
            print("running", flush=True)
""")


@pytest.mark.slow  # a child process killed mid-run
def test_sigkill_mid_run_leaves_parseable_contiguous_csvs(tmp_path, output_root, make_config):
    cfg = make_config(wg_distribution=True, mv_distribution=True, param_distribution=True,
                      ur_distribution=True, step_count_per_record=7, ops=["norm", "mean", "max"])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(cfg)], env=env, stdout=subprocess.PIPE,
                            cwd=tmp_path)
    assert proc.stdout.readline().strip() == b"running"
    time.sleep(1.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    rank0 = only_run_dir(output_root) / "rank0"
    files = sorted(rank0.glob("*.csv"))
    assert len(files) >= 7
    n_params = 29
    for family in ("grad_unreduced", "grad_reduced", "param_origin", "param_updated", "exp_avg",
                   "exp_avg_sq", "update_ratio"):
        df = read_family(rank0, family)
        assert not df.isna().any().any(), family
        steps = sorted(df["step"].unique())
        assert steps == list(range(steps[-1] + 1)), family
        # the last step may be cut between families, never inside a file's step
        assert (df.groupby("step").size() == n_params).all(), family
