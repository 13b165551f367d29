"""``trainmon similarity``: sign agreement of two real runs' grad_direction samples."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from tests._support.probe_runs import train_run
from tests._support.runs import run_cli
from trainmon.cli import main
from trainmon.diagnosis.similarity import popcount, similarities, write_similarities

L2 = {"grad_probe": {"grad_level": "L2"}}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sim")
    base = train_run(root / "base", L2, steps=4, acc=1)
    again = train_run(root / "again", L2, steps=4, acc=1)
    late = train_run(root / "late", L2, steps=4, acc=1, change_data_at=2)
    return base, again, late


def test_two_identical_runs_are_1_everywhere_and_every_chart_is_written(runs, tmp_path):
    base, again, _ = runs
    result = similarities(base.run_dir, again.run_dir)
    assert len(result.frame) == 4 * len(base.grads[0]) and (result.frame["similarity"] == 1.0).all()
    assert result.first_below(1.0) is None
    written = write_similarities(result, tmp_path / "out")
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == sorted(["similarities.csv", "summary_similarities.png",
                            *(f"{n}.png" for n in base.grads[0])])
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in written if p.suffix == ".png")
    table = pd.read_csv(tmp_path / "out" / "similarities.csv")
    assert list(table.columns) == ["step", "name", "similarity"]
    assert (table["similarity"] == 1.0).all()


def test_runs_that_diverge_at_step_2_drop_first_at_step_2(runs):
    base, _, late = runs
    result = similarities(base.run_dir, late.run_dir)
    f = result.frame
    assert (f[f["step"] < 2]["similarity"] == 1.0).all()
    assert (f[f["step"] >= 2]["similarity"] < 1.0).any()
    first = result.first_below(1.0)
    assert first["step"] == 2
    # the similarity is the sign agreement of the test's own grads at the sampled positions
    import torch

    from trainmon.collectors.grad_probe import direction_positions

    a, b = base.grads[2][first["name"]], late.grads[2][first["name"]]
    pos = torch.from_numpy(direction_positions(first["name"], tuple(a.shape)))
    same = ((a.reshape(-1)[pos] > 0) == (b.reshape(-1)[pos] > 0)).double().mean().item()
    assert first["similarity"] == same


def test_the_command_writes_the_files_and_reports_the_first_drop_as_json(runs, tmp_path, capsys):
    base, _, late = runs
    capsys.readouterr()
    assert main(["similarity", str(base.run_dir), str(late.run_dir), "-o", str(tmp_path / "o"), "--json",
                 "--threshold", "0.999"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["first_below"]["step"] == 2 and doc["threshold"] == 0.999
    assert doc["rows"] == 4 * len(base.grads[0]) and doc["steps"] == 4
    assert (tmp_path / "o" / "summary_similarities.png").is_file()


def test_a_run_without_l2_is_one_line_and_exit_code_2(runs, tmp_path):
    base, _, _ = runs
    plain = train_run(tmp_path / "plain", {"grad_probe": {"grad_level": "L1"}}, steps=1, acc=1)
    res = run_cli("similarity", str(base.run_dir), str(plain.run_dir), "-o", str(tmp_path / "o"))
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip().splitlines() == [
        f"trainmon similarity: error: {plain.run_dir}: no grad_direction rows (record it with "
        "\"grad_probe\": {\"grad_level\": \"L2\"})"]


def test_popcount_counts_bits():
    import numpy as np

    words = np.array([0, 1, 0xFFFFFFFF, 0b1011 << 40], dtype=np.uint64)
    assert popcount(words).tolist() == [0, 1, 32, 3]
