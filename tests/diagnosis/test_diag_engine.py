"""The DuckDB scan against the in-memory scan: the same findings, in the same training-flow order.

Runs are the shared fault runs (tests/_support/simulate.py), as CSV and converted to Parquet with
``trainmon convert``; the in-memory path (``scan.scan`` over ``load_run``) is the reference.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("duckdb")
pytest.importorskip("pyarrow")

from tests._support.simulate import SIM_RUNS, named_run, simulate
from tests._support.edge_rows import edge_rows as _edge_rows
from trainmon.cli import main
from trainmon.diagnosis import engine
from trainmon.diagnosis.reader import load_run
from trainmon.diagnosis.rules import Rules, SpikeRule
from trainmon.diagnosis.scan import scan

REPO = Path(__file__).resolve().parents[2]
RULE_SETS = {
    "default": Rules(),
    "all": Rules(spike=SpikeRule(factor=3.0, warmup=2, window=4), threshold=0.5, ops=("norm", "max", "mean")),
    "zero-floor": Rules(spike=SpikeRule(factor=1.5, floor=0.0, warmup=1, window=2), ops=("norm", "min")),
}


def _found(anomalies) -> list[dict]:
    """Comparable form of findings (NaN values compare equal), with position and occurrence."""
    return [a.to_json(position=True) for a in anomalies]


def _as_parquet(run: Path, tmp: Path) -> Path:
    out = tmp / (run.name + "-pq")
    if not out.exists():
        assert main(["convert", str(run), "--to", "parquet", "-o", str(out), "--json"]) == 0
    return out


@pytest.fixture(scope="module")
def pq_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engine_pq")


def _assert_same_findings(name: str, rules: str, pq_dir: Path) -> list:
    run = named_run(name)
    want = _found(scan(load_run(run), RULE_SETS[rules]))
    assert _found(engine.engine_scan(engine.run_files(run), RULE_SETS[rules])) == want
    assert _found(engine.engine_scan(engine.run_files(_as_parquet(run, pq_dir)), RULE_SETS[rules])) == want
    return want


def test_engine_finds_the_planted_nan_first_like_the_in_memory_scan(pq_dir, capsys):
    want = _assert_same_findings("nan", "default", pq_dir)
    assert want and want[0]["rule"] == "nonfinite" and want[0]["step"] == 6


@pytest.mark.slow
@pytest.mark.parametrize("rules", list(RULE_SETS))
@pytest.mark.parametrize("name", [n for n in SIM_RUNS if n not in ("base", "lr", "act")])
def test_engine_finds_what_the_in_memory_scan_finds_on_every_fault_run_csv_and_parquet(name, rules, pq_dir):
    _assert_same_findings(name, rules, pq_dir)


@pytest.fixture(scope="module")
def edge_run(tmp_path_factory) -> Path:
    """Micro-steps, a NaN, repeated names in a step (comm calls), header variants, quoted names."""
    from tests._support.simulate import nan_input

    run = simulate(tmp_path_factory.mktemp("edge") / "run", steps=9, micro=2, fault=nan_input)
    _edge_rows(run / "rank0")
    return run


@pytest.mark.parametrize("rules", list(RULE_SETS))
def test_engine_keeps_positions_occurrences_and_header_variants_exact(edge_run, rules, pq_dir):
    want = scan(load_run(edge_run), RULE_SETS[rules])
    assert any(a.occurrence for a in want) or rules == "zero-floor"
    assert any(a.micro_step is not None for a in want)
    for run in (edge_run, _as_parquet(edge_run, pq_dir)):
        assert _found(engine.engine_scan(engine.run_files(run), RULE_SETS[rules])) == _found(want)


def test_engine_and_memory_commands_print_the_same_json(edge_run, capsys):
    docs = []
    for choice in ("duckdb", "memory"):
        assert (
            main(
                [
                    "anomalies",
                    str(edge_run),
                    "--json",
                    "--engine",
                    choice,
                    "--kinds",
                    "grad_reduced,actv,comm",
                    "--rules",
                    "nonfinite,spike,threshold",
                    "--threshold",
                    "1",
                ]
            )
            == 0
        )
        docs.append(json.loads(capsys.readouterr().out))
    assert docs[0] == docs[1] and docs[0]["count"] > 0


def test_non_numeric_stat_text_is_an_error_naming_file_line_and_column(tmp_path, capsys):
    rank = tmp_path / "run" / "rank1"
    rank.mkdir(parents=True)
    good = '0,w,{s},1.5,0,"[2]",torch.float32\n'
    (rank / "grad_reduced_0-0.csv").write_text("vpp_stage,name,step,norm,nans,shape,dtype\n" + good.format(s=0))
    bad = rank / "grad_reduced_1-1.csv"
    bad.write_text(
        "vpp_stage,name,step,norm,nans,shape,dtype\n"
        + good.format(s=1)
        + '0,b,1,np.float64(1.5),0,"[2]",torch.float32\n'
    )
    assert main(["anomalies", str(tmp_path / "run"), "--engine", "duckdb"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"{bad}:3: column 'norm' holds 'np.float64(1.5)', not a number" in err


def test_missing_stat_columns_and_empty_cells_read_as_nan_like_the_in_memory_reader(tmp_path):
    rank = tmp_path / "run" / "rank0"
    rank.mkdir(parents=True)
    rows = "".join(f'0,w,{s},{1.0 + s * 0.01},{"" if s == 7 else 0},"[2]",torch.float32\n' for s in range(10))
    (rank / "grad_reduced_0-9.csv").write_text("vpp_stage,name,step,norm,nans,shape,dtype\n" + rows)
    (rank / "grad_reduced_0-9.1.csv").write_text('vpp_stage,name,step,max,shape,dtype\n0,w,9,nan,"[2]",torch.float32\n')
    want = _found(scan(load_run(tmp_path / "run")))
    assert want and _found(engine.engine_scan(engine.run_files(tmp_path / "run"))) == want


BOUNDED = """
import resource, sys
from trainmon.cli import main
code = main(["anomalies", sys.argv[1], "--json", "--engine", sys.argv[2]])
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, file=sys.stderr)
sys.exit(code)
"""


def _peak_mb(run: Path, choice: str) -> tuple[int, dict]:
    proc = subprocess.run(
        [sys.executable, "-c", BOUNDED, str(run), choice],
        capture_output=True,
        text=True,
        env={
            "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1",
            "PATH": "/usr/bin:/bin",
            "TRAINMON_ENGINE_MEMORY": "128MB",
        },
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    return int(proc.stderr.strip().splitlines()[-1]), json.loads(proc.stdout)


@pytest.mark.slow
def test_engine_memory_stays_bounded_where_the_in_memory_scan_needs_much_more(tmp_path):
    from trainmon.testing.synthetic_run import SyntheticRun

    synth = SyntheticRun(ranks=4, steps=200, params=500, steps_per_file=25)  # 2,400,000 rows
    run = synth.write(tmp_path / "run", "parquet")
    limit_mb = 1000  # measured: engine 260-800 MB (a 128 MB engine cap + the interpreter), in-memory ~1.5 GB
    engine_mb, engine_doc = _peak_mb(run, "duckdb")
    memory_mb, memory_doc = _peak_mb(run, "memory")
    assert engine_doc == memory_doc
    first = engine_doc["anomalies"][0]
    assert (first["step"], first["kind"], first["rule"]) == (synth.spike_step, "grad_reduced", "spike")
    assert engine_mb < limit_mb < memory_mb, (engine_mb, memory_mb)


# ----------------------------------------------------------------------------- ranks and compare

from trainmon.diagnosis.compare import compare_runs  # noqa: E402
from trainmon.diagnosis.engine_buckets import engine_compare, engine_ranks  # noqa: E402
from trainmon.diagnosis.ranks import check_ranks  # noqa: E402

TINY_BUCKET = 40  # rows per bucket: every run below is cut into many buckets


def _issues(issues) -> list[dict]:
    return [dict(i.to_json(), position=i.position) for i in issues]


@pytest.mark.parametrize("name", ["nan", "blow3", "corrupt", "corrupt3", "edge"])
def test_engine_ranks_finds_what_the_in_memory_check_finds_csv_and_parquet(name, edge_run, pq_dir):
    run = edge_run if name == "edge" else named_run(name)
    want = _issues(check_ranks(load_run(run)))
    assert want
    for files in (run, _as_parquet(run, pq_dir)):
        got = engine_ranks(engine.run_files(files), rows_per_bucket=TINY_BUCKET)
        assert _issues(got) == want


@pytest.mark.parametrize("pair", [("base", "lr"), ("base", "act"), ("nan", "healthy"), ("edge", "nan")])
def test_engine_compare_finds_what_the_in_memory_compare_finds_csv_and_parquet(pair, edge_run, pq_dir):
    base, target = (edge_run if name == "edge" else named_run(name) for name in pair)
    want = compare_runs(load_run(base), load_run(target)).to_json()
    assert want["diverged_rows"] and want["first_divergence"]
    for b, t in (
        (base, target),
        (_as_parquet(base, pq_dir), _as_parquet(target, pq_dir)),
        (base, _as_parquet(target, pq_dir)),
    ):
        got = engine_compare(engine.run_files(b), engine.run_files(t), rows_per_bucket=TINY_BUCKET, top=3)
        assert got.to_json() == compare_runs(load_run(base), load_run(target), top=3).to_json()
    assert engine_compare(engine.run_files(base), engine.run_files(target)).to_json() == want


def test_ranks_and_compare_commands_print_the_same_json_on_both_engines(capsys):
    for argv in (["ranks", str(named_run("corrupt3"))], ["compare", str(named_run("base")), str(named_run("act"))]):
        docs = []
        for choice in ("duckdb", "memory"):
            assert main([*argv, "--json", "--engine", choice]) == 0
            docs.append(json.loads(capsys.readouterr().out))
        assert docs[0] == docs[1]


@pytest.mark.parametrize("command", ["ranks", "compare"])
def test_ranks_and_compare_name_a_non_numeric_stat_cell(command, tmp_path, capsys):
    good = tmp_path / "good"
    for rank in (0, 1):
        (good / f"rank{rank}").mkdir(parents=True)
        (good / f"rank{rank}" / "grad_reduced_0-0.csv").write_text(
            'vpp_stage,name,step,norm,nans,shape,dtype\n0,w,0,1.5,0,"[2]",torch.float32\n'
        )
    bad_run = tmp_path / "bad"
    shutil.copytree(good, bad_run)
    bad = bad_run / "rank1" / "grad_reduced_0-0.csv"
    bad.write_text(bad.read_text() + '0,b,0,np.float64(1.5),0,"[2]",torch.float32\n')
    argv = [command, str(bad_run)] if command == "ranks" else [command, str(good), str(bad_run)]
    assert main([*argv, "--engine", "duckdb"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"{bad}:3: column 'norm' holds 'np.float64(1.5)', not a number" in err
