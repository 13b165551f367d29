"""``trainmon anomalies``: text and JSON output, options, errors (run dirs simulated with faults)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._support.simulate import BLOW_PARAM, FAULT_RANK, FAULT_STEP, named_run, row, write_run
from trainmon.cli import main

REPO = Path(__file__).resolve().parents[2]
FIELDS = {"step", "phase", "kind", "name", "rank", "op", "value", "rule", "micro_step", "vpp_stage",
          "baseline", "source"}


def _run(capsys, *argv):
    capsys.readouterr()
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.slow  # 3.0-5.6 s on a loaded 2-core VM (2026-12-06)
def test_json_lists_the_blown_grad_first(capsys):
    code, out, _ = _run(capsys, "anomalies", str(named_run("blow")), "--json")
    doc = json.loads(out)
    assert code == 0 and set(doc) == {"run_dir", "ranks", "families", "count", "by_rule", "anomalies",
                                      "escalations", "duplicate_keys", "by_design", "spike_unjudged"}
    first = doc["anomalies"][0]
    assert set(first) == FIELDS
    assert (first["step"], first["phase"], first["kind"], first["name"], first["rank"], first["op"],
            first["rule"]) == (FAULT_STEP, "pre_reduce", "grad_unreduced", BLOW_PARAM, FAULT_RANK, "norm",
                               "spike")
    assert first["value"] > 1000 * first["baseline"] and first["source"] == "scan"
    assert doc["count"] == len(doc["anomalies"]) and doc["ranks"] == [0, 1]


def test_text_output_and_limit(capsys):
    code, out, _ = _run(capsys, "anomalies", str(named_run("nan")), "--limit", "3")
    lines = out.splitlines()
    assert code == 0
    assert lines[1] == (f"first: step {FAULT_STEP}, forward, actv inp.output, rank {FAULT_RANK}: "
                        "nans=16 (nonfinite)")
    assert lines[2].split() == ["step", "phase", "kind", "name", "rank", "micro", "op", "value", "rule",
                                "baseline"]
    assert len(lines) == 3 + 3 + 1 + 1 and lines[-2].startswith("... ")
    assert lines[-1].startswith("spike rule: ") and lines[-1].endswith("at steps 0-4")   # the warm-up
    _, out, _ = _run(capsys, "anomalies", str(named_run("nan")), "--json", "--kinds", "grad_reduced",
                     "--ranks", "0")
    doc = json.loads(out)
    assert {(a["kind"], a["rank"]) for a in doc["anomalies"]} == {("grad_reduced", 0)}
    assert doc["by_rule"] == {"nonfinite": doc["count"]}


def test_healthy_run_reports_none(capsys):
    code, out, _ = _run(capsys, "anomalies", str(named_run("healthy")))
    assert code == 0 and out.splitlines()[-2] == "no anomalies" and out.splitlines()[-1].startswith("spike rule: ")


def test_runtime_alerts_are_merged(tmp_path, capsys):
    run = write_run(tmp_path / "run", [row(0, "grad_reduced", "w", s, stats={"norm": 1.0 + 0.01 * s})
                                       for s in range(8)])
    # an alert the run raised with a stricter rule than the scan's defaults, plus a torn last line
    alert = {"step": 7, "phase": "post_reduce", "kind": "grad_reduced", "name": "w", "rank": 0, "op": "norm",
             "value": 1.07, "rule": "spike", "micro_step": None, "vpp_stage": 0, "baseline": 1.03,
             "source": "runtime", "position": 0, "occurrence": 0, "time": 0.0}
    (run / "rank0" / "anomalies.jsonl").write_text(json.dumps(alert) + "\n" + '{"step": 8, "ki')
    doc = json.loads(_run(capsys, "anomalies", str(run), "--json")[1])
    assert [(a["step"], a["source"]) for a in doc["anomalies"]] == [(7, "runtime")]
    assert json.loads(_run(capsys, "anomalies", str(run), "--json", "--no-runtime")[1])["count"] == 0


@pytest.mark.parametrize("argv, message", [
    (["--rules", "nan"], "unknown rule 'nan' (allowed: nonfinite, spike, threshold, param_changed)"),
    (["--ops", "nrom"], "no stat 'nrom' in"),
    (["--kinds", "actvv"], "no family 'actvv' in"),
    (["--factor", "0.5"], "spike factor must be a finite number > 1"),
    (["--rules", "threshold"], "rule 'threshold' needs --threshold VALUE"),
])
def test_bad_options_are_one_line_errors(capsys, argv, message):
    code, out, err = _run(capsys, "anomalies", str(named_run("healthy")), *argv)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("trainmon anomalies: error: ") and message in err


def test_bad_path_from_the_console_script(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "trainmon", "anomalies", str(tmp_path / "nope")],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"trainmon anomalies: error: {tmp_path / 'nope'}: no such directory\n"


@pytest.mark.slow  # three scans of a run
def test_engine_flag_is_a_deprecated_no_op_with_one_warning(capsys, caplog):
    run = str(named_run("blow"))
    _, want, _ = _run(capsys, "anomalies", run, "--json")
    for choice in ("memory", "duckdb"):
        caplog.clear()
        code, out, _ = _run(capsys, "anomalies", run, "--json", "--engine", choice)
        assert code == 0 and out == want
        warned = [r.getMessage() for r in caplog.records if "--engine is deprecated" in r.getMessage()]
        assert len(warned) == 1 and warned[0].startswith("trainmon: ")
