"""ParquetSink: files written for real, read back with pyarrow and compared with the CSV sink's files."""
from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest

pq = pytest.importorskip("pyarrow.parquet")

from trainmon.output import runs
from trainmon.output.layout import partial_file_name
from trainmon.sinks import SinkOptions, create_sink
from trainmon.sinks.csv import CsvSink
from trainmon.sinks.parquet import ParquetSink
from trainmon.stats.rows import StatRow, StepRows

REPO = Path(__file__).resolve().parents[2]


def _rows(step: int) -> list[StatRow]:
    return [
        StatRow("actv", "block.0.output", step, {"norm": 2.0 / 3.0 + step, "max": 1e-310, "nans": step},
                (4, 2), "torch.bfloat16", vpp_stage=1, micro_step=1, extra={"rank": 3, "tag": "fwd"}),
        StatRow("grad_reduced", 'w,"odd" name', step, {"min": float("-inf"), "norm": float("nan")}, (64, 32),
                "torch.float32"),
        StatRow("grad_reduced", "NA", step, {"min": -0.1, "norm": 0.30000000000000004}, (), "torch.float32"),
    ]


def _write_both(tmp_path: Path, steps, **kw) -> tuple[Path, Path]:
    out = []
    for cls, name in ((CsvSink, "csv"), (ParquetSink, "pq")):
        sink = cls(SinkOptions(rank_dir=tmp_path / name / "rank0", **kw))
        for s in steps:
            sink.write(StepRows.of(_rows(s)), step=s)
        sink.close()
        out.append(tmp_path / name / "rank0")
    return out[0], out[1]


def _bits(frame: pd.DataFrame) -> list:
    return [[struct.pack("<d", v) if isinstance(v, float) else v for v in row]
            for row in frame.itertuples(index=False)]


def test_parquet_files_hold_the_csv_files_columns_dtypes_and_exact_values(tmp_path):
    csv_dir, pq_dir = _write_both(tmp_path, range(4))
    assert sorted(p.name for p in pq_dir.iterdir()) == sorted(p.name.replace(".csv", ".parquet")
                                                             for p in csv_dir.iterdir())
    for family in ("actv", "grad_reduced"):
        from_csv, from_pq = runs.read_family(csv_dir, family), runs.read_family(pq_dir, family)
        assert list(from_pq.columns) == list(from_csv.columns)
        assert from_pq.dtypes.to_dict() == from_csv.dtypes.to_dict()
        assert _bits(from_pq) == _bits(from_csv)
    schema = pq.read_schema(pq_dir / "actv_0-0.parquet")
    assert [str(t) for t in schema.types] == ["int64", "string", "int64", "int64", "int64", "string",
                                              "double", "double", "int64", "string", "string"]


def test_a_window_of_several_steps_is_one_file_written_when_the_window_ends(tmp_path):
    sink = ParquetSink(SinkOptions(rank_dir=tmp_path, step_count_per_record=3))
    for s in range(4):
        sink.write(StepRows.of(_rows(s)), step=s)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "step_times.tsv") == ["actv_0-2.parquet",
                                                                                         "grad_reduced_0-2.parquet"]
    assert pq.read_table(tmp_path / "grad_reduced_0-2.parquet").column("step").to_pylist() == [0, 0, 1, 1, 2, 2]
    sink.close()
    assert runs.read_family(tmp_path, "actv")["step"].tolist() == [0, 1, 2, 3]


