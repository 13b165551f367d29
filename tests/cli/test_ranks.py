"""``trainmon ranks``: issues in flow order with rank attribution, JSON fields, options, errors."""
from __future__ import annotations

import json

import pytest

from tests._support.simulate import CORRUPT_PARAM, CORRUPT_RANK, FAULT_STEP, named_run, row, write_run
from trainmon.cli import main

ISSUE_FIELDS = {"step", "phase", "kind", "name", "rank", "check", "op", "value", "expected", "ranks",
                "micro_step", "vpp_stage", "detail"}


def _run(capsys, *argv):
    capsys.readouterr()
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_names_the_corrupted_rank(capsys):
    code, out, _ = _run(capsys, "ranks", str(named_run("corrupt3")), "--json")
    doc = json.loads(out)
    assert code == 0 and set(doc) == {"run_dir", "ranks", "checks", "count", "by_check", "issues", "duplicate_keys"}
    first = doc["issues"][0]
    assert set(first) == ISSUE_FIELDS
    assert (first["step"], first["phase"], first["kind"], first["name"], first["rank"], first["check"]) == \
        (FAULT_STEP, "post_reduce", "grad_reduced", CORRUPT_PARAM, CORRUPT_RANK, "post_reduce_mismatch")
    assert first["ranks"] == [0, 1, 2] and doc["ranks"] == [0, 1, 2]


@pytest.mark.slow  # 3.0-5.6 s on a loaded 2-core VM (2026-12-06)
def test_text_and_check_selection(capsys):
    run = str(named_run("corrupt"))
    code, out, _ = _run(capsys, "ranks", run, "--checks", "reduce_average")
    lines = out.splitlines()
    assert code == 0 and "issues: 1 (reduce_average 1)" in lines[0]
    assert lines[1].startswith(f"first: step {FAULT_STEP}, post_reduce, grad_reduced {CORRUPT_PARAM}, "
                               f"rank {CORRUPT_RANK}: reduce_average")
    assert _run(capsys, "ranks", str(named_run("healthy")))[1].splitlines()[-1] == "ranks consistent"


def test_one_rank_and_dp_group_selection(capsys, tmp_path):
    run = write_run(tmp_path / "run", [row(r, "grad_reduced", "w", 0, stats={"norm": 1.0 + (r == 2)})
                                       for r in range(3)])
    assert "issues: 0" in _run(capsys, "ranks", str(run), "--ranks", "0,1")[1]
    assert _run(capsys, "ranks", str(run), "--ranks", "2")[1].splitlines()[-1] == \
        "only one rank: nothing to compare across ranks"
    doc = json.loads(_run(capsys, "ranks", str(run), "--json")[1])
    assert [(i["rank"], i["check"]) for i in doc["issues"]] == [(2, "post_reduce_mismatch")]


@pytest.mark.parametrize("argv, message", [
    (["--checks", "foo"], "unknown check 'foo'"),
    (["--outlier-factor", "1"], "--outlier-factor must be > 1"),
])
def test_errors(capsys, argv, message):
    code, out, err = _run(capsys, "ranks", str(named_run("healthy")), *argv)
    assert code == 2 and out == "" and message in err and err.count("\n") == 1
