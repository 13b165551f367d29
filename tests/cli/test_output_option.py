"""``-o`` means ``--output`` in every command; ``convert --out`` (its old spelling) still works,
with one deprecation line."""

from __future__ import annotations

import argparse

import pytest

from trainmon.cli import build_parser, main
from trainmon.output import runs as run_files
from trainmon.testing.synthetic_run import SyntheticRun


def test_every_dash_o_is_dash_dash_output():
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    seen = 0
    for name, command in sub.choices.items():
        for action in command._actions:
            if "-o" in action.option_strings:
                assert action.option_strings == ["-o", "--output"], name
                seen += 1
    assert seen >= 4  # plot, convert, csv2tb, similarity


@pytest.fixture
def run(tmp_path):
    pytest.importorskip("pyarrow")
    return SyntheticRun(ranks=1, steps=2, params=3, steps_per_file=2).write(tmp_path / "run", "csv")


def test_convert_output_option_and_the_deprecated_out(run, tmp_path, capsys):
    assert main(["convert", str(run), "--to", "parquet", "--output", str(tmp_path / "a")]) == 0
    assert capsys.readouterr().err == ""
    assert main(["convert", str(run), "--to", "parquet", "--out", str(tmp_path / "b")]) == 0
    assert capsys.readouterr().err == "trainmon convert: warning: --out is deprecated, use -o/--output\n"
    for out in ("a", "b"):
        frame = run_files.read_family(tmp_path / out / "rank0", "grad_reduced")
        assert frame.equals(run_files.read_family(run / "rank0", "grad_reduced"))
    code = main(["convert", str(run), "--to", "parquet", "--out", str(tmp_path / "c"), "-o", str(tmp_path / "d")])
    assert code == 2 and "disagree; pass only -o/--output" in capsys.readouterr().err
