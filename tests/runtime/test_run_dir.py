"""Run ids: unique under concurrency, agreed by all ranks of a job, never outside the output root
(issue 12, items 2 and 9)."""
from __future__ import annotations

import logging
import multiprocessing as mp
from pathlib import Path

import pytest

from tests._support.distributed import run_distributed
from trainmon.output.layout import RUN_META
from trainmon.runtime import run_dir


def _claim(root: str, barrier, results) -> None:
    barrier.wait()  # every process asks in the same instant, as 8 launches in one second do
    got = run_dir.create_run_dir(Path(root))
    results.put(None if got is None else got.name)


@pytest.mark.slow
def test_eight_processes_started_in_the_same_second_get_eight_run_folders(tmp_path, monkeypatch):
    monkeypatch.delenv("TRAINMON_RUN_ID", raising=False)
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(8), ctx.Queue()
    procs = [ctx.Process(target=_claim, args=(str(tmp_path), barrier, results)) for _ in range(8)]
    for p in procs:
        p.start()
    names = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert None not in names and len(set(names)) == 8, names
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)
    assert all((tmp_path / n / RUN_META).exists() for n in names)


def test_a_taken_timestamp_gets_the_next_free_suffix(tmp_path, monkeypatch):
    monkeypatch.delenv("TRAINMON_RUN_ID", raising=False)
    monkeypatch.setattr(run_dir, "_timestamp", lambda: "20990101-000000")
    (tmp_path / "20990101-000000").mkdir()
    (tmp_path / "20990101-000000-1").mkdir()
    assert run_dir.create_run_dir(tmp_path).name == "20990101-000000-2"


def _ranks_agree(rank: int, world: int, root: str) -> str:
    run_dir._timestamp = lambda: "20990101-000000"  # the same second on every rank
    if rank == 0:
        (Path(root) / "20990101-000000").mkdir(parents=True)  # taken by another job
    return run_dir.create_run_dir(Path(root)).name


@pytest.mark.slow
def test_all_ranks_of_one_job_agree_on_the_suffixed_run_id(tmp_path, monkeypatch):
    monkeypatch.delenv("TRAINMON_RUN_ID", raising=False)
    names = run_distributed(_ranks_agree, 4, args=(str(tmp_path),))
    assert names == ["20990101-000000-1"] * 4


def test_a_chosen_run_id_is_reused_on_purpose(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINMON_RUN_ID", "resumed")
    assert run_dir.create_run_dir(tmp_path).name == "resumed"
    assert run_dir.create_run_dir(tmp_path).name == "resumed"


@pytest.mark.parametrize("bad", ["../escaped", "a/b", "/abs", "..", ".", "a\\b", "  "])
def test_a_run_id_with_a_path_separator_is_rejected_and_nothing_escapes(tmp_path, monkeypatch, caplog, bad):
    root = tmp_path / "out"
    monkeypatch.setenv("TRAINMON_RUN_ID", bad)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        got = run_dir.create_run_dir(root)
    assert got is not None and got.parent == root and got.name != bad.strip()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "nothing written outside the output root"
    assert sum("TRAINMON_RUN_ID" in r.getMessage() for r in caplog.records) == 1
