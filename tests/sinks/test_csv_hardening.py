"""CSV crash safety (issue 12, items 5 and 6): a full disk or a SIGKILL never leaves an empty or
header-only family file, and an output folder removed mid-run is noticed and made again."""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pandas as pd
import pytest

from trainmon.output.layout import parse_family_file
from trainmon.sinks import SinkOptions
from trainmon.sinks.csv import CsvSink
from trainmon.stats.rows import StatRow, StepRows

REPO = Path(__file__).resolve().parents[2]
HEADER = "vpp_stage,name,step,norm,mean,shape,dtype\n"


def _rows(families, step, n):
    return StepRows.of([StatRow(f, f"layer.{i}.weight", step, {"norm": step + i / 3, "mean": 0.5 * i}, (i + 1, 3),
                                "torch.float32") for f in families for i in range(n)])


def _assert_whole_files(folder: Path) -> list[Path]:
    """Every family file: non-empty, its header first, whole rows only, readable by pandas."""
    files = [p for p in folder.iterdir() if parse_family_file(p) is not None]
    for path in files:
        raw = path.read_bytes()
        assert raw.startswith(HEADER.encode()) and len(raw) > len(HEADER), (path.name, raw[:80])
        assert raw.endswith(b"\n"), path.name
        df = pd.read_csv(path)
        assert len(df) > 0 and df.notna().all().all(), path.name
    return files


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A real 64 KiB tmpfs (needs the right to mount: root in a container); skipped elsewhere."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    if shutil.which("mount") is None or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
                                                       capture_output=True, check=False).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (the RLIMIT_FSIZE test covers the same path)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_tmpfs_leaves_no_empty_or_header_only_csv(tiny_tmpfs, caplog):
    sink = CsvSink(SinkOptions(rank_dir=tiny_tmpfs / "run" / "rank0", step_count_per_record=1))
    families = [f"fam{j}" for j in range(6)]
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        for step in range(60):  # a new file per family and step: the disk fills while creating files
            sink.write(_rows(families, step, 12), step)
        sink.close()
    assert sink.lost_rows > 0, "the disk did fill up"
    files = _assert_whole_files(tiny_tmpfs / "run" / "rank0")
    assert files, "what fitted was written"
    assert not list((tiny_tmpfs / "run" / "rank0").glob(".*.tmp")), "no temporary file is left behind"
    assert sum("cannot write monitor output" in r.getMessage() for r in caplog.records) == 1


_FSIZE_SCRIPT = textwrap.dedent("""
    import resource, signal, sys
    from pathlib import Path
    from trainmon.stats.rows import StatRow, StepRows
    from trainmon.sinks import SinkOptions
    from trainmon.sinks.csv import CsvSink

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # EFBIG instead of dying
    resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))
    sink = CsvSink(SinkOptions(rank_dir=Path(sys.argv[1]), step_count_per_record=1))
    for step in range(5):
        rows = [StatRow("small", "w", step, {"norm": 1.0, "mean": 2.0}, (3, 3), "torch.float32")]
        rows += [StatRow("big", f"layer.{i}.weight", step, {"norm": i / 3, "mean": i / 7}, (3, 3), "torch.float32")
                 for i in range(100)]   # the header and first rows do not fit in 2000 bytes
        sink.write(StepRows.of(rows), step)
    sink.close()
    print(sink.lost_rows)
""")


@pytest.mark.slow
def test_a_new_file_whose_first_rows_do_not_fit_is_not_created(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", _FSIZE_SCRIPT, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=60, check=True)
    assert int(done.stdout) == 500
    files = _assert_whole_files(tmp_path)
    assert sorted(p.name for p in files) == [f"small_{s}-{s}.csv" for s in range(5)], "no big_*.csv at all"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "step_times.tsv") == sorted(p.name for p in files)


