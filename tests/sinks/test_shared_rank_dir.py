"""Several sinks of one process writing one rank directory at once (an escalation's flight
recorder and its window do): every row of every sink is kept, in files every reader reads.

The CI failure this pins down: two CSV sinks made ``actv_0-99.csv`` at the same moment under the
same temporary name; one removed the other's temporary file and that sink's rows were lost."""
from __future__ import annotations

import logging
import threading

import pytest

from trainmon.output import runs
from trainmon.sinks import SinkOptions, create_sink
from trainmon.stats.rows import StatRow, StepRows

WRITERS, STEPS, TENSORS = 3, 60, 3


def _rows(writer: int, step: int) -> StepRows:
    return StepRows.of([StatRow("actv", f"w{writer}.layer.{i}", step, {"norm": step + i / 3}, (2, 3), "torch.float32")
                        for i in range(TENSORS)])


@pytest.mark.parametrize("fmt", ["csv", "parquet", "csv-without-hard-links"])
def test_sinks_of_one_process_creating_the_same_files_at_once_lose_no_row(tmp_path, fmt, caplog, monkeypatch):
    if fmt == "parquet":
        pytest.importorskip("pyarrow")
    if fmt == "csv-without-hard-links":
        # A file system that refuses hard links (vfat, some FUSE mounts; this kernel has none to
        # mount here), as os.link reports it there: the CSV sink publishes by renaming instead.
        def no_link(src, dst, *args, **kwargs):
            raise PermissionError(1, "Operation not permitted", str(src), None, str(dst))

        monkeypatch.setattr("os.link", no_link)
        fmt = "csv"
    rank_dir = tmp_path / "rank0"
    # one step per file: every step is a race between the sinks to create the same file
    sinks = [create_sink(fmt, SinkOptions(rank_dir=rank_dir, step_count_per_record=1)) for _ in range(WRITERS)]
    barrier = threading.Barrier(WRITERS)

    def write(writer: int) -> None:
        for step in range(STEPS):
            barrier.wait()
            sinks[writer].write(_rows(writer, step), step=step)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(WRITERS)]
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for sink in sinks:
            sink.close()
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    df = runs.read_family(rank_dir, "actv")
    got = sorted(zip(df["name"], df["step"].astype(int), df["norm"]))
    assert got == sorted((f"w{w}.layer.{i}", s, s + i / 3) for w in range(WRITERS) for s in range(STEPS)
                         for i in range(TENSORS))
    assert not [p.name for p in rank_dir.iterdir() if p.name.endswith(".tmp")]
