"""Damaged Parquet files in every command that reads a run, both engines (issue 34, item 13).

A cut footer, columns that are not trainmon's, text in a statistic column, a key stored as text,
an empty file: one line naming the file and what is wrong, exit code 2 -- never a traceback, never
the file skipped with the findings of the rest (docs/hardening.md, "What the commands do with
damaged files").  The run is written by the real Parquet sink, then one file of it damaged.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from trainmon.cli import main
from trainmon.sinks import SinkOptions, create_sink
from trainmon.stats.rows import StatRow, StepRows

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("duckdb")

FILE = "rank0/grad_reduced_0-1.parquet"


def _write_run(run: Path) -> Path:
    for rank in (0, 1):
        sink = create_sink(["parquet"], SinkOptions(rank_dir=run / f"rank{rank}", step_count_per_record=2))
        for step in range(4):
            stats = lambda i, step=step: {"norm": 1.0 + step / 8 + i, "mean": 0.25 * i, "max": 2.0 + i}  # noqa: E731
            sink.write(StepRows.of([StatRow(f, n, step, stats(i), (4, 2), "torch.float32")
                                    for f in ("grad_reduced", "param_origin")
                                    for i, n in enumerate(("layer.0.weight", "layer.0.bias"))]), step)
        sink.close()
    return run


def _cut_footer(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-30])


def _rename_column(path: Path) -> None:
    table = pq.read_table(path)
    pq.write_table(table.rename_columns(["vpp", *table.column_names[1:]]), path)


def _text_in_stat(path: Path) -> None:
    table = pq.read_table(path)
    i = table.column_names.index("mean")
    cells = [repr(v) for v in table.column(i).to_pylist()]
    cells[2] = "abc"
    pq.write_table(table.set_column(i, "mean", pa.array(cells)), path)


def _step_as_text(path: Path) -> None:
    table = pq.read_table(path)
    i = table.column_names.index("step")
    pq.write_table(table.set_column(i, "step", pa.array([str(v) for v in table.column(i).to_pylist()])), path)


def _empty(path: Path) -> None:
    path.write_bytes(b"")


DAMAGES = {
    "cut footer": (_cut_footer, "not a readable Parquet file (cut short, overwritten or not Parquet: "
                                "Parquet magic bytes not found in footer)"),
    "wrong schema": (_rename_column, "not trainmon's columns (expected vpp_stage,name,step,...,shape,dtype"),
    "text in a stat": (_text_in_stat, "row 3, column 5 (mean): 'abc' is not a number"),
    "step as text": (_step_as_text, "column 3 (step): holds string, not integers"),
    "empty file": (_empty, "not a readable Parquet file"),
}


@pytest.fixture(scope="module")
def good_run(tmp_path_factory) -> Path:
    return _write_run(tmp_path_factory.mktemp("good") / "run")


@pytest.fixture(params=sorted(DAMAGES))
def damaged(request, good_run, tmp_path) -> tuple[Path, Path, str]:
    damage, what = DAMAGES[request.param]
    run = tmp_path / "run"
    shutil.copytree(good_run, run)
    damage(run / FILE)
    return run, run / FILE, what


def _cli(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def _argv(command: str, run: Path, good: Path, tmp: Path) -> list:
    return {
        "anomalies": ["anomalies", run],
        "ranks": ["ranks", run],
        "compare": ["compare", good, run],
        "compare-base": ["compare", run, good],
        "plot": ["plot", run, "--kind", "grad_reduced", "-o", tmp / "p.png"],
        "csv2tb": ["csv2tb", run, "-o", tmp / "tb", "--no-progress"],
        "convert": ["convert", run, "--to", "parquet", "-o", tmp / "converted"],
    }[command]


@pytest.mark.parametrize("engine", ["memory", "duckdb"])
@pytest.mark.parametrize("command", ["anomalies", "ranks", "compare", "compare-base"])
def test_engine_commands_name_the_damaged_file_and_exit_2(damaged, good_run, tmp_path, capsys, command, engine):
    run, path, what = damaged
    code, out, err = _cli(capsys, *_argv(command, run, good_run, tmp_path), "--engine", engine)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and out == "", (code, out, err)
    assert lines[0].startswith(f"trainmon {command.split('-')[0]}: error: {path}") and what in lines[0], lines[0]


@pytest.mark.parametrize("command", ["plot", "convert"])
def test_other_commands_name_the_damaged_file_and_exit_2(damaged, good_run, tmp_path, capsys, command):
    pytest.importorskip("matplotlib")
    run, path, what = damaged
    code, out, err = _cli(capsys, *_argv(command, run, good_run, tmp_path))
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and out == "", (code, out, err)
    assert lines[0].startswith(f"trainmon {command}: error: {path}") and what in lines[0], lines[0]


def test_csv2tb_converts_the_rest_warns_once_and_exits_2(damaged, good_run, tmp_path, capsys):
    pytest.importorskip("tensorboard")
    run, path, what = damaged
    code, out, err = _cli(capsys, *_argv("csv2tb", run, good_run, tmp_path))
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1, (code, err)
    assert lines[0].startswith(f"trainmon csv2tb: warning: {path}") and what in lines[0], lines[0]
    assert "7 family files" in out  # the 7 others converted