_KILL_SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    from trainmon.stats.rows import StatRow, StepRows
    from trainmon.sinks import SinkOptions
    from trainmon.sinks.csv import CsvSink

    sink = CsvSink(SinkOptions(rank_dir=Path(sys.argv[1]), step_count_per_record=1))
    step = 0
    while True:   # a new file per family and step: kills land while files are being created
        sink.write(StepRows.of([StatRow(f"fam{j}", f"layer.{i}.weight", step, {"norm": step + i / 3, "mean": 0.5 * i},
                                        (i + 1, 3), "torch.float32") for j in range(4) for i in range(300)]), step)
        if step == 2:
            print("running", flush=True)
        step += 1
""")


@pytest.mark.slow
def test_sigkill_while_files_are_created_never_leaves_an_empty_csv(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for trial in range(8):
        out = tmp_path / f"trial{trial}"
        proc = subprocess.Popen([sys.executable, "-c", _KILL_SCRIPT, str(out)], stdout=subprocess.PIPE, env=env)
        try:
            assert proc.stdout.readline().strip() == b"running"
            # a different moment in each trial: spin a little on this side, then kill
            for _ in range(trial * 20000):
                pass
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            proc.stdout.close()
        files = [p for p in out.iterdir() if parse_family_file(p) is not None]
        assert len(files) >= 12
        for path in files:
            raw = path.read_bytes()
            assert raw.startswith(HEADER.encode()) and len(raw) > len(HEADER), (trial, path.name, len(raw))


def test_an_output_folder_removed_mid_window_is_noticed_and_recreated(tmp_path, caplog):
    rank_dir = tmp_path / "run" / "rank0"
    sink = CsvSink(SinkOptions(rank_dir=rank_dir, step_count_per_record=100))
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        for step in range(5):
            sink.write(_rows(["grad_reduced", "exp_avg"], step, 3), step)
        shutil.rmtree(tmp_path / "run")
        for step in range(5, 12):
            sink.write(_rows(["grad_reduced", "exp_avg"], step, 3), step)
        sink.close()
    removed = [r for r in caplog.records if "was deleted while this run writes it" in r.getMessage()]
    assert len(removed) == 1, [r.getMessage() for r in caplog.records]
    for family in ("grad_reduced", "exp_avg"):
        df = pd.read_csv(rank_dir / f"{family}_0-99.csv")
        assert sorted(set(df["step"])) == list(range(5, 12)), "every step after the removal is kept"
        assert (df.groupby("step").size() == 3).all()
    assert sink.lost_rows == 0


@pytest.mark.slow
def test_a_monitored_run_whose_output_folder_is_removed_keeps_recording(tmp_path, monkeypatch, make_config, caplog):
    import torch

    from tests._support.runs import read_family
    from trainmon import TrainerMon
    from trainmon.testing.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    monkeypatch.setenv("TRAINMON_RUN_ID", f"removed-{uuid.uuid4().hex[:6]}")
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=1))
    opt = torch.optim.Adam(model.parameters())
    mon = TrainerMon(make_config(wg_distribution=True, step_count_per_record=100, ops=["norm"]))
    mon.set_monitor(model, optimizer=opt)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        for step, batch in enumerate(synthetic_batches(model.cfg, 2, 8)):
            if step == 4:
                written = mon.run_dir / "rank0" / "grad_reduced_0-99.csv"
                for _ in range(500):  # the writer thread has the file open: now remove it all
                    if written.exists():
                        break
                    time.sleep(0.01)
                for _ in range(500):  # the writer may add a file while the tree goes ("Directory not empty")
                    shutil.rmtree(mon.run_dir, ignore_errors=True)
                    if not mon.run_dir.exists():
                        break
                    time.sleep(0.01)
                assert not mon.run_dir.exists()
            model.loss(batch).backward()
            opt.step()
            opt.zero_grad()
        mon.close()
    df = read_family(mon.run_dir / "rank0", "grad_reduced")
    assert set(range(5, 8)) <= set(df["step"]), sorted(set(df["step"]))
    assert sum("was deleted while this run writes it" in r.getMessage() for r in caplog.records) == 1
