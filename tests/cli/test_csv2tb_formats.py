"""``csv2tb`` of runs written as Parquet, or in both formats (issue 34, item 12).

A ``"format": ["csv", "parquet"]`` run used to convert nothing: its ``.parquet`` files were read
as CSV ("NUL byte ... damaged"), skipped, and the CSV files beside them never read (exit 2).  Each
family is now read once, from one format; the events, read back with TensorBoard's own loader,
equal the CSV rows (read with plain pandas).
"""
from __future__ import annotations

import pytest

from tests.sinks.test_tensorboard import assert_same_scalars, expected_from_csv, load_scalars, write_rows
from trainmon.cli import main
from trainmon.cli.csv2tb import CONVERTED_NAME
from trainmon.sinks import SinkOptions, create_sink

pytest.importorskip("tensorboard")
pytest.importorskip("pyarrow")


def _write(run, formats, steps=4):
    for rank in (0, 1):
        sink = create_sink(list(formats), SinkOptions(rank_dir=run / f"rank{rank}", step_count_per_record=2))
        write_rows(sink, steps, n_params=2, micro_steps=2)
        sink.close()
    return run


def _convert(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["csv2tb", *map(str, argv), "--tags", "per_tensor"])
    return code, capsys.readouterr().err


def test_a_run_in_both_formats_is_converted_once_and_equals_its_csv_rows(tmp_path, capsys):
    run = _write(tmp_path / "run", ["csv", "parquet"])
    assert sorted(run.glob("rank0/*.parquet")) and sorted(run.glob("rank0/*.csv"))
    code, err = _convert(capsys, run, "--no-progress")
    assert code == 0 and "warning" not in err, err
    for rank in (0, 1):
        events = run / "tensorboard" / f"rank{rank}"
        assert [p.name for p in events.iterdir()] == [CONVERTED_NAME]
        # every value once (a family read from both formats would show each step twice)
        assert_same_scalars(load_scalars(events), expected_from_csv(run / f"rank{rank}"))


def test_a_parquet_run_converts_like_its_csv_twin(tmp_path, capsys):
    both = _write(tmp_path / "both", ["csv", "parquet"])
    only = tmp_path / "parquet"
    for p in both.glob("rank*/*.parquet"):
        (only / p.parent.name).mkdir(parents=True, exist_ok=True)
        (only / p.parent.name / p.name).write_bytes(p.read_bytes())
    code, err = _convert(capsys, only, "--no-progress")
    assert code == 0 and not err, err
    assert_same_scalars(load_scalars(only / "tensorboard" / "rank1"), expected_from_csv(both / "rank1"))


def test_a_window_only_the_csv_holds_is_read_from_the_csv(tmp_path, capsys):
    # after a crash the Parquet sink has not closed the open window: only the CSV holds it
    run = _write(tmp_path / "run", ["csv", "parquet"])
    for p in run.glob("rank*/*_2-3.parquet"):
        p.unlink()
    code, err = _convert(capsys, run, "--no-progress")
    assert code == 0 and not err, err
    assert_same_scalars(load_scalars(run / "tensorboard" / "rank0"), expected_from_csv(run / "rank0"))