def test_flush_closes_the_open_window_and_later_rows_go_to_its_next_file(tmp_path):
    sink = ParquetSink(SinkOptions(rank_dir=tmp_path, step_count_per_record=10))
    sink.write(StepRows.of(_rows(0)), step=0)
    sink.flush()
    assert runs.read_family(tmp_path, "actv")["step"].tolist() == [0]
    sink.write(StepRows.of(_rows(1)), step=1)
    sink.close()
    assert sorted(p.name for p in tmp_path.glob("actv_*")) == ["actv_0-9.1.parquet", "actv_0-9.parquet"]
    assert runs.read_family(tmp_path, "grad_reduced")["name"].tolist() == ['w,"odd" name', "NA"] * 2
    assert runs.read_family(tmp_path, "actv")["step"].tolist() == [0, 1]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_long_window_goes_to_its_temp_file_in_row_groups_and_appears_whole_at_its_end(tmp_path):
    sink = ParquetSink(SinkOptions(rank_dir=tmp_path, step_count_per_record=100), row_group_rows=4)
    for s in range(9):
        sink.write(StepRows.of(_rows(s)), step=s)
    assert not list(tmp_path.glob("*.parquet"))               # nothing visible before the window ends
    tmp = tmp_path / partial_file_name("grad_reduced_0-99.parquet", os.getpid(), sink._token)
    assert tmp.exists() and all(len(v) < 4 for v in sink._open[next(iter(sink._open))].cells.values())
    sink.close()
    meta = pq.ParquetFile(tmp_path / "grad_reduced_0-99.parquet").metadata
    assert meta.num_row_groups == 5 and meta.num_rows == 18
    df = runs.read_family(tmp_path, "grad_reduced")
    assert df["step"].tolist() == [s for s in range(9) for _ in range(2)]
    assert struct.pack("<d", df["norm"][1]) == struct.pack("<d", 0.30000000000000004)


def test_a_column_changing_type_mid_window_continues_in_the_next_file(tmp_path):
    sink = ParquetSink(SinkOptions(rank_dir=tmp_path, step_count_per_record=10), row_group_rows=1)
    sink.write(StepRows.of([StatRow("grad_reduced", "w", 0, {"norm": 1.0}, (2,), "torch.float32")]), step=0)
    sink.write(StepRows.of([StatRow("grad_reduced", "w", 1, {"norm": 2}, (2,), "torch.float32")]), step=1)
    sink.write(StepRows.of([StatRow("grad_reduced", "w", 2, {"norm": "text"}, (2,), "torch.float32")]), step=2)
    sink.close()
    assert sink.lost_rows == 0
    assert pq.read_table(tmp_path / "grad_reduced_0-9.parquet").column("norm").to_pylist() == [1.0, 2.0]
    assert pq.read_table(tmp_path / "grad_reduced_0-9.1.parquet").column("norm").to_pylist() == ["text"]


def test_rows_under_other_columns_go_to_a_sibling_file_and_read_back_aligned(tmp_path):
    sink = ParquetSink(SinkOptions(rank_dir=tmp_path, step_count_per_record=2))
    sink.write(StepRows.of([StatRow("grad_reduced", "w", 0, {"norm": 1.0}, (2,), "torch.float32")]), step=0)
    sink.write(StepRows.of([StatRow("grad_reduced", "w", 1, {"norm": 2.0, "max": 3.0}, (2,), "torch.float32")]),
               step=1)
    sink.close()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "step_times.tsv") == [
        "grad_reduced_0-1.1.parquet", "grad_reduced_0-1.parquet"]
    df = runs.read_family(tmp_path, "grad_reduced")
    assert df["norm"].tolist() == [1.0, 2.0] and pd.isna(df["max"][0]) and df["max"][1] == 3.0


def test_ndigits_rounds_parquet_values_like_the_csv_cells(tmp_path):
    csv_dir, pq_dir = _write_both(tmp_path, [0], ndigits=3)
    assert _bits(runs.read_family(pq_dir, "grad_reduced")) == _bits(runs.read_family(csv_dir, "grad_reduced"))
    assert runs.read_family(pq_dir, "actv")["norm"].tolist() == [0.667]


def test_an_existing_file_of_the_window_is_never_overwritten(tmp_path):
    for value in (1.0, 2.0):  # a resumed run writing the same window again
        sink = ParquetSink(SinkOptions(rank_dir=tmp_path))
        sink.write(StepRows.of([StatRow("grad_reduced", "w", 0, {"norm": value}, (2,), "torch.float32")]), step=0)
        sink.close()
    assert pq.read_table(tmp_path / "grad_reduced_0-0.parquet").column("norm").to_pylist() == [1.0]
    assert pq.read_table(tmp_path / "grad_reduced_0-0.1.parquet").column("norm").to_pylist() == [2.0]


