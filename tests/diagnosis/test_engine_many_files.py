"""Many small files in the DuckDB engine (issue 34, item 14).

msprobe's layout (``step_count_per_record: 1``) writes one file per family per step: a 100k-step
run is 100,000 one-row files, and one DuckDB read over all of them ran out of 256 MB and of 1 GB.
The engine reads at most ``FILES_PER_READ`` files per statement; the results are those of reading
them all at once (the in-memory reader is the truth), and the memory stays bounded.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from tests._support.runs import REPO
from trainmon.analysis.rules import Rules
from trainmon.diagnosis import engine, engine_buckets, sql
from trainmon.diagnosis.engine_buckets import engine_ranks
from trainmon.diagnosis.ranks import check_ranks
from trainmon.diagnosis.engine_buckets import load_table
from trainmon.diagnosis.scan import scan
from trainmon.errors import TrainmonError
from trainmon.testing.synthetic_run import SyntheticRun

pytest.importorskip("duckdb")


def _found(anomalies) -> list[dict]:
    return [a.to_json(position=True) for a in anomalies]


@pytest.fixture(scope="module", params=["csv", "parquet"])
def small_files(request, tmp_path_factory):
    fmt = request.param
    if fmt == "parquet":
        pytest.importorskip("pyarrow")
    run = tmp_path_factory.mktemp(f"many_{fmt}") / "run"
    SyntheticRun(ranks=2, steps=16, params=4, steps_per_file=1).write(run, fmt)
    # a header variant: some windows have a second file with other columns (``ops`` changed)
    for rank in (0, 1):
        for step in (5, 11):
            src = run / f"rank{rank}" / f"grad_reduced_{step}-{step}.{fmt}"
            if fmt == "csv":
                import pandas as pd

                df = pd.read_csv(src).drop(columns=["mean", "min"]).head(2)
                df["name"] = "extra." + df["name"]
                df.to_csv(src.parent / f"grad_reduced_{step}-{step}.1.csv", index=False)
            else:
                import pyarrow.parquet as pq

                table = pq.read_table(src).drop_columns(["mean", "min"]).slice(0, 2)
                names = [f"extra.{n}" for n in table.column("name").to_pylist()]
                import pyarrow as pa

                table = table.set_column(table.column_names.index("name"), "name", pa.array(names))
                pq.write_table(table, src.parent / f"grad_reduced_{step}-{step}.1.parquet")
    return run


@pytest.mark.slow
@pytest.mark.parametrize("per_read", [1, 5])
def test_reading_few_files_per_statement_finds_what_one_read_of_all_finds(small_files, monkeypatch, per_read):
    table = load_table(small_files)  # every file in one read statement
    want = _found(scan(table))
    assert want, "the planted NaN and spike"
    monkeypatch.setattr(sql, "FILES_PER_READ", per_read)
    files = engine.run_files(small_files)
    assert _found(engine_buckets.bucket_scan_all(files, Rules()).anomalies) == want
    assert engine_ranks(files) == check_ranks(table)


def test_batches_hold_at_most_files_per_read(small_files, monkeypatch):
    monkeypatch.setattr(sql, "FILES_PER_READ", 4)
    files = engine.run_files(small_files)
    with engine.Engine() as eng:
        fam = sql.Family(eng.con, "grad_reduced", files.files["grad_reduced"], files.family_stats["grad_reduced"],
                             headers=files.headers)
        sizes = [sum(sql.count("/grad_reduced_") for sql in batch) for batch in fam._batches()]
    assert max(sizes) <= 4 and sum(sizes) == len(files.files["grad_reduced"])


def test_a_bad_cell_in_a_late_batch_is_named_by_file_line_and_column(tmp_path, monkeypatch):
    run = tmp_path / "run"
    SyntheticRun(ranks=1, steps=20, params=3, steps_per_file=1, families=("grad_reduced",)).write(run)
    bad = run / "rank0" / "grad_reduced_17-17.csv"
    lines = bad.read_text().splitlines()
    cells = lines[3].split(",")
    cells[4] = "oops"  # the third row's mean
    lines[3] = ",".join(cells)
    bad.write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(sql, "FILES_PER_READ", 3)
    with pytest.raises(TrainmonError) as engine_err:
        engine_buckets.bucket_scan_all(engine.run_files(run), Rules())
    assert f"{bad}:4: column 'mean' holds 'oops'" in str(engine_err.value)


def _tiny_files(rank_dir: Path, n: int) -> None:
    """``n`` one-row files of one family, one per step (msprobe's layout), written directly."""
    rank_dir.mkdir(parents=True)
    head = "vpp_stage,name,step,norm,mean,min,max,nans,infs,shape,dtype\n"
    for s in range(n):
        row = f"0,layer.0.weight,{s},{1.0 + (s % 7) * 0.01!r},0.5,-1.0,1.0,0,0,\"[4, 2]\",torch.float32\n"
        (rank_dir / f"grad_reduced_{s}-{s}.csv").write_text(head + row)


@pytest.mark.slow
def test_20000_one_row_files_are_scanned_in_256mb_and_bounded_memory(tmp_path):
    n = 20_000
    _tiny_files(tmp_path / "run" / "rank0", n)
    child = (
        "import resource, sys\n"
        "from trainmon.cli import main\n"
        "code = main(['anomalies', sys.argv[1], '--engine', 'duckdb', '--json'])\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
        "sys.exit(code)\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), TRAINMON_ENGINE_MEMORY="256MB")
    proc = subprocess.run([sys.executable, "-c", child, str(tmp_path / "run")], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert doc["count"] == 0 and doc["families"] == ["grad_reduced"]
    peak_mb = int(proc.stderr.strip().splitlines()[-1]) / 1024  # ru_maxrss: KiB on Linux
    # Alone: ~290 MB; once 879 MB inside a loaded parallel full run (cause not found yet). Before
    # the batched reads this run needed 2.4 GB resident and failed even at a 1 GB cap.
    assert peak_mb < 1200, f"peak RSS {peak_mb:.0f} MB"
    assert resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024 < 1200
