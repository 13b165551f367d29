"""``trainmon csv2tb``: real CSV runs (written by the CSV sink) converted and read back with
TensorBoard's own loader, a real ``tensorboard`` server, and a real training run."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tests._support.runs import run_cli
from tests.sinks.test_tensorboard import (
    assert_same_scalars,
    assert_same_summary,
    expected_from_csv,
    expected_scalars,
    expected_summary_from_csv,
    family_rows,
    load_scalars,
)
from trainmon.cli import main
from trainmon.cli.csv2tb import CONVERTED_NAME, convert_rank
from trainmon.sinks import SinkOptions, create_sink
from trainmon.sinks.csv import CsvSink
from trainmon.stats.rows import StepRows

REPO = Path(__file__).resolve().parents[2]


def rank_rows(step: int, rank: int) -> list:
    """``family_rows`` made different per rank; from step 5 on grad_reduced records other ops
    (a config reload), which makes the CSV sink start a header-variant file."""
    rows = []
    for row in family_rows(step):
        stats = {k: (v * (rank + 1) if isinstance(v, float) else v) for k, v in row.stats.items()}
        if row.family == "grad_reduced" and step >= 5:
            stats = {"norm": stats["norm"], "max": stats["max"]}
        rows.append(dataclasses.replace(row, stats=stats))
    return rows


def make_run(run_dir: Path, ranks=(0, 1), steps=range(7), formats=("csv",)) -> dict[int, list]:
    written = {}
    for rank in ranks:
        sink = create_sink(list(formats), SinkOptions(rank_dir=run_dir / f"rank{rank}", rank=rank,
                                                      step_count_per_record=3))
        written[rank] = []
        for step in steps:
            rows = rank_rows(step, rank)
            sink.write(StepRows.of(rows), step)
            written[rank].extend(rows)
        sink.close()
    return written


def csv2tb(*args: str) -> int:
    """csv2tb in the per-tensor layout, whose series these tests compare row by row."""
    return main(["csv2tb", *map(str, args), "--tags", "per_tensor"])


def csv2tb_default(*args: str) -> int:
    return main(["csv2tb", *map(str, args)])


def event_files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_converts_every_family_of_every_rank(tmp_path, capsys):
    run = tmp_path / "out" / "run1"
    written = make_run(run)
    assert (run / "rank0" / "grad_reduced_3-5.1.csv").is_file()     # the header variant is there
    assert csv2tb(run) == 0
    assert "converted 2 rank(s) of 1 run(s)" in capsys.readouterr().out
    for rank, rows in written.items():
        target = run / "tensorboard" / f"rank{rank}"
        assert event_files(target) == [CONVERTED_NAME]
        got = load_scalars(target)
        assert_same_scalars(got, expected_scalars(rows))
        assert {t.split(".", 1)[0] for t in got} == {"grad_unreduced", "grad_reduced", "param_origin",
                                                     "param_updated", "exp_avg", "exp_avg_sq", "update_ratio",
                                                     "actv", "actv_grad", "comm"}


def test_rerunning_replaces_instead_of_duplicating(tmp_path):
    run = tmp_path / "run1"
    written = make_run(run, ranks=(0,), steps=range(4))
    assert csv2tb(run) == 0
    target = run / "tensorboard" / "rank0"
    (target / ".csv2tb-99999.tmp").write_bytes(b"left by a killed conversion")
    # the run went on: two more steps appended to the same CSV files
    sink = CsvSink(SinkOptions(rank_dir=run / "rank0", step_count_per_record=3))
    for step in (4, 5):
        rows = rank_rows(step, 0)
        sink.write(StepRows.of(rows), step)
        written[0].extend(rows)
    sink.close()
    assert csv2tb(run) == 0
    assert csv2tb(run) == 0
    assert event_files(target) == [CONVERTED_NAME]
    got = load_scalars(target)
    assert_same_scalars(got, expected_scalars(written[0]))       # each step exactly once
    assert all(len(series) == 6 for tag, series in got.items() if tag.startswith("exp_avg."))


def test_output_dir_with_several_runs_and_o(tmp_path, capsys):
    root = tmp_path / "monitor_output"
    runs = {name: make_run(root / name, ranks=(0,), steps=range(3)) for name in ("run_a", "run_b")}
    out = tmp_path / "events"
    assert csv2tb(root, "-o", out) == 0
    assert "converted 2 rank(s) of 2 run(s)" in capsys.readouterr().out
    for name, written in runs.items():
        assert_same_scalars(load_scalars(out / name / "rank0"), expected_scalars(written[0]))
        assert not (root / name / "tensorboard").exists()


def test_one_rank_dir_converts_that_rank_only(tmp_path):
    run = tmp_path / "run1"
    written = make_run(run, ranks=(0, 1), steps=range(2))
    assert csv2tb(run / "rank1") == 0
    assert not (run / "tensorboard" / "rank0").exists()
    assert_same_scalars(load_scalars(run / "tensorboard" / "rank1"), expected_scalars(written[1]))


def test_rank_with_native_events_is_skipped_and_o_converts_it(tmp_path, capsys):
    run = tmp_path / "run1"
    written = make_run(run, ranks=(0,), steps=range(4), formats=("csv", "tensorboard"))
    native_dir = run / "tensorboard" / "rank0"
    native_files = event_files(native_dir)
    assert csv2tb_default(run) == 0
    assert "skipped" in capsys.readouterr().out
    assert event_files(native_dir) == native_files                  # untouched, nothing added
    assert csv2tb_default(run, "-o", tmp_path / "conv") == 0
    native, converted = load_scalars(native_dir), load_scalars(tmp_path / "conv" / "run1" / "rank0")
    assert_same_scalars(converted, native)                          # the same default layout
    assert csv2tb(run, "-o", tmp_path / "per_tensor") == 0
    assert_same_scalars(load_scalars(tmp_path / "per_tensor" / "run1" / "rank0"), expected_scalars(written[0]))


def test_unreadable_csv_is_reported_and_the_rest_converted(tmp_path, capsys):
    run = tmp_path / "run1"
    written = make_run(run, ranks=(0,), steps=range(3))
    bad = run / "rank0" / "grad_reduced_9-11.csv"
    bad.write_bytes(b"\xff\xfe\x00garbage\x00\n\x80\x81")
    assert csv2tb(run) == 2  # bad input: exit 2, as every command
    assert f"{bad}, line 1, column 3: NUL byte (the file is damaged); skipped" in capsys.readouterr().err
    assert_same_scalars(load_scalars(run / "tensorboard" / "rank0"), expected_scalars(written[0]))


def test_cells_that_are_not_numbers_convert_as_the_native_sink_writes_them(tmp_path):
    from trainmon.stats.rows import StatRow, StepRows

    run = tmp_path / "run1"
    sink = create_sink(["csv", "tensorboard"], SinkOptions(rank_dir=run / "rank0"))
    for step in range(2):
        row = StatRow("grad_reduced", "w", step, {"norm": None, "max": "n/a", "min": 1.5 + step})
        sink.write(StepRows.of([row]), step)
    sink.close()
    assert csv2tb_default(run, "-o", tmp_path / "conv") == 0
    native, converted = load_scalars(run / "tensorboard" / "rank0"), load_scalars(tmp_path / "conv" / "run1" / "rank0")
    assert_same_scalars(converted, native)
    assert native["grad_reduced.min/min"] == [(0, 1.5), (1, 2.5)]
    assert all(math.isnan(v) for _, v in native["grad_reduced.norm/global"] + native["grad_reduced.max/max"])
    assert native["grad_reduced.norm/nonfinite"] == [(0, 1.0), (1, 1.0)]


def test_progress_counts_every_csv_byte(tmp_path):
    run = tmp_path / "run1"
    make_run(run, ranks=(0,), steps=range(4))
    seen: list[int] = []
    result = convert_rank(run / "rank0", tmp_path / "tb", progress=seen.append)
    assert sum(seen) == sum(p.stat().st_size for p in (run / "rank0").glob("*.csv"))
    assert result.rows > 0 and result.scalars > result.rows and not result.unreadable


@pytest.mark.parametrize("flag", [[], ["--no-progress"]])
def test_progress_bar_on_a_terminal(tmp_path, monkeypatch, flag):
    """stderr on a real pseudo-terminal: tqdm draws the bar unless --no-progress (on a pipe, as
    in every other test here, it stays silent)."""
    import fcntl
    import pty
    import struct
    import termios

    import trainmon.cli.csv2tb as csv2tb_module

    run = tmp_path / "run1"
    make_run(run, ranks=(0,), steps=range(3))
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    os.set_blocking(master, False)
    monkeypatch.setattr(csv2tb_module, "PROGRESS_DELAY_S", 0.0)   # any conversion is "long" here
    with open(slave, "w", closefd=True) as terminal:
        monkeypatch.setattr(sys, "stderr", terminal)
        assert csv2tb(run, *flag) == 0
        terminal.flush()
        try:
            shown = os.read(master, 65536).decode()
        except BlockingIOError:
            shown = ""
    os.close(master)
    if flag:
        assert shown == ""
    else:
        assert "csv2tb:" in shown and "%|" in shown and "B/s" in shown




@pytest.mark.parametrize("case", ["missing", "file", "no_runs", "output_is_file"])
def test_bad_paths_are_one_line_and_exit_2(tmp_path, case):
    run = tmp_path / "run1"
    (run / "rank0").mkdir(parents=True)
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    (tmp_path / "empty").mkdir()
    args, needle = {"missing": ([tmp_path / "nope"], "nope: no such directory"),
                    "file": ([a_file], "file.txt: not a directory"),
                    "no_runs": ([tmp_path / "empty"], "empty: no trainmon run here"),
                    "output_is_file": ([run, "-o", a_file], "file.txt: not a directory")}[case]
    proc = run_cli("csv2tb", *map(str, args))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainmon csv2tb: error: ") and needle in lines[0]


def test_help_of_the_command_and_the_console_script():
    proc = run_cli("csv2tb", "--help")
    assert proc.returncode == 0 and "RUN_OR_OUTPUT_DIR" in proc.stdout and "-o DIR" in proc.stdout
    assert "csv2tb" in run_cli("--help").stdout
    script = shutil.which("trainmon")
    if script:
        assert subprocess.run([script, "csv2tb", "--help"], capture_output=True, timeout=120).returncode == 0


# ---------------------------------------------------------------------------------------------
# A real TensorBoard server
# ---------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str, **query) -> object:
    url = f"http://127.0.0.1:{port}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def _wait_for_tags(port: int, server, runs: list[str], tag: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.poll() is None, "tensorboard exited"
        try:
            tags = _get(port, "/data/plugin/scalars/tags")
            if all(tag in tags.get(run, {}) for run in runs):
                return
        except OSError:
            pass                                    # not listening yet
        time.sleep(0.5)
    raise AssertionError(f"tensorboard did not serve {tag} for {runs} within {timeout} s")


@pytest.mark.slow
def test_tensorboard_server_serves_native_and_converted_series(tmp_path):
    logdir = tmp_path / "logdir"
    make_run(logdir / "run1", ranks=(0,), steps=range(6), formats=("csv", "tensorboard"))
    assert csv2tb_default(logdir / "run1", "-o", logdir / "converted") == 0
    tag = "grad_reduced.max/max"
    want = [[step, value] for step, value in load_scalars(logdir / "run1" / "tensorboard" / "rank0")[tag]]
    csv = pd.concat([pd.read_csv(p) for p in sorted((logdir / "run1" / "rank0").glob("grad_reduced_*.csv"))])
    assert [v for _, v in want] == [np.float32(np.nanmax(g["max"])) for _, g in csv.groupby("step")]
    runs = ["run1/tensorboard/rank0", "converted/run1/rank0"]
    exe = shutil.which("tensorboard")
    cmd = [exe] if exe else [sys.executable, "-m", "tensorboard.main"]
    port = _free_port()
    server = subprocess.Popen([*cmd, "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_tags(port, server, runs, tag)
        for run in runs:
            series = _get(port, "/data/plugin/scalars/scalars", run=run, tag=tag)
            # the server spells non-finite values "Infinity" / "-Infinity" / "NaN"
            got = [[step, float(value)] for _, step, value in series]
            assert len(got) == len(want) and all(
                g[0] == w[0] and (g[1] == w[1] or (math.isnan(g[1]) and math.isnan(w[1])))
                for g, w in zip(got, want)), (run, got, want)
        assert any(not math.isfinite(v) for _, v in want)    # the tag exercises the special values
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


# ---------------------------------------------------------------------------------------------
# A real training run: native TB == CSV == converted TB
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_training_run_native_equals_csv_equals_converted(tmp_path, output_root, make_config):
    import torch

    from trainmon import TrainerMon, seed_all
    from trainmon.testing.tiny_gpt import GPTConfig, TinyGPT, train

    config = make_config(wg_distribution=True, mv_distribution=True, param_distribution=True,
                         ur_distribution=True, ops=["norm", "mean", "min", "max", "std", "nans", "infs", "zeros"],
                         step_count_per_record=2, format=["csv", "tensorboard"])
    seed_all(0)
    model = TinyGPT(GPTConfig(layers=1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with TrainerMon(config) as monitor:
        monitor.set_monitor(model, grad_acc_steps=2, optimizer=optimizer)
        train(model, optimizer, steps=5, grad_acc_steps=2)
    run = monitor.run_dir
    native = load_scalars(run / "tensorboard" / "rank0")
    assert {t.split(".", 1)[0] for t in native} == {"grad_unreduced", "grad_reduced", "param_origin",
                                                    "param_updated", "exp_avg", "exp_avg_sq", "update_ratio"}
    assert_same_summary(native, expected_summary_from_csv(run / "rank0"))
    assert {s for s, _ in native["grad_reduced.norm/global"]} == set(range(5))
    assert csv2tb_default(run, "-o", tmp_path / "conv") == 0
    assert_same_scalars(load_scalars(tmp_path / "conv" / run.name / "rank0"), native)
    assert csv2tb(run, "-o", tmp_path / "per_tensor") == 0
    assert_same_scalars(load_scalars(tmp_path / "per_tensor" / run.name / "rank0"), expected_from_csv(run / "rank0"))
    # one recorded time per step, and both the native and the converted events carry it
    from tests.sinks.test_tensorboard import load_accumulator
    from trainmon.output.runs import step_times

    times = step_times(run / "rank0")
    assert sorted(times) == list(range(5)) and all(a < b for a, b in zip(times.values(), list(times.values())[1:]))
    for events in (run / "tensorboard" / "rank0", tmp_path / "conv" / run.name / "rank0"):
        acc = load_accumulator(events)
        assert {(e.step, e.wall_time) for e in acc.Scalars("grad_reduced.norm/global")} == set(times.items())
