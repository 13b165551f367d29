"""``rank<R>/step_times.tsv``: one recorded time per step, written by the CSV and Parquet sinks."""
from __future__ import annotations

import logging

import pytest

from trainmon.output.runs import step_times
from trainmon.sinks import SinkOptions, create_sink
from trainmon.stats.rows import StatRow, StepRows


def _rows(step: int) -> StepRows:
    return StepRows.of([StatRow("grad_reduced", "w", step, {"norm": 1.0 + step}, (2,), "torch.float32")],
                       wall_time=1000.0 + step / 8)


def test_csv_and_parquet_of_one_rank_record_each_step_once(tmp_path):
    pytest.importorskip("pyarrow")
    sink = create_sink(["csv", "parquet"], SinkOptions(rank_dir=tmp_path / "rank0", step_count_per_record=2))
    for step in range(5):
        sink.write(_rows(step), step)
        sink.write(_rows(step), step)          # a second write of a step (late loss rows) adds no line
    sink.close()
    lines = (tmp_path / "rank0" / "step_times.tsv").read_text().splitlines()
    assert lines == [f"{s}\t{1000.0 + s / 8!r}" for s in range(5)]
    assert step_times(tmp_path / "rank0") == {s: 1000.0 + s / 8 for s in range(5)}
    assert step_times(tmp_path / "nowhere") == {}


def test_an_unwritable_step_times_file_is_one_warning_and_the_rows_are_kept(tmp_path, caplog):
    rank = tmp_path / "rank0"
    (rank / "step_times.tsv").mkdir(parents=True)           # the file cannot be opened for writing
    sink = create_sink(["csv"], SinkOptions(rank_dir=rank), threaded=False)
    with caplog.at_level(logging.WARNING):
        for step in range(3):
            sink.write(_rows(step), step)
        sink.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "cannot write step times to" in warnings[0] and "step_times.tsv" in warnings[0]
    assert [(rank / f"grad_reduced_{s}-{s}.csv").read_text().count("\n") for s in range(3)] == [2, 2, 2]
