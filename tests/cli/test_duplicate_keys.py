"""Repeated (rank, family, name, step, micro_step) keys are a finding of their own (issue 34, item 8).

A resumed job that reuses ``TRAINMON_RUN_ID`` without ``start_iteration`` writes its steps a second
time into the same files.  The run here is exactly that: two real monitored trainings of the same
steps, the second one's rows appended to the first one's files (what the CSV sink does with a file
that already exists).  ``anomalies``, ``ranks`` and ``compare`` must name the repeats -- count and
first example -- in both engines, in text and JSON; the truth is counted with plain pandas.
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

from tests._support.runs import ENGINES
from trainmon import TrainerMon
from trainmon.cli import main

STEPS = 3


def _train(out: Path, config: Path, monkeypatch) -> Path:
    """One real monitored training of STEPS steps; its run directory."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    monkeypatch.setenv("TRAINMON_RUN_ID", "resumed")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with TrainerMon(config) as monitor:
        monitor.set_monitor(model, optimizer=opt)
        for _ in range(STEPS):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
    return out / "resumed"


def _append(into: Path, more: Path) -> None:
    """``more``'s family rows appended to ``into``'s files of the same name (no second header)."""
    for src in sorted(more.glob("rank*/*.csv")):
        dst = into / src.relative_to(more)
        body = src.read_text().split("\n", 1)[1]
        if dst.exists():
            dst.write_text(dst.read_text() + body)
        else:
            dst.write_text(src.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(a run whose every key is written twice, the clean first run)."""
    root = tmp_path_factory.mktemp("resume")
    config = root / "config.json"
    config.write_text(json.dumps({"wg_distribution": True, "param_distribution": True, "ops": ["norm", "max"]}))
    with pytest.MonkeyPatch.context() as mp:
        clean = _train(root / "first", config, mp)
        again = _train(root / "second", config, mp)
    resumed = root / "run"
    import shutil

    shutil.copytree(clean, resumed)
    _append(resumed, again)
    return resumed, clean


def _truth(run: Path) -> tuple[int, dict]:
    """Repeated rows and the first repeated key, with plain pandas over the files."""
    frames = []
    for path in sorted(run.glob("rank*/*.csv")):
        family = path.name.rsplit("_", 1)[0]
        df = pd.read_csv(path)
        frames.append(df.assign(rank=int(path.parent.name[4:]), family=family))
    df = pd.concat(frames, ignore_index=True)
    df["micro_step"] = df["micro_step"].fillna(-1) if "micro_step" in df else -1
    keys = ["rank", "family", "vpp_stage", "name", "step", "micro_step"]
    return int(df.duplicated(keys).sum()), df


def _cli(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_anomalies_and_ranks_name_repeated_keys(runs, capsys, engine):
    resumed, clean = runs
    count, df = _truth(resumed)
    assert count == len(df) // 2 > 0, "every row of the second run repeats a key"
    for command in ("anomalies", "ranks"):
        code, out = _cli(capsys, command, resumed, "--engine", engine, "--json")
        doc = json.loads(out)["duplicate_keys"]
        assert code == 0 and doc["count"] == count, (command, doc)
        first = doc["first"]
        assert first["step"] == 0 and first["copies"] == 2 and first["rank"] == 0
        # the first repeated key is a real key of the run, written exactly twice
        hits = df[(df["family"] == first["family"]) & (df["name"] == first["name"]) & (df["step"] == 0)]
        assert len(hits) == 2, first
        code, out = _cli(capsys, command, resumed, "--engine", engine)
        line = next(ln for ln in out.splitlines() if ln.startswith("duplicate keys:"))
        assert f"{count} rows repeat" in line and f"{first['family']} '{first['name']}'" in line
        assert "TRAINMON_RUN_ID" in line
        # a clean run has none, and says nothing about them
        code, out = _cli(capsys, command, clean, "--engine", engine, "--json")
        assert json.loads(out)["duplicate_keys"] == {"count": 0, "first": None}
        assert "duplicate keys" not in _cli(capsys, command, clean, "--engine", engine)[1]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_compare_names_the_repeats_of_each_run(runs, capsys, engine):
    resumed, clean = runs
    count, df = _truth(resumed)
    code, out = _cli(capsys, "compare", clean, resumed, "--engine", engine, "--json")
    doc = json.loads(out)
    assert code == 0
    assert doc["duplicate_keys"]["target"]["count"] == count
    assert doc["duplicate_keys"]["base"] == {"count": 0, "first": None}
    # one copy aligns with the clean run, the other is only in the resumed one
    assert doc["aligned_rows"] == len(df) - count and doc["only_in_target"] == count
    assert doc["only_in_base"] == 0
    code, out = _cli(capsys, "compare", clean, resumed, "--engine", engine)
    assert any(ln.startswith(f"target: duplicate keys: {count} rows repeat") for ln in out.splitlines()), out


@pytest.mark.parametrize("engine", ENGINES)
def test_comm_calls_of_one_name_are_not_repeats_but_a_second_copy_is(tmp_path, capsys, engine):
    rank = tmp_path / "run" / "rank0"
    rank.mkdir(parents=True)
    head = "vpp_stage,name,step,op,call,phase,norm,shape,dtype\n"
    rows = "".join(f'0,w,{s},all_reduce,{c},pre,{1.0 + c},"[2]",torch.float32\n' for s in (0, 1) for c in (0, 1))
    path = rank / "comm_0-1.csv"
    path.write_text(head + rows)
    doc = json.loads(_cli(capsys, "anomalies", tmp_path / "run", "--engine", engine, "--json")[1])
    assert doc["duplicate_keys"] == {"count": 0, "first": None}, "each call of the name is its own key"
    path.write_text(head + rows + '0,w,1,all_reduce,1,pre,2.0,"[2]",torch.float32\n')
    doc = json.loads(_cli(capsys, "anomalies", tmp_path / "run", "--engine", engine, "--json")[1])
    assert doc["duplicate_keys"] == {"count": 1, "first": {"rank": 0, "family": "comm", "vpp_stage": 0, "name": "w",
                                                          "step": 1, "micro_step": None, "copies": 2}}
