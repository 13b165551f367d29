"""The sink benchmarks run as documented (``benchmarks/tb_convert.py``, ``benchmarks/overhead.py
--format``): real sinks, real files."""

from __future__ import annotations

import pytest

from tests._support.benchmarks import load as _load
from tests._support.benchmarks import run


@pytest.mark.slow
def test_tb_convert_sink_mode_writes_engine_rows_to_both_sinks(tmp_path):
    """``tb_convert.py sink`` hands the sinks what the engine hands them (``StepRows``; it passed
    plain lists before, which the CSV sink cannot format)."""
    out = run("tb_convert", "sink", "--params", "6", "--steps", "3", "--workdir", str(tmp_path))
    lines = out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["CsvSink", "TensorBoardSink"], out
    assert all("per step of 48 scalars" in line for line in lines), out  # 6 params x 2 families x 4 ops


def test_tb_convert_step_rows_are_the_sinks_row_type():
    import random

    from trainmon.stats.rows import StepRows

    bench = _load("tb_convert")
    rows = bench._step_rows(3, bench._names(4), ("grad_reduced", "update_ratio"), random.Random(0))
    assert isinstance(rows, StepRows) and len(rows) == 8
    assert {r.family for r in rows} == {"grad_reduced", "update_ratio"} and {r.step for r in rows} == {3}


def test_overhead_compares_each_format_with_csv_config_by_config(capsys):
    bench = _load("overhead")
    ratios = {
        "trainmon all-on [csv]": 1.10,
        "trainmon all-on [csv,wandb]": 1.115,
        "trainmon wg [csv]": 1.02,
        "trainmon wg [csv,wandb]": 1.0,
    }
    bench._print_against_csv(ratios, ["csv,wandb"])
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["trainmon", "all-on", "[csv,wandb]", "+0.015x"]
    assert out[2].split() == ["trainmon", "wg", "[csv,wandb]", "-0.020x"]


def test_overhead_finds_the_trackers_behind_the_writer_and_fanout(tmp_path):
    from trainmon.sinks.async_writer import AsyncSink, FanoutSink
    from trainmon.sinks.base import NullSink, SinkOptions

    bench = _load("overhead")
    a, b = NullSink(SinkOptions(rank_dir=tmp_path)), NullSink(SinkOptions(rank_dir=tmp_path))
    writer = AsyncSink(FanoutSink([a, b]))
    try:
        found = bench._sinks(writer)
    finally:
        writer.close()
    assert found[0] is writer and a in found and b in found and len(found) == 4
