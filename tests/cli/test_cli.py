"""The ``trainmon`` console script: discovery, --help, exit codes, and the demo run."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from trainmon.cli import _command_modules, main
from tests._support.runs import run_cli

REPO = Path(__file__).resolve().parents[2]




def test_every_subcommand_has_help(capsys):
    names = [name.replace("_", "-") for name, _ in _command_modules()]
    assert "demo" in names
    for name in names:
        with pytest.raises(SystemExit) as exit_:
            main([name, "--help"])
        assert exit_.value.code == 0
        assert f"usage: trainmon {name}" in capsys.readouterr().out


def test_bad_input_is_one_line_and_exit_code_2(tmp_path):
    out = run_cli("demo", "--config", str(tmp_path / "missing.json"))
    assert out.returncode == 2
    assert out.stderr.strip() == f"trainmon demo: error: config file not found: {tmp_path / 'missing.json'}"


@pytest.mark.slow  # the demo, in a child process
def test_demo_trains_and_writes_real_output(tmp_path):
    out = run_cli("demo", "--steps", "12", "--output", str(tmp_path / "out"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "monitor output:" in out.stdout
    (run_dir,) = [p for p in (tmp_path / "out").iterdir() if p.is_dir()]
    grads = pd.read_csv(run_dir / "rank0" / "grad_reduced_0-9.csv")
    assert sorted(grads["step"].unique()) == list(range(10))
    assert (grads["norm"] > 0).all() and (grads["nans"] == 0).all()
    families = {p.name.rsplit("_", 1)[0] for p in (run_dir / "rank0").glob("*.csv")}
    assert families == {"grad_unreduced", "grad_reduced", "param_origin", "param_updated", "exp_avg",
                        "exp_avg_sq", "update_ratio", "actv", "actv_grad", "loss"}
    assert "next: trainmon anomalies" in out.stdout


def test_a_reader_that_leaves_early_gets_no_error_line(tmp_path):
    """``trainmon compare A B | head -1``: the command stops quietly (status 141), as other tools."""
    from trainmon.testing.synthetic_run import SyntheticRun

    run = SyntheticRun(ranks=2, steps=4, params=6, steps_per_file=2).write(tmp_path / "run", "csv")
    reader, writer = os.pipe()
    os.close(reader)  # the reader is gone before the command writes its first line
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "trainmon", "compare", str(run), str(run)], stdout=writer,
                          stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    os.close(writer)
    assert (proc.returncode, proc.stderr) == (141, "")