def test_an_unwritable_directory_loses_rows_counted_never_raises(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    sink = ParquetSink(SinkOptions(rank_dir=blocker / "rank0"))
    sink.write(StepRows.of(_rows(0)), step=0)
    sink.close()
    assert sink.lost_rows == 3
    assert "cannot write monitor output" in caplog.text


def test_parquet_beside_csv_writes_both_and_readers_take_parquet(tmp_path):
    sink = create_sink(["csv", "parquet"], SinkOptions(rank_dir=tmp_path), threaded=True)
    for s in range(3):
        sink.write(StepRows.of(_rows(s)), step=s)
    sink.close()
    assert len(list(tmp_path.glob("*.csv"))) == len(list(tmp_path.glob("*.parquet"))) == 6
    files = runs.family_files(tmp_path)
    assert {f.ext for fs in files.values() for f in fs} == {"parquet"}
    (tmp_path / "grad_reduced_2-2.parquet").unlink()  # e.g. lost with the open window in a crash
    assert {f.ext for f in runs.family_files(tmp_path)["grad_reduced"]} == {"csv"}


def test_missing_pyarrow_is_one_config_problem_naming_the_extra(tmp_path, monkeypatch):
    import trainmon.sinks as sinks
    import trainmon.sinks.base as base
    from trainmon.config import parse_config
    from trainmon.runtime.features import unsupported_problems

    monkeypatch.setitem(sinks.SINK_MODULES, "parquet", "trainmon_no_such_module_for_test")
    monkeypatch.delitem(base._REGISTRY, "parquet", raising=False)
    problems = unsupported_problems(parse_config({"format": ["csv", "parquet"]}, "cfg.json"))
    assert len(problems) == 1
    assert "needs pyarrow: pip install trainmon[parquet]" in problems[0].message


SCRIPT = textwrap.dedent("""
    import sys, torch
    torch.set_num_threads(1)
    from trainmon import TrainerMon
    from trainmon.testing.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches
    model = TinyGPT(GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=2))
    opt = torch.optim.Adam(model.parameters())
    mon = TrainerMon(sys.argv[1])
    mon.set_monitor(model, optimizer=opt)
    for step, batch in enumerate(synthetic_batches(model.cfg, 4, 100000)):
        model.loss(batch).backward()
        opt.step(); opt.zero_grad()
        if step == 12:
            print("running", flush=True)
""")


@pytest.mark.slow
def test_sigkill_mid_run_leaves_every_parquet_file_readable_and_whole_windows(tmp_path, output_root, make_config):
    cfg = make_config(format=["parquet"], wg_distribution=True, mv_distribution=True, param_distribution=True,
                      ur_distribution=True, step_count_per_record=3, ops=["norm", "mean", "max"])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(cfg)], env=env, stdout=subprocess.PIPE,
                            cwd=tmp_path)
    assert proc.stdout.readline().strip() == b"running"
    time.sleep(1.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    run = [p for p in output_root.iterdir() if p.is_dir()][0]
    rank0 = run / "rank0"
    files = sorted(rank0.glob("*.parquet"))
    assert len(files) >= 7 * 4
    for path in files:
        pq.read_table(path)  # every file under a family name is complete
    n_params = 29
    for family in ("grad_unreduced", "grad_reduced", "param_origin", "param_updated", "exp_avg",
                   "exp_avg_sq", "update_ratio"):
        df = runs.read_family(rank0, family)
        steps = sorted(df["step"].unique())
        assert steps == list(range(steps[-1] + 1)), family
        assert (steps[-1] + 1) % 3 == 0, family  # only whole windows
        assert (df.groupby("step").size() == n_params).all(), family
