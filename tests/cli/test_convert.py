"""``trainmon convert RUN --to parquet``: a real CSV run converted, read back with both readers, cell by cell."""
from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("pyarrow")

from tests._support.edge_rows import edge_rows as _edge_rows
from tests._support.simulate import nan_input, simulate
from trainmon.cli import main
from trainmon.cli._progress import Progress
from trainmon.output import runs


def _cells(frame: pd.DataFrame) -> list:
    """Every cell, floats as their bits (NaN == NaN, -0.0 != 0.0)."""
    return [[struct.pack("<d", v) if isinstance(v, float) else v for v in row]
            for row in frame.itertuples(index=False)]


@pytest.fixture(scope="module")
def csv_run(tmp_path_factory) -> Path:
    run = simulate(tmp_path_factory.mktemp("conv") / "run", steps=8, micro=2, fault=nan_input)
    _edge_rows(run / "rank0")
    (run / "run.json").write_text('{"world_size": 2}')
    (run / "rank1" / "anomalies.jsonl").write_text("")
    return run


def test_convert_round_trip_is_exact_cell_for_cell_in_every_family(csv_run, tmp_path, capsys):
    out = tmp_path / "pq"
    assert main(["convert", str(csv_run), "--to", "parquet", "-o", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    n_csv = len(list(csv_run.rglob("*.csv")))
    assert summary["files"] == n_csv and len(list(out.rglob("*.parquet"))) == n_csv
    assert not list(out.rglob("*.csv"))
    assert (out / "run.json").read_text() == '{"world_size": 2}' and (out / "rank1" / "anomalies.jsonl").exists()
    compared = 0
    for rank in ("rank0", "rank1"):
        families = runs.family_files(csv_run / rank)
        assert set(runs.family_files(out / rank)) == set(families)
        for family in families:
            a, b = runs.read_family(csv_run / rank, family), runs.read_family(out / rank, family)
            assert list(b.columns) == list(a.columns), family
            assert b.dtypes.to_dict() == a.dtypes.to_dict(), family
            assert _cells(b) == _cells(a), family
            compared += a.size
    assert compared > 5000
    assert summary["rows"] == sum(len(runs.read_csv(p)) for p in csv_run.rglob("*.csv"))


@pytest.mark.slow  # 4.3 s on a loaded 2-core VM
def test_a_converted_run_gives_the_same_anomalies_and_ranks_findings(csv_run, tmp_path, capsys):
    out = tmp_path / "pq"
    assert main(["convert", str(csv_run), "--to", "parquet", "-o", str(out)]) == 0
    capsys.readouterr()
    for command in ("anomalies", "ranks"):
        docs = []
        for run in (csv_run, out):
            assert main([command, str(run), "--json"]) == 0
            doc = json.loads(capsys.readouterr().out)
            doc.pop("run_dir", None)
            docs.append(doc)
        assert docs[0] == docs[1], command
    assert docs[0]["issues"], "the planted NaN is found"


def test_default_target_is_beside_the_run_and_an_existing_one_is_refused(csv_run, tmp_path, capsys):
    run = tmp_path / "myrun"
    import shutil
    shutil.copytree(csv_run, run)
    assert main(["convert", str(run), "--to", "parquet"]) == 0
    assert "converted" in capsys.readouterr().out and (tmp_path / "myrun-parquet" / "rank0").is_dir()
    assert main(["convert", str(run), "--to", "parquet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"trainmon convert: error: {tmp_path / 'myrun-parquet'}: already exists and is not empty; pass another -o"


def test_non_numeric_stat_text_is_one_line_naming_file_line_and_column(tmp_path, capsys):
    rank = tmp_path / "run" / "rank0"
    rank.mkdir(parents=True)
    bad = rank / "grad_reduced_0-0.csv"
    bad.write_text('vpp_stage,name,step,norm,max,shape,dtype\n0,w,0,1.5,2.0,"[2]",torch.float32\n'
                   '0,b,0,np.float64(1.5),2.0,"[2]",torch.float32\n')
    assert main(["convert", str(tmp_path / "run"), "--to", "parquet", "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    # the readers' one validation (trainmon.output.validate) names the file, line and column
    assert f"{bad}, line 3, column 4 (norm): 'np.float64(1.5)' is not a number" in err


def test_progress_draws_on_a_terminal_only_and_clears_its_line():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty, pipe = Tty(), io.StringIO()
    for out in (tty, pipe):
        p = Progress("convert", 2, out=out, interval_s=0)
        p.update(files=1, rows=1500)
        p.update(files=1, rows=10)
        p.done()
    assert "\rconvert [####################] 2/2 files, 1,510 rows" in tty.getvalue()
    assert tty.getvalue().endswith("\r")
    assert pipe.getvalue() == ""
    quiet = Tty()
    p = Progress("x", 1, out=quiet, quiet=True)
    p.update(files=1)
    p.done()
    assert quiet.getvalue() == ""


def test_reading_a_run_reports_every_family_file_and_row_to_the_progress(csv_run):
    from trainmon.diagnosis.engine_buckets import load_table

    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    progress = Progress("reading", 0, out=out, interval_s=0)
    table = load_table(csv_run, progress=progress)
    assert progress.total == progress.files == len(list(csv_run.rglob("*.csv")))
    assert progress.rows == len(table.frame)
    assert f"{progress.files}/{progress.files} files, {len(table.frame):,} rows" in out.getvalue()
