"""Every command on damaged runs and bad options (issue 12, item 7): one line naming the file,
line and column (or the option), exit code 2, never a traceback, never a damaged cell read as NaN.

The valid run is written by the real CSV sink; each case damages a copy of it the way the
campaign did.  The fuzz test damages one small file in many ways (a cut at every byte offset,
random byte flips, header edits) and runs the commands in-process through ``trainmon.cli.main``,
so an exception anywhere is a test failure with its traceback.
"""
from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path

import pytest

from trainmon.cli import main
from trainmon.sinks import SinkOptions
from trainmon.sinks.csv import CsvSink
from trainmon.stats.rows import StatRow, StepRows

NAMES = ("layer.0.weight", "layer.0.bias")
FAMILIES = ("grad_reduced", "param_origin")


def _write_run(run: Path, ranks=(0, 1), steps=range(4), names=NAMES) -> Path:
    for rank in ranks:
        sink = CsvSink(SinkOptions(rank_dir=run / f"rank{rank}", step_count_per_record=2))
        for step in steps:
            sink.write(StepRows.of([StatRow(f, n, step, {"norm": 1.0 + step / 8 + i, "mean": 0.25 * i, "max": 2.0 + i},
                                            (4, 2), "torch.float32")
                                    for f in FAMILIES for i, n in enumerate(names)]), step)
        sink.close()
    return run


@pytest.fixture(scope="module")
def good_run(tmp_path_factory) -> Path:
    return _write_run(tmp_path_factory.mktemp("good") / "run")


