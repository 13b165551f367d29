"""Every exit code docs/diagnosis.md ("Exit codes") documents, for every command it lists: the table
is parsed, so a row added there without a check here (or a check without its row) fails."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from trainmon.cli import main
from trainmon.testing.synthetic_run import SyntheticRun

REPO = Path(__file__).resolve().parents[2]
NO_SUCH = "/no/such/trainmon/run"


def documented() -> set[tuple[int, str, str]]:
    """(code, situation, command) for each command of each row of the table."""
    text = (REPO / "docs" / "diagnosis.md").read_text(encoding="utf-8").split("## Exit codes", 1)[1]
    rows = re.findall(r"^\| `(\d+)` \| \*\*([a-z ]+)\*\*.*\| ([a-z0-9, -]+) \|$", text, flags=re.MULTILINE)
    assert rows, "the exit code table of docs/diagnosis.md was not found"
    return {(int(code), what, cmd.strip()) for code, what, cmds in rows for cmd in cmds.split(",")}


def code_of(*argv: str) -> int:
    """``trainmon ARGV`` in this process: its return value, or argparse's exit status."""
    try:
        return main(list(argv))
    except SystemExit as exc:  # argparse: --help, or a usage error
        return int(exc.code or 0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A small healthy run and a copy with one damaged cell."""
    root = tmp_path_factory.mktemp("exit")
    good = SyntheticRun(ranks=2, steps=4, params=6, steps_per_file=2).write(root / "good", "csv")
    bad = Path(shutil.copytree(good, root / "bad"))
    damaged = sorted((bad / "rank0").glob("grad_reduced_*.csv"))[0]
    header, first, *rest = damaged.read_text().splitlines()
    cells = first.split(",")
    cells[header.split(",").index("mean")] = "abc"
    damaged.write_text("\n".join([header, ",".join(cells), *rest]) + "\n")
    return {"good": good, "bad": bad, "root": root}


def _out(runs, name: str) -> str:
    return str(runs["root"] / f"{len(list(runs['root'].iterdir()))}-{name}")  # a new path each call


# ---------------------------------------------------------------------------------------- ran (0)


def _l2_runs(root: Path) -> tuple[Path, Path]:
    from tests._support.probe_runs import train_run

    l2 = {"grad_probe": {"grad_level": "L2"}}
    return train_run(root / "l2a", l2, steps=2, acc=1).run_dir, train_run(root / "l2b", l2, steps=2, acc=1).run_dir


RAN: dict[str, Callable] = {
    "anomalies": lambda runs: [code_of("anomalies", str(runs["good"]))],
    "compare": lambda runs: [code_of("compare", str(runs["good"]), str(runs["good"]))],
    "convert": lambda runs: [code_of("convert", str(runs["good"]), "--to", "parquet", "-o", _out(runs, "pq"))],
    "csv2tb": lambda runs: [code_of("csv2tb", str(runs["good"]), "-o", _out(runs, "tb"))],
    "plot": lambda runs: [code_of("plot", str(runs["good"]), "--kind", "grad_reduced", "-o", _out(runs, "p.png"))],
    "ranks": lambda runs: [code_of("ranks", str(runs["good"]))],
    "similarity": lambda runs: [code_of("similarity", *map(str, _l2_runs(runs["root"])), "-o", _out(runs, "sim"))],
    "demo": lambda runs: [_demo(runs["root"])],
}
SLOW_RAN = {"similarity", "demo"}  # they train a model first


def _demo(root: Path) -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "trainmon", "demo", "--steps", "2", "--output", str(root / "demo")],
                          capture_output=True, text=True, env=env, cwd=root, timeout=300)  # fmt: skip
    assert proc.stderr.count("Traceback") == 0, proc.stderr
    return proc.returncode


# -------------------------------------------------------------------------------------- usage (2)

USAGE: dict[str, Callable] = {
    "anomalies": lambda runs: [code_of("anomalies", NO_SUCH), code_of("anomalies", str(runs["good"]), "--ranks", "x")],
    "compare": lambda runs: [
        code_of("compare", NO_SUCH, str(runs["good"])),
        code_of("compare", str(runs["good"]), str(runs["good"]), "--rtol", "-1"),
    ],
    "convert": lambda runs: [
        code_of("convert", NO_SUCH, "--to", "parquet"),
        code_of("convert", str(runs["good"]), "--to", "csv"),  # an unknown choice
    ],
    "csv2tb": lambda runs: [code_of("csv2tb", NO_SUCH), code_of("csv2tb")],  # a missing required argument
    "demo": lambda runs: [code_of("demo", "--config", NO_SUCH + ".json")],
    "plot": lambda runs: [
        code_of("plot", NO_SUCH, "--kind", "grad_reduced"),
        code_of("plot", str(runs["good"]), "--kind", "actv"),  # a family the run does not hold
    ],
    "ranks": lambda runs: [code_of("ranks", NO_SUCH), code_of("ranks", str(runs["good"]), "--limit", "-1")],
    "similarity": lambda runs: [
        code_of("similarity", NO_SUCH, NO_SUCH, "-o", _out(runs, "s")),
        code_of("similarity", str(runs["good"]), str(runs["good"]), "-o", _out(runs, "s")),  # no L2 rows
        code_of("similarity", str(runs["good"]), str(runs["good"])),  # -o is required
    ],
}

# ------------------------------------------------------------------------------------ damaged (2)

DAMAGED: dict[str, Callable] = {
    "anomalies": lambda runs: [code_of("anomalies", str(runs["bad"]))],
    "compare": lambda runs: [code_of("compare", str(runs["good"]), str(runs["bad"]))],
    "convert": lambda runs: [code_of("convert", str(runs["bad"]), "--to", "parquet", "-o", _out(runs, "pq"))],
    "csv2tb": lambda runs: [_csv2tb_converts_the_rest(runs)],
    "plot": lambda runs: [code_of("plot", str(runs["bad"]), "--kind", "grad_reduced", "-o", _out(runs, "p.png"))],
    "ranks": lambda runs: [code_of("ranks", str(runs["bad"]))],
}


def _csv2tb_converts_the_rest(runs) -> int:
    out = Path(_out(runs, "tb"))
    code = code_of("csv2tb", str(runs["bad"]), "-o", str(out))
    assert len(list(out.rglob("*tfevents*"))) == 2  # both ranks' other files were converted
    return code


# -------------------------------------------------------------------------------- environment (2)


def _with_bad_env(*argv: str) -> int:
    os.environ["TRAINMON_ENGINE_UNIT_ROWS"] = "1e5"
    try:
        return code_of(*argv)
    finally:
        del os.environ["TRAINMON_ENGINE_UNIT_ROWS"]


ENVIRONMENT: dict[str, Callable] = {
    "anomalies": lambda runs: [_with_bad_env("anomalies", str(runs["good"]))],
    "compare": lambda runs: [_with_bad_env("compare", str(runs["good"]), str(runs["good"]))],
    "ranks": lambda runs: [_with_bad_env("ranks", str(runs["good"]))],
}

TARGET_EXISTS: dict[str, Callable] = {"convert": lambda runs: [_convert_into_a_full_folder(runs)]}


def _convert_into_a_full_folder(runs) -> int:
    out = Path(_out(runs, "full"))
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code = code_of("convert", str(runs["good"]), "--to", "parquet", "-o", str(out))
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    return code


# ----------------------------------------------------------------------------- reader left (141)


def _reader_left(*argv: str) -> int:
    reader, writer = os.pipe()
    os.close(reader)  # the reader is gone before the command writes its first line
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    try:
        proc = subprocess.run([sys.executable, "-m", "trainmon", *argv], stdout=writer, stderr=subprocess.PIPE,
                              text=True, env=env, timeout=300)  # fmt: skip
    finally:
        os.close(writer)
    assert proc.stderr == "", proc.stderr  # quiet, as other tools
    return proc.returncode


READER_LEFT: dict[str, Callable] = {
    "anomalies": lambda runs: [_reader_left("anomalies", str(runs["good"]))],
    "compare": lambda runs: [_reader_left("compare", str(runs["good"]), str(runs["good"]))],
    "convert": lambda runs: [_reader_left("convert", str(runs["good"]), "--to", "parquet", "-o", _out(runs, "pq"))],
    "csv2tb": lambda runs: [_reader_left("csv2tb", str(runs["good"]), "-o", _out(runs, "tb"))],
    "plot": lambda runs: [_reader_left("plot", str(runs["good"]), "--kind", "grad_reduced", "-o", _out(runs, "p"))],
    "ranks": lambda runs: [_reader_left("ranks", str(runs["good"]))],
}

CHECKS: dict[tuple[int, str], dict[str, Callable]] = {
    (0, "ran"): RAN,
    (2, "usage"): USAGE,
    (2, "damaged"): DAMAGED,
    (2, "environment"): ENVIRONMENT,
    (2, "target exists"): TARGET_EXISTS,
    (141, "reader left"): READER_LEFT,
}
CASES = sorted((code, what, cmd) for (code, what), by_cmd in CHECKS.items() for cmd in by_cmd)


def test_the_table_and_the_checks_list_the_same_cases():
    assert documented() == set(CASES)


def _param(code: int, what: str, cmd: str):
    slow = code == 141 or (what == "ran" and cmd in SLOW_RAN)
    return pytest.param(code, what, cmd, id=f"{code}-{what.replace(' ', '_')}-{cmd}",
                        marks=[pytest.mark.slow] if slow else [])  # fmt: skip


@pytest.mark.parametrize(("code", "what", "cmd"), [_param(*case) for case in CASES])
def test_documented_exit_code(code, what, cmd, runs, capsys, monkeypatch):
    monkeypatch.delenv("TRAINMON_ENGINE_UNIT_ROWS", raising=False)
    got = CHECKS[(code, what)][cmd](runs)
    err = capsys.readouterr().err
    assert got == [code] * len(got), err
    assert "Traceback" not in err
    if code == 2 and what != "damaged":
        # one line per error: argparse's usage block ends in one 'error:' line too
        assert all(line.count("error:") <= 1 for line in err.splitlines())


def test_version(capsys):
    from trainmon import __version__

    assert code_of("--version") == 0
    assert capsys.readouterr().out.strip() == f"trainmon {__version__}"
