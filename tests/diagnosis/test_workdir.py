"""The engine's work directories: a killed command's directory is removed by the next command,
a running command's never; real processes, real SIGKILL, the real CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("duckdb")
fcntl = pytest.importorskip("fcntl")

from trainmon.diagnosis.workdir import LOCK, PREFIX, remove_stale
from trainmon.testing.synthetic_run import SyntheticRun

# A process that opens an Engine (connection and work directory), stages a file there as
# ``ranks`` does, says where, and waits to be killed.
_HOLDER = """
import sys, time
from trainmon.diagnosis.engine import Engine
with Engine() as eng:
    eng.con.execute(f"COPY (SELECT range AS x FROM range(100000)) TO '{eng.dir / 'staged.parquet'}' (FORMAT parquet)")
    print(eng.dir, flush=True)
    time.sleep(120)
"""


def _holder(tmp: Path) -> tuple[subprocess.Popen, Path]:
    env = dict(os.environ, TMPDIR=str(tmp))
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line, "the holder process did not start"
    return proc, Path(line)


@pytest.mark.slow  # 3.0-5.6 s on a loaded 2-core VM (2026-12-06)
@pytest.mark.parametrize("engine", ["duckdb", "memory"])  # memory: what --engine auto picks for a small run
def test_a_killed_commands_work_directory_is_removed_by_the_next_command_a_live_ones_kept(tmp_path, engine):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    run = tmp_path / "run"
    SyntheticRun(ranks=2, steps=20, params=5).write(run, "csv")
    killed, killed_dir = _holder(tmp)
    live, live_dir = _holder(tmp)
    foreign = tmp / (PREFIX + "older-trainmon")  # no lock file: not judged, never removed
    foreign.mkdir()
    (foreign / "spill.tmp").write_bytes(b"x")
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        assert (killed_dir / "staged.parquet").is_file() and (killed_dir / LOCK).is_file()  # SIGKILL left it
        env = dict(os.environ, TMPDIR=str(tmp))
        proc = subprocess.run(
            [sys.executable, "-m", "trainmon", "anomalies", str(run), "--engine", engine, "--json"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["count"] >= 1  # the command did its work (the planted faults)
        assert not killed_dir.exists()
        assert (live_dir / "staged.parquet").is_file() and live.poll() is None
        assert (foreign / "spill.tmp").is_file()
        # The command removed its own directory, and nothing else is left but the two kept.
        assert sorted(p.name for p in tmp.iterdir()) == sorted([live_dir.name, foreign.name])
    finally:
        live.kill()
        live.wait(10)
        killed.kill()
    # The live holder is dead now: the next look removes its directory, not the foreign one.
    assert remove_stale(tmp) == 1
    assert not live_dir.exists() and foreign.is_dir()


def test_a_lock_held_by_a_live_process_is_never_taken_for_stale(tmp_path):
    # Looked at again and again while its holder lives: never removed.
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    live, live_dir = _holder(tmp)
    try:
        assert [remove_stale(tmp) for _ in range(20)] == [0] * 20
        assert (live_dir / "staged.parquet").is_file()
    finally:
        live.kill()
        live.wait(10)
    deadline = time.monotonic() + 10
    while remove_stale(tmp) == 0 and time.monotonic() < deadline:  # the kernel drops the lock at exit
        time.sleep(0.05)
    assert not live_dir.exists()