@pytest.fixture
def run(good_run, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(good_run, copy)
    return copy


def _cli(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse: exit 2 after its usage line
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def _one_error_line(capsys, *argv) -> str:
    code, _, err = _cli(capsys, *argv)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and ": error: " in lines[0], (code, err)
    return lines[0]


FILE = "rank0/grad_reduced_0-1.csv"


def _edit(run: Path, edit) -> Path:
    path = run / FILE
    path.write_bytes(edit(path.read_bytes()))
    return path


@pytest.mark.parametrize("command", ["anomalies", "ranks"])
@pytest.mark.parametrize("damage, where, what", [
    (lambda b: b.replace(b"vpp_stage,name,step", b"vpp,name,step", 1), "line 1", "not a trainmon header"),
    (lambda b: b.split(b"\n", 1)[1], "line 1", "not a trainmon header"),                       # header missing
    (lambda b: b.replace(b"layer.0.bias", b"layer.\xff.bias", 1), "line 3, column 9", "is not UTF-8"),
    (lambda b: b.replace(b",0,1.0,", b",zero,1.0,", 1), "line 2, column 3 (step)", "'zero' is not an integer"),
    (lambda b: b.replace(b",1,", b",1.5,", 1), "column 3 (step)", "'1.5' is not an integer"),
    (lambda b: b[:60] + b"\0\0\0" + b[63:], "line 2, column 15", "NUL byte"),
    (lambda b: b.replace(b",0.0,", b",abc,", 1), "line 2, column 5 (mean)", "'abc' is not a number"),
    (lambda b: b.replace(b"torch.float32\n", b"torch.float32,9\n", 1), "line 2, column 9", "more fields"),
    (lambda b: b"", "", "empty file (0 bytes)"),
])
def test_a_damaged_file_is_one_line_naming_file_line_and_column(run, capsys, command, damage, where, what):
    path = _edit(run, damage)
    line = _one_error_line(capsys, command, run)
    assert str(path) in line and where in line and what in line, line


def test_a_non_number_cell_is_an_error_in_compare_not_a_divergence(run, good_run, capsys):
    path = _edit(run, lambda b: b.replace(b",0.0,", b",oops,", 1))
    line = _one_error_line(capsys, "compare", good_run, run)
    assert f"{path}, line 2, column 5 (mean): 'oops' is not a number" in line


@pytest.mark.parametrize("command", ["compare", "ranks", "anomalies"])
def test_a_last_row_cut_inside_its_numbers_is_left_out_not_read(run, good_run, capsys, caplog, command):
    """Cut in the middle of the last row's norm (2.375 -> 2.3): the engine stages a file cut short
    only up to its last whole row, as the reader does, so the cut number is never a value."""
    path = run / "rank1" / "grad_reduced_2-3.csv"
    raw = path.read_bytes()
    last = raw.rstrip(b"\n").rsplit(b"\n", 1)[1]
    assert last.startswith(b"0,layer.0.bias,3,2.375,"), last
    path.write_bytes(raw[: len(raw) - len(last) - 1 + len(b"0,layer.0.bias,3,2.3")])
    argv = [command, good_run, run] if command == "compare" else [command, run]
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        code, out, err = _cli(capsys, *argv, "--json")
    assert code == 0, err
    cut = [r.getMessage() for r in caplog.records if "cut short" in r.getMessage()]
    assert cut and all(f"{path} line 5 is cut short" in m for m in cut), cut
    doc = json.loads(out)
    if command == "compare":
        assert doc["aligned_rows"] == 2 * 2 * 4 * 2 - 1 and doc["diverged_rows"] == 0, doc
        assert doc["only_in_base"] == 1
    elif command == "ranks":  # rank 1 lacks the row: no 2.3 against rank 0's 2.375
        assert not [i for i in doc["issues"] if i["check"] != "missing"], doc["issues"]
    else:
        assert doc["anomalies"] == [], doc["anomalies"]


def test_a_last_line_cut_mid_row_is_left_out_and_named(run, capsys, caplog):
    path = run / "rank0" / "grad_reduced_2-3.csv"
    raw = path.read_bytes()
    path.write_bytes(raw[:-9])  # the last row loses its end: "...,torch.f"
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        code, out, err = _cli(capsys, "compare", run, run, "--json")
    assert code == 0, err
    assert json.loads(out)["aligned_rows"] == 2 * 2 * 4 * 2 - 1, "every whole row, not the cut one"
    cut = [r.getMessage() for r in caplog.records if "cut short" in r.getMessage()]
    assert cut and all(f"{path} line 5 is cut short" in m and "left out" in m for m in cut), cut


def test_a_run_of_empty_files_is_an_error_not_no_anomalies(tmp_path, capsys):
    for rank in (0, 1):
        (tmp_path / "run" / f"rank{rank}").mkdir(parents=True)
        (tmp_path / "run" / f"rank{rank}" / "grad_reduced_0-0.csv").write_bytes(b"")
    line = _one_error_line(capsys, "anomalies", tmp_path / "run")
    assert "grad_reduced_0-0.csv: empty file (0 bytes)" in line


@pytest.mark.parametrize("command", ["anomalies", "ranks", "compare"])
def test_the_engine_running_out_of_its_memory_cap_is_named_as_such_not_as_a_damaged_file(
        good_run, capsys, monkeypatch, command):
    pytest.importorskip("duckdb")
    from trainmon.diagnosis import engine

    monkeypatch.setattr(engine, "MEMORY_LIMIT", "512KB")  # DuckDB itself refuses to go past it
    runs = [good_run, good_run] if command == "compare" else [good_run]
    line = _one_error_line(capsys, command, *runs, "--engine", "duckdb")
    assert "needs more than its memory cap (TRAINMON_ENGINE_MEMORY=512KB)" in line, line
    assert "Out of Memory" in line and "damaged" not in line


@pytest.mark.parametrize("size, cap", [
    ("4M", "16MB"),   # DuckDB's spill of its sorts fills it ("failed to offload data block")
    ("1M", "256MB"),  # no spill: the staged Parquet files fill it (an IO error, errno 28)
])
def test_a_full_spill_directory_is_named_as_such_not_as_memory_or_a_damaged_file(tmp_path, size, cap):
    """A real full disk: a small tmpfs as TMPDIR (needs root and mount; skipped elsewhere)."""
    pytest.importorskip("duckdb")
    import os
    import subprocess
    import sys

    from trainmon.testing.synthetic_run import SyntheticRun

    run = tmp_path / "run"
    SyntheticRun(ranks=4, steps=200, params=60).write(run, "parquet")  # 288,000 rows, ~40 MB staged
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(tiny)], capture_output=True).returncode:
        pytest.skip("needs a small filesystem of its own (mount as root)")
    try:
        # staged in files, as a run too large to hold in memory is (TRAINMON_ENGINE_MEMORY_ROWS)
        env = dict(os.environ, TMPDIR=str(tiny), TRAINMON_ENGINE_MEMORY=cap, TRAINMON_ENGINE_MEMORY_ROWS="0")
        proc = subprocess.run([sys.executable, "-m", "trainmon", "ranks", str(run), "--json"],
                              capture_output=True, text=True, env=env, timeout=300)
    finally:
        subprocess.run(["umount", str(tiny)], capture_output=True)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and proc.stdout == "" and len(lines) == 1, proc.stderr
    assert "temporary directory is full" in lines[0] and "TMPDIR" in lines[0], lines[0]


def test_a_run_with_no_family_files_is_an_error(tmp_path, capsys):
    (tmp_path / "run" / "rank0").mkdir(parents=True)
    line = _one_error_line(capsys, "anomalies", tmp_path / "run")
    assert "nothing recorded" in line


