"""``compare``'s ``only in base`` / ``only in target`` counts (issue 34, item 16).

A target holding rows the base lacks used to report ``only in target: 0`` when those rows were of
tensor names the base does not have.  Each side here has rows the other lacks (other steps, other
names, another rank); both engines' counts must equal the set differences of the two runs' keys,
computed with plain pandas from the files.
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from tests._support.runs import ENGINES
from trainmon.cli import main
from trainmon.sinks import SinkOptions
from trainmon.sinks.csv import CsvSink
from trainmon.stats.rows import StatRow, StepRows

FAMILIES = ("grad_reduced", "param_origin")


def _write(run: Path, ranks, steps, names) -> Path:
    for rank in ranks:
        sink = CsvSink(SinkOptions(rank_dir=run / f"rank{rank}", step_count_per_record=4))
        for step in steps:
            sink.write(StepRows.of([StatRow(f, n, step, {"norm": 1.0 + i + step / 16, "max": 0.5 + i}, (3,),
                                            "torch.float32")
                                    for f in FAMILIES for i, n in enumerate(names)]), step)
        sink.close()
    return run


def _keys(run: Path) -> set[tuple]:
    keys = set()
    for path in run.glob("rank*/*.csv"):
        family = path.name.rsplit("_", 1)[0]
        for r in pd.read_csv(path).itertuples():
            keys.add((int(path.parent.name[4:]), family, r.name, int(r.step)))
    return keys


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("counts")
    base = _write(root / "base", (0, 1), range(6), ("layer.0.weight", "layer.0.bias", "head.weight"))
    target = _write(root / "target", (0, 1, 2), range(2, 9), ("layer.0.weight", "layer.0.bias", "layer.1.weight"))
    return base, target


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("swap", [False, True])
def test_rows_only_in_one_run_are_counted_on_each_side(runs, capsys, engine, swap):
    base, target = runs[::-1] if swap else runs
    b, t = _keys(base), _keys(target)
    assert b - t and t - b and {k[2] for k in t - b} - {k[2] for k in b}, "each side has rows and names of its own"
    capsys.readouterr()
    assert main(["compare", str(base), str(target), "--engine", engine, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["aligned_rows"], doc["only_in_base"], doc["only_in_target"]) == (len(b & t), len(b - t), len(t - b))
    assert main(["compare", str(base), str(target), "--engine", engine]) == 0
    assert f"(only in base: {len(b - t)}, only in target: {len(t - b)};" in capsys.readouterr().out
