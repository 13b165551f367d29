"""``--cluster ADDRESS``: the per-bucket checks of ``anomalies`` and ``ranks`` (and ``compare``'s
alignment groups) on a real Dask cluster (a ``LocalCluster`` of two worker processes), against the same commands run in-process.

Truth: the local run's JSON, byte for byte (every rule looks within one bucket of names; the
findings come back in bucket order and are sorted the same way).  The workers read the staged
files from ``TRAINMON_ENGINE_WORKDIR`` (here a test folder, the "shared storage").
"""

from __future__ import annotations

import io
import json
import sys
from contextlib import redirect_stdout

import pytest

pytest.importorskip("duckdb")
pytest.importorskip("pyarrow")
pytest.importorskip("distributed")

import distributed

from tests._support.simulate import named_run
from trainmon.cli import main
from trainmon.diagnosis import cluster as cluster_mod
from trainmon.diagnosis import engine, engine_buckets

TINY_BUCKET = 300  # rows per bucket: each fault run below is cut into several buckets


@pytest.fixture(scope="module")
def local_cluster():
    with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None) as cluster:
        yield cluster


@pytest.fixture
def shared(tmp_path, monkeypatch):
    """Small buckets, and the engine's work directories in a folder of the test's own."""
    monkeypatch.setattr(engine_buckets, "ROWS_PER_BUCKET", TINY_BUCKET)
    monkeypatch.setenv("TRAINMON_ENGINE_WORKDIR", str(tmp_path))
    return tmp_path


def _json(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(list(argv))
    return code, out.getvalue()


def _done(cluster, prefix: str) -> int:
    """Tasks of ``prefix`` (the function's name) the scheduler saw finish on a worker."""
    found = cluster.scheduler.task_prefixes.get(prefix)
    return 0 if found is None else found.state_counts["memory"]


@pytest.mark.slow  # starts two worker processes
@pytest.mark.parametrize(
    ("command", "run", "task"), [("anomalies", "nan", "scan_bucket"), ("ranks", "corrupt3", "ranks_bucket")]
)
def test_cluster_findings_are_byte_identical_to_the_local_run(command, run, task, local_cluster, shared):
    path = str(named_run(run))
    code, local = _json(command, path, "--json")
    assert code == 0
    before = _done(local_cluster, task)
    code, remote = _json(command, path, "--json", "--cluster", local_cluster.scheduler_address)
    assert code == 0
    assert remote == local
    found = json.loads(local)
    assert found["count"] > 0  # a fault run: something to find
    # Every bucket ran on the cluster's workers, and the run was cut into several.
    files = engine.run_files(path)
    rows = sum(files.rows.values())
    assert _done(local_cluster, task) - before >= max(3, rows // TINY_BUCKET // 2)
    assert not list(shared.iterdir())  # the work directory is removed after the command


@pytest.mark.slow  # starts two worker processes
def test_compare_on_the_cluster_is_byte_identical_to_the_local_run(local_cluster, shared, monkeypatch):
    """``compare``'s alignment groups (here a few rows each: many groups per family) aligned and
    judged on the workers, each in a DuckDB connection of its own over the shared staged files:
    the same JSON as in one process, a divergence and renamed names included."""
    monkeypatch.setattr(engine, "UNIT_ROWS", 30)
    base, target = str(named_run("base")), str(named_run("act"))
    code, local = _json("compare", base, target, "--json")
    assert code == 0
    before = _done(local_cluster, "judge_group")
    code, remote = _json("compare", base, target, "--json", "--cluster", local_cluster.scheduler_address)
    assert code == 0
    assert remote == local
    found = json.loads(local)
    assert found["first_divergence"] is not None and found["renamed"] > 0 and found["diverged_rows"] > 0
    assert _done(local_cluster, "judge_group") - before > len(found["families"])  # families cut in groups
    assert not list(shared.iterdir())


@pytest.mark.slow  # waits for a connection that cannot come
def test_unreachable_scheduler_is_one_line_exit_2(shared, capsys, monkeypatch):
    from socket import socket

    with socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(cluster_mod, "CONNECT_TIMEOUT_S", 2)
    code = main(["anomalies", str(named_run("nan")), "--cluster", f"tcp://127.0.0.1:{port}"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert f"--cluster tcp://127.0.0.1:{port}: no Dask scheduler answered within 2 s" in err


def test_missing_dask_names_the_extra_to_install(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "distributed", None)  # the import system's "not installed"
    code = main(["ranks", "/no/such/run", "--cluster", "tcp://127.0.0.1:8786"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err == "trainmon ranks: error: --cluster needs Dask's distributed scheduler: pip install trainmon[cluster]"


def test_work_dir_that_is_not_a_folder_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRAINMON_ENGINE_WORKDIR", str(tmp_path / "missing"))
    code = main(["anomalies", str(named_run("nan"))])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "TRAINMON_ENGINE_WORKDIR" in err and "must be an existing folder" in err


def test_map_buckets_in_process_keeps_the_order_and_counts_progress():
    class Count:
        n = 0

        def advance(self):
            self.n += 1

    progress = Count()
    assert cluster_mod.map_buckets(abs, [-3, 1, -2], progress=progress) == [3, 1, 2]
    assert progress.n == 3


@pytest.mark.slow  # uses the two worker processes
def test_a_worker_that_cannot_read_the_staged_files_names_the_shared_folder(local_cluster, tmp_path):
    # What a worker on another machine meets when TRAINMON_ENGINE_WORKDIR is not shared storage.
    shape = engine_buckets.RunShape(
        str(tmp_path), ("grad_reduced",), (("grad_reduced", ("norm",)),), (), (), ("",), ("",)
    )
    missing = engine_buckets.Bucket(shape, (str(tmp_path / "r-0-0.parquet"),), 0, 0, ("w",))
    with pytest.raises(cluster_mod.ClusterError) as err:
        cluster_mod.map_buckets(engine_buckets.read_bucket, [missing], cluster=local_cluster.scheduler_address)
    text = str(err.value)
    assert "a worker cannot read the staged run" in text and "TRAINMON_ENGINE_WORKDIR" in text
    assert len(text.splitlines()) == 1