@pytest.mark.parametrize("argv, needle", [
    (["anomalies", "{run}", "--ranks", "x"], "--ranks: 'x' is not a rank number"),
    (["ranks", "{run}", "--ranks", "x"], "--ranks: 'x' is not a rank number"),
    (["compare", "{run}", "{run}", "--ranks", "0,x"], "--ranks: 'x' is not a rank number"),
    (["anomalies", "{run}", "--ranks", "0,9"], "no rank '9' in"),
    (["ranks", "{run}", "--ranks", "0,9"], "no rank '9' in"),
    (["compare", "{run}", "{run}", "--ranks", "9"], "no rank '9' in"),
    (["anomalies", "{run}", "--limit", "-3"], "--limit must be >= 0"),
    (["ranks", "{run}", "--limit", "-3"], "--limit must be >= 0"),
    (["compare", "{run}", "{run}", "--top", "-1"], "--top must be >= 0"),
    (["anomalies", "{run}", "--kinds", "nope"], "(recorded: grad_reduced, param_origin)"),
    (["compare", "{run}", "{run}", "--kinds", "nope"], "(recorded: grad_reduced, param_origin)"),
    (["plot", "{run}", "--kind", "nope"], "(families: grad_reduced, param_origin)"),
])
def test_bad_options_are_one_line_exit_2(good_run, capsys, argv, needle):
    line = _one_error_line(capsys, *[a.format(run=good_run) for a in argv])
    assert needle in line, line


@pytest.mark.slow
def test_plot_into_a_folder_writes_there_and_reports_the_file_written(good_run, tmp_path, capsys):
    folder = tmp_path / "plots"
    folder.mkdir()
    code, out, err = _cli(capsys, "plot", good_run, "--kind", "grad_reduced", "-o", folder, "--json")
    assert code == 0, err
    written = Path(json.loads(out)["output"])
    assert written == folder / "grad_reduced_norm_rank0.png" and written.stat().st_size > 0
    assert not (tmp_path / "plots.png").exists()
    code, out, err = _cli(capsys, "plot", good_run, "--kind", "grad_reduced", "-o", tmp_path / "noext", "--json")
    assert code == 0 and json.loads(out)["output"] == str(tmp_path / "noext.png") and (tmp_path / "noext.png").exists()


# ----------------------------------------------------------------------------- fuzz

def _commands(run: Path, good: Path, out: Path, every: bool, plot: bool) -> list[list]:
    cmds = [["anomalies", run, "--json"]]  # the reader every analysis command shares
    if every:
        cmds += [["ranks", run], ["compare", good, run, "--json"], ["csv2tb", run, "-o", out / "tb", "--no-progress"]]
    if plot:  # matplotlib renders: a sample of the variants only
        cmds.append(["plot", run, "--kind", "grad_reduced", "-o", out / "p.png"])
    return cmds


HEADER_EDITS = [
    lambda h: h.replace(b"norm", b"nrom"), lambda h: h.replace(b"norm", b"mean"), lambda h: h.replace(b",dtype", b""),
    lambda h: h + b",extra", lambda h: h.replace(b"step", b"micro_step"), lambda h: b"", lambda h: h.upper(),
    lambda h: h.replace(b",", b";"), lambda h: b'"' + h, lambda h: h.replace(b"name", b""), lambda h: h * 2,
    lambda h: h.replace(b"shape,dtype", b"dtype,shape"),
]


def _variants(raw: bytes) -> list[tuple[str, bytes, bool]]:
    """(label, damaged bytes, run every command on it)."""
    rng = random.Random(12)
    # every cut inside the header, every other one in the first row, every third one after (the
    # rows repeat a shape)
    header = raw.index(b"\n") + 1
    first_row = raw.index(b"\n", header) + 1
    cuts = [*range(header), *range(header, first_row, 2), *range(first_row, len(raw), 3)]
    out = [(f"cut at {n}", raw[:n], n % 8 == 0) for n in cuts]
    for k in range(30):
        b = bytearray(raw)
        for _ in range(rng.choice((1, 1, 2, 5))):
            b[rng.randrange(len(b))] = rng.randrange(256)
        out.append((f"flip {k}", bytes(b), True))
    head, _, body = raw.partition(b"\n")
    out += [(f"header edit {i}", edit(head) + b"\n" + body, True) for i, edit in enumerate(HEADER_EDITS)]
    return out


@pytest.mark.slow
def test_fuzz_every_command_exits_0_or_2_without_a_traceback(tmp_path, capsys):
    good = _write_run(tmp_path / "good", steps=range(2), names=NAMES[:1])
    run = _write_run(tmp_path / "run", steps=range(2), names=NAMES[:1])
    target = run / FILE
    raw = target.read_bytes()
    seen = {0: 0, 2: 0}
    for i, (label, data, every) in enumerate(_variants(raw)):
        target.write_bytes(data)
        for argv in _commands(run, good, tmp_path, every, plot=i % 40 == 0):
            code, _, err = _cli(capsys, *argv)  # an exception here fails the test with its traceback
            assert code in (0, 2), (label, argv[0], code, err)
            lines = [ln for ln in err.splitlines() if ln.strip()]
            assert all(ln.startswith("trainmon") for ln in lines), (label, argv[0], err)  # one-line messages
            if code == 2:
                assert lines and sum(": error: " in ln for ln in lines) <= 1, (label, argv[0], err)
            seen[code] += 1
    assert seen[0] and seen[2], seen
