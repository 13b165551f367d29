"""Bad TRAINMON_ENGINE_* environment values (issue 34, item 15): one line naming the variable, its
value and what is allowed, exit code 2 -- never a traceback at import, never "a damaged family
file" of the user's run.  Good values still run; the out-of-memory line suggests a cap above the
one that did not fit."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests._support.runs import REPO
from tests.cli.test_damaged_runs import _write_run
from trainmon.cli import main

pytest.importorskip("duckdb")

BAD = [
    ("TRAINMON_ENGINE_MEMORY", "lots", "must be a size such as 512MB or 2GB"),
    ("TRAINMON_ENGINE_MEMORY", "0MB", "must be a size such as 512MB or 2GB"),
    ("TRAINMON_ENGINE_MEMORY", "256", "must be a size such as 512MB or 2GB"),
    ("TRAINMON_ENGINE_UNIT_ROWS", "1e5", "must be an integer >= 1 (default 250000)"),
    ("TRAINMON_ENGINE_UNIT_ROWS", "0", "must be an integer >= 1 (default 250000)"),
    ("TRAINMON_ENGINE_BUCKET_ROWS", "many", "must be an integer >= 1 (default 250000)"),
    ("TRAINMON_ENGINE_SORT_ROWS", "-5", "must be an integer >= 1 (default 10000000)"),
    ("TRAINMON_ENGINE_MEMORY_ROWS", "2M", "must be an integer >= 0 (default 2000000)"),
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return _write_run(tmp_path_factory.mktemp("env") / "run")


def _cli(capsys, *argv):
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("engine", ["duckdb", "memory"])
@pytest.mark.parametrize("command", ["anomalies", "ranks", "compare"])
@pytest.mark.parametrize("name, value, allowed", BAD)
def test_a_bad_value_is_one_line_naming_the_variable(run, capsys, monkeypatch, command, engine, name, value, allowed):
    monkeypatch.setenv(name, value)
    runs = [run, run] if command == "compare" else [run]
    code, out, err = _cli(capsys, command, *runs, "--engine", engine)
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith(f"trainmon {command}: error: environment variable {name}={value!r}: {allowed}"), err


@pytest.mark.parametrize("name, value", [("TRAINMON_ENGINE_MEMORY", "1GB"), ("TRAINMON_ENGINE_MEMORY", "300MiB"),
                                         ("TRAINMON_ENGINE_UNIT_ROWS", "7"), ("TRAINMON_ENGINE_BUCKET_ROWS", "1_000"),
                                         ("TRAINMON_ENGINE_MEMORY_ROWS", "0")])
def test_good_values_run(run, capsys, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    code, out, err = _cli(capsys, "ranks", run, "--engine", "duckdb")
    assert code == 0 and "ranks consistent" in out, err


@pytest.mark.slow
def test_bad_values_do_not_break_importing_the_engine():
    env = {"TRAINMON_ENGINE_BUCKET_ROWS": "x", "TRAINMON_ENGINE_UNIT_ROWS": "x", "TRAINMON_ENGINE_MEMORY": "x",
           "TRAINMON_ENGINE_SORT_ROWS": "x", "PYTHONPATH": str(REPO)}
    code = "import trainmon.diagnosis.engine_buckets, trainmon.diagnosis.engine_compare, trainmon.cli._engine"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_out_of_memory_suggests_a_cap_above_the_one_that_failed(run, capsys, monkeypatch):
    monkeypatch.setenv("TRAINMON_ENGINE_MEMORY", "512KB")  # DuckDB itself refuses to go past it
    code, _, err = _cli(capsys, "anomalies", run, "--engine", "duckdb")
    assert code == 2 and "(TRAINMON_ENGINE_MEMORY=512KB)" in err, err
    assert "set TRAINMON_ENGINE_MEMORY above 512KB, e.g. 1024KB" in err and "1GB" not in err, err
