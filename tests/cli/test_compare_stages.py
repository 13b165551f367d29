"""``trainmon compare`` stage by stage (loss alignment) on real runs: a changed lr stops at
hyperparams naming lr and its group; a changed model stops at metadata; equal runs are YES."""
from __future__ import annotations

import json

import pytest

from tests._support.probe_runs import SMALL, train_run
from trainmon.cli import main
from trainmon.testing.tiny_gpt import GPTConfig

pytestmark = pytest.mark.slow

LA = {"loss_alignment": True, "wg_distribution": True, "param_distribution": True}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("stages")
    return {"base": train_run(root / "base", LA, steps=2), "again": train_run(root / "again", LA, steps=2),
            "lr": train_run(root / "lr", LA, steps=2, lr=1.1e-3),
            "deeper": train_run(root / "deeper", LA, steps=2, model_cfg=GPTConfig(**{**SMALL.__dict__, "layers": 3})),
            "init": train_run(root / "init", LA, steps=2, seed=1)}


def _compare(capsys, a, b, *extra):
    capsys.readouterr()
    code = main(["compare", str(a.run_dir), str(b.run_dir), *extra])
    out = capsys.readouterr().out
    assert code == 0
    return json.loads(out) if "--json" in extra else out


def _stages(doc):
    return {(s["stage"], s["rank"]): s["match"] for s in doc["stages"]}


def test_equal_runs_are_yes_at_every_stage(runs, capsys):
    doc = _compare(capsys, runs["base"], runs["again"], "--json")
    assert doc["first_divergence"] is None
    assert _stages(doc) == {("metadata", 0): True, ("initial_params", 0): True, ("hyperparams", 0): True,
                            ("sample_data", 0): True, ("forward", 0): None, ("loss", 0): True,
                            ("backward", 0): True, ("optimizer", 0): True}


def test_a_changed_lr_stops_at_hyperparams_naming_lr_and_the_group(runs, capsys):
    doc = _compare(capsys, runs["base"], runs["lr"], "--json")
    d = doc["first_divergence"]
    assert (d["stage"], d["kind"], d["name"], d["group"], d["step"], d["rank"]) == \
        ("hyperparams", "hyperparams", "lr", 0, 0, 0)
    assert (d["base"], d["target"]) == (1e-3, 1.1e-3)
    stages = _stages(doc)
    assert stages[("metadata", 0)] and stages[("initial_params", 0)] and stages[("sample_data", 0)]
    assert stages[("hyperparams", 0)] is False
    text = _compare(capsys, runs["base"], runs["lr"])
    assert ("  hyperparams (r0): NO  step 0, group 0, hyperparams lr: value base 0.001 target 0.0011"
            "  <- first divergence") in text.splitlines()
    assert "first divergence (rtol 0.001): step 0, setup, hyperparams lr group 0, rank 0" in text


def test_a_changed_model_structure_stops_at_metadata(runs, capsys):
    doc = _compare(capsys, runs["base"], runs["deeper"], "--json")
    d = doc["first_divergence"]
    assert (d["stage"], d["step"], d["rank"], d["name"]) == ("metadata", None, 0, "layers.2")
    assert d["op"] == "module only in target"
    text = _compare(capsys, runs["base"], runs["deeper"])
    assert "first divergence: metadata (r0): layers.2: module only in target absent -> present" in text


def test_other_initial_params_stop_at_initial_params(runs, capsys):
    doc = _compare(capsys, runs["base"], runs["init"], "--json")
    d = doc["first_divergence"]
    assert (d["stage"], d["step"], d["name"]) == ("initial_params", None, "embedding.weight")
    assert _stages(doc)[("metadata", 0)] is True
