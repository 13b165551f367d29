"""``trainmon compare``: first divergence and largest differences, text and JSON, errors."""
from __future__ import annotations

import json

import pytest

from tests._support.simulate import named_run
from trainmon.cli import main

DIFF_FIELDS = {"step", "phase", "kind", "name", "rank", "op", "base", "target", "rel_diff", "micro_step",
               "vpp_stage", "target_name", "stage"}


def _run(capsys, *argv):
    capsys.readouterr()
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_first_divergence_for_a_different_activation(capsys):
    code, out, _ = _run(capsys, "compare", str(named_run("base")), str(named_run("act")), "--json")
    doc = json.loads(out)
    assert code == 0
    assert set(doc) == {"base", "target", "rtol", "atol", "first_divergence", "largest_by_family",
                        "aligned_rows", "diverged_rows", "only_in_base", "only_in_target", "renamed",
                        "families", "stages", "duplicate_keys"}
    d = doc["first_divergence"]
    assert set(d) == DIFF_FIELDS
    assert (d["step"], d["phase"], d["kind"], d["name"], d["rank"], d["micro_step"]) == \
        (0, "forward", "actv", "layers.1.act.output", 0, 0)
    assert d["target_name"] == "_orig_mod.layers.1.act.output"
    assert all(set(x) == DIFF_FIELDS for xs in doc["largest_by_family"].values() for x in xs)
    assert len(doc["largest_by_family"]["actv"]) == 5


def test_text_report(capsys):
    code, out, _ = _run(capsys, "compare", str(named_run("base")), str(named_run("lr")), "--top", "1")
    lines = out.splitlines()
    assert code == 0 and lines[0].startswith("base:") and lines[1].startswith("target:")
    assert "names matched through wrapper prefixes" in lines[2]
    assert lines[3].startswith("first divergence (rtol 0.001): step 0, optimizer, "
                               "param_updated layers.1.fc.weight, rank 0")
    assert lines[4] == "largest differences per family:"


@pytest.mark.slow  # 3.0-5.6 s on a loaded 2-core VM (2026-12-06)
def test_same_run_and_looser_tolerance(capsys):
    base = str(named_run("base"))
    assert "no divergence beyond rtol 0.001" in _run(capsys, "compare", base, base)[1].splitlines()
    doc = json.loads(_run(capsys, "compare", base, str(named_run("lr")), "--rtol", "1e9", "--json")[1])
    assert doc["first_divergence"] is None and doc["diverged_rows"] == 0


def test_errors(capsys, tmp_path):
    code, out, err = _run(capsys, "compare", str(named_run("base")), str(tmp_path / "missing"))
    assert code == 2 and out == ""
    assert err == f"trainmon compare: error: {tmp_path / 'missing'}: no such directory\n"
    code, _, err = _run(capsys, "compare", str(named_run("base")), str(named_run("base")), "--rtol", "-1")
    assert code == 2 and "--rtol and --atol must be >= 0" in err
