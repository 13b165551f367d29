"""``anomalies`` in buckets: a run checked a few names at a time (and from Parquet) finds what the
run checked whole finds, in the same training-flow order; the staged values against the cells.

Runs are the shared fault runs (tests/_support/simulate.py), as CSV and converted to Parquet with
``trainmon convert``; the reference is ``scan.scan_all`` of the whole CSV run as one bucket
(``load_table``), whose rules have direct tests of their own (test_diag_rules.py).
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("duckdb")
pytest.importorskip("pyarrow")

from tests._support.edge_rows import as_parquet as _as_parquet
from tests._support.simulate import SIM_RUNS, named_run
from trainmon.analysis.rules import Rules, SpikeRule
from trainmon.cli import main
from trainmon.diagnosis import engine, engine_buckets
from trainmon.diagnosis.engine_buckets import load_table
from trainmon.diagnosis.scan import scan, scan_all
from trainmon.output.layout import FamilyFile

REPO = Path(__file__).resolve().parents[2]
RULE_SETS = {
    "default": Rules(),
    "all": Rules(spike=SpikeRule(factor=3.0, warmup=2, window=4), threshold=0.5, ops=("norm", "max", "mean")),
    "zero-floor": Rules(spike=SpikeRule(factor=1.5, floor=0.0, warmup=1, window=2), ops=("norm", "min")),
}


SMALL_BUCKET = 60  # rows per bucket: every run below is checked in several buckets


def engine_scan_all(files, rules=Rules()):
    """``anomalies``' scan of a run's files, in buckets of about ``SMALL_BUCKET`` rows."""
    return engine_buckets.bucket_scan_all(files, rules, rows_per_bucket=SMALL_BUCKET)


def engine_scan(files, rules=Rules()):
    return engine_scan_all(files, rules).anomalies


def _found(anomalies) -> list[dict]:
    """Comparable form of findings (NaN values compare equal), with position and occurrence."""
    return [a.to_json(position=True) for a in anomalies]


def _everything(findings) -> tuple:
    """Comparable form of a whole scan: findings, by-design notes (with occurrence), warm-up."""
    notes = [dict(n.to_json(), occurrence=n.occurrence) for n in findings.by_design]
    return _found(findings.anomalies), notes, findings.unjudged


def _assert_same_findings(name: str, rules: str, pq_dir: Path) -> list:
    run = named_run(name)
    want = _everything(scan_all(load_table(run), RULE_SETS[rules]))
    assert _everything(engine_scan_all(engine.run_files(run), RULE_SETS[rules])) == want
    parquet = engine.run_files(_as_parquet(run, pq_dir))
    assert _everything(engine_scan_all(parquet, RULE_SETS[rules])) == want
    return want[0]


@pytest.mark.slow  # 3.0-5.6 s on a loaded 2-core VM (2026-12-06)
def test_engine_finds_the_planted_nan_first_like_the_in_memory_scan(pq_dir, capsys):
    want = _assert_same_findings("nan", "default", pq_dir)
    assert want and want[0]["rule"] == "nonfinite" and want[0]["step"] == 6


# Every fault run under two of the three rule sets, each rule set on four of the six runs: all 18
# pairs cost ~80 s of engine queries on these tiny runs, for the same code paths.
FAULT_RULES = {"healthy": ("default", "all"), "nan": ("all", "zero-floor"), "blow": ("default", "zero-floor"),
               "blow3": ("all", "default"), "corrupt": ("zero-floor", "all"), "corrupt3": ("default", "zero-floor")}


@pytest.mark.slow
@pytest.mark.parametrize("name, rules", [(n, r) for n, rules in FAULT_RULES.items() for r in rules])
def test_engine_finds_what_the_in_memory_scan_finds_on_every_fault_run_csv_and_parquet(name, rules, pq_dir):
    assert set(FAULT_RULES) == set(SIM_RUNS) - {"base", "lr", "act"}
    _assert_same_findings(name, rules, pq_dir)


@pytest.mark.slow  # 2.8-3.4 s a case on a loaded 2-core VM
@pytest.mark.parametrize("rules", list(RULE_SETS))
def test_engine_keeps_positions_occurrences_and_header_variants_exact(edge_run, rules, pq_dir):
    found = scan_all(load_table(edge_run), RULE_SETS[rules])
    want = found.anomalies
    # The comm call whose norm is inf at every step is non-finite by design: a note, with its occurrence.
    assert any(a.occurrence for a in want) or any(n.occurrence for n in found.by_design)
    assert any(a.micro_step is not None for a in want)
    for run in (edge_run, _as_parquet(edge_run, pq_dir)):
        got = engine_scan_all(engine.run_files(run), RULE_SETS[rules])
        assert _everything(got) == _everything(found)


def test_units_keep_small_ranks_together_and_cut_big_ranks_only_between_step_windows(monkeypatch, tmp_path):
    monkeypatch.setattr(engine, "UNIT_ROWS", 100)

    def files(rank, *windows):
        return [(rank, FamilyFile(a, 0, b, "grad_reduced", tmp_path / f"r{rank}_{a}-{b}.csv")) for a, b in windows]

    small = files(0, (0, 9)) + files(1, (0, 9))  # 40 rows each: one unit
    big = files(2, (0, 9), (10, 19), (20, 29), (30, 39), (40, 49))  # 30 rows a window
    # a window that overlaps the one before (a restart with other windows) is never cut from it
    overlap = files(3, (0, 9), (5, 14), (15, 24), (25, 34), (35, 44))
    run = engine.RunFiles(tmp_path, files={"grad_reduced": small + big + overlap})
    run.rows = {str(f.path): 40 if rank < 2 else 30 if rank == 2 else 45 for rank, f in small + big + overlap}
    units = [[(r, f.start) for r, f in u.files] for u in run.units("grad_reduced")]
    assert units == [
        [(0, 0), (1, 0)],
        [(2, 0), (2, 10), (2, 20)],
        [(2, 30), (2, 40)],
        [(3, 0), (3, 5)],  # 90 rows: 0-9 and 5-14 overlap, so no cut between them
        [(3, 15), (3, 25)],
        [(3, 35)],
    ]


# A rank staged one unit per step window: the staged rows of a name, whatever unit they came
# from, make one bucket, so every series is judged whole.
@pytest.mark.slow  # stages every file as its own unit
# Parquet for two of the runs (its reader is the same past the staging; each case is ~10 s).
@pytest.mark.parametrize(
    "name, rules, parquet",
    [("blow", "default", False), ("blow3", "all", True), ("nan", "zero-floor", False), ("edge", "all", True)],
)
def test_a_run_read_one_step_window_at_a_time_finds_what_the_in_memory_scan_finds(
    name, rules, parquet, edge_run, pq_dir, monkeypatch
):
    run = edge_run if name == "edge" else named_run(name)
    want = _found(scan(load_table(run), RULE_SETS[rules]))
    assert any(a["rule"] == "spike" for a in want)
    monkeypatch.setattr(engine, "UNIT_ROWS", 1)
    for files in (run, _as_parquet(run, pq_dir)) if parquet else (run,):
        found = engine.run_files(files)
        # cut at every step window that does not overlap the ones before it: most units hold
        # later steps of the rank the unit before them held
        units = [[rank for rank, _ in u.files] for fam in found.files for u in found.units(fam)]
        later = sum(1 for before, unit in zip(units, units[1:]) if unit[0] == before[-1])
        assert later > len(units) // 2
        assert _found(engine_scan(found, RULE_SETS[rules])) == want


def test_engine_and_memory_commands_print_the_same_json(edge_run, capsys):
    docs = []
    for choice in ("duckdb", "memory"):
        assert main(["anomalies", str(edge_run), "--json", "--engine", choice, "--kinds",
                     "grad_reduced,actv,comm", "--rules", "nonfinite,spike,threshold", "--threshold", "1"]) == 0
        docs.append(json.loads(capsys.readouterr().out))
    assert docs[0] == docs[1] and docs[0]["count"] > 0


def test_non_numeric_stat_text_is_an_error_naming_file_line_and_column(tmp_path, capsys):
    rank = tmp_path / "run" / "rank1"
    rank.mkdir(parents=True)
    good = "0,w,{s},1.5,0,\"[2]\",torch.float32\n"
    (rank / "grad_reduced_0-0.csv").write_text("vpp_stage,name,step,norm,nans,shape,dtype\n" + good.format(s=0))
    bad = rank / "grad_reduced_1-1.csv"
    bad.write_text("vpp_stage,name,step,norm,nans,shape,dtype\n" + good.format(s=1)
                   + '0,b,1,np.float64(1.5),0,"[2]",torch.float32\n')
    assert main(["anomalies", str(tmp_path / "run"), "--engine", "duckdb"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"{bad}:3: column 'norm' holds 'np.float64(1.5)', not a number" in err


@pytest.mark.parametrize("cell", ["nan", "-nan", "NaN", "", " 2.5 ", "inf", "-Infinity", "1e400", "4.9e-324", "+3"])
def test_hand_written_number_spellings_read_as_python_reads_them(tmp_path, cell):
    """A user's own CSV: the engine's typed read gives every cell Python's ``float`` of it (an
    empty cell: NaN), and the rules judge that value."""
    rank = tmp_path / "run" / "rank0"
    rank.mkdir(parents=True)
    rows = "".join(f"0,w,{s},{1.0 + s * 0.01},0,\"[2]\",torch.float32\n" for s in range(8))
    odd = f'0,w,8,{cell},0,"[2]",torch.float32\n'
    (rank / "grad_reduced_0-8.csv").write_text("vpp_stage,name,step,norm,nans,shape,dtype\n" + rows + odd)
    frame = load_table(tmp_path / "run").frame
    value = frame.loc[frame["step"] == 8, "norm"].item()
    truth = float(cell) if cell.strip() else float("nan")
    assert value == truth or (math.isnan(value) and math.isnan(truth))
    rules = Rules(spike=SpikeRule(factor=1.5, floor=0.0, warmup=1, window=2), threshold=2.0)
    found = {a.rule for a in engine_scan(engine.run_files(tmp_path / "run"), rules) if a.step == 8}
    assert ("nonfinite" in found) == (not math.isfinite(truth))  # an empty cell too: a NaN norm
    assert ("threshold" in found) == (math.isfinite(truth) and abs(truth) > 2.0)


def test_missing_stat_columns_and_empty_cells_read_as_nan(tmp_path):
    rank = tmp_path / "run" / "rank0"
    rank.mkdir(parents=True)
    rows = "".join(f"0,w,{s},{1.0 + s * 0.01},{'' if s == 7 else 0},\"[2]\",torch.float32\n" for s in range(10))
    (rank / "grad_reduced_0-9.csv").write_text("vpp_stage,name,step,norm,nans,shape,dtype\n" + rows)
    variant = "vpp_stage,name,step,max,shape,dtype\n0,w,9,nan,\"[2]\",torch.float32\n"
    (rank / "grad_reduced_0-9.1.csv").write_text(variant)
    frame = load_table(tmp_path / "run").frame
    assert len(frame) == 11 and frame["max"].isna().all()  # absent, or the variant's "nan"
    assert frame["nans"].isna().tolist() == [False] * 7 + [True] + [False, False, True]  # empty; absent
    assert frame["norm"].isna().tolist() == [False] * 10 + [True]  # the variant has no norm


@pytest.mark.parametrize("values", [[10.0] * 4 + [1.0], [10.0] * 4 + [100.0], [-3.0, 2.0, -1.0, 4.0, 40.0],
                                    [-10.0, -10.0, -10.0, -10.0, -1.0], [0.0, 0.0, 0.0, 0.0, 5.0]])
def test_a_spike_exactly_at_the_factor_fires_in_both_scans(tmp_path, values):
    """Ratios exactly at ``factor`` and ``1 / factor`` (the rule's ``>=`` / ``<=``), windows around
    zero and below it, a zero baseline with no floor."""
    rank = tmp_path / "run" / "rank0"
    rank.mkdir(parents=True)
    rows = "".join(f'0,w,{s},{v!r},0,"[2]",torch.float32\n' for s, v in enumerate(values))
    # exp_avg_sq: a family whose drops are judged too (grads, signed, are judged upward only)
    (rank / "exp_avg_sq_0-9.csv").write_text("vpp_stage,name,step,norm,nans,shape,dtype\n" + rows)
    rules = Rules(spike=SpikeRule(factor=10.0, floor=0.0, warmup=3, window=4))
    want = _found(scan(load_table(tmp_path / "run"), rules))
    assert [a["step"] for a in want if a["rule"] == "spike"] == [4]


def test_skipped_steps_clear_their_nonfinite_grads_in_every_bucket_like_the_in_memory_scan(tmp_path):
    """The loss scaler's skips (``steps`` rows) are found before the run is cut into buckets of
    names: the Inf grads of a skipped step are the skip's, in every bucket, on every rank."""
    for r in (0, 1):
        rank = tmp_path / "run" / f"rank{r}"
        rank.mkdir(parents=True)
        skipped = {0: (0, 1, 5), 1: (0, 1, 6)}[r]
        steps = "".join(f'0,optimizer,{s},{int(s in skipped)},{2.0 ** (16 - s)},[],\n' for s in range(8))
        (rank / "steps_0-7.csv").write_text("vpp_stage,name,step,skipped,loss_scale,shape,dtype\n" + steps)
        grads = "".join(f'0,w{i},{s},{"inf" if s in skipped else 1.0 + i},0,"[2]",torch.float32\n'
                        for s in range(8) for i in range(6))
        (rank / "grad_reduced_0-7.csv").write_text("vpp_stage,name,step,norm,nans,shape,dtype\n" + grads)
    want = _everything(scan_all(load_table(tmp_path / "run")))
    assert [(a["rank"], a["step"], a["rule"]) for a in want[0]] == [
        (0, 0, "skipped"), (1, 0, "skipped"), (0, 1, "skipped_run"), (1, 1, "skipped_run"), (0, 5, "skipped"),
        (1, 6, "skipped")]
    got = engine_buckets.bucket_scan_all(engine.run_files(tmp_path / "run"), Rules(), rows_per_bucket=20)
    assert _everything(got) == want


BOUNDED = """
import sys
from trainmon.cli import main
code = main([*sys.argv[2:], "--json", "--engine", sys.argv[1]])
# VmHWM: this process image's own peak (ru_maxrss would keep the forking test process's size
# across exec, so a large pytest process would be counted as the command's memory).
peak_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(peak_kb // 1024, file=sys.stderr)
sys.exit(code)
"""


def peak_mb(argv: list[str], choice: str, **env: str) -> tuple[int, dict]:
    """Peak RSS (MB) and JSON output of ``trainmon ARGV --json --engine CHOICE`` in a fresh process."""
    proc = subprocess.run([sys.executable, "-c", BOUNDED, choice, *argv], capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
                               "TRAINMON_ENGINE_MEMORY": "128MB", **env}, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stderr.strip().splitlines()[-1]), json.loads(proc.stdout)


@pytest.mark.slow
def test_a_long_query_prints_no_progress_bar_on_stdout_so_json_stays_clean(tmp_path):
    # DuckDB draws its own bar on stdout once a query passes 2 s (seen in CI: it broke `--json`).
    # The query below runs ~3-5 s on 2 cores; stdout must hold only what the script prints.
    n = 250_000_000
    script = (
        "from trainmon.diagnosis import engine\n"
        f"con = engine._connect(None, {str(tmp_path)!r})\n"
        f"print(con.execute('select sum(i * i) from range({n}) t(i)').fetchone()[0])\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{(n - 1) * n * (2 * n - 1) // 6}\n"


@pytest.mark.slow  # four staged runs of the edge run
def test_buckets_read_from_the_staged_files_or_sorted_again_find_what_the_whole_table_finds(edge_run, monkeypatch):
    # A small run's buckets are read from its name-sorted staged files; a large one (more than
    # DIRECT_FILES files) is written again by name first; a run within the engine's memory_rows is
    # staged as Arrow tables held in memory: every way must give the whole table's findings.
    import pickle

    from trainmon.diagnosis.engine_buckets import StagedRun, bucket_scan_all, engine_ranks, read_bucket
    from trainmon.diagnosis.ranks import check_ranks

    table = load_table(edge_run)
    rules = RULE_SETS["all"]
    want_scan, want_ranks = _everything(scan_all(table, rules)), check_ranks(table)
    assert want_scan[0] and want_ranks
    # memory_rows 0 and 10 (the run does not fit): files; None: the default, which the run fits
    for direct, held in ((64, 0), (0, 10), (64, None)):
        monkeypatch.setattr(engine_buckets, "DIRECT_FILES", direct)
        monkeypatch.setattr(engine, "MEMORY_ROWS", held)
        files = engine.run_files(edge_run)
        assert _everything(bucket_scan_all(files, rules, rows_per_bucket=300)) == want_scan
        assert engine_ranks(files, rows_per_bucket=300) == want_ranks
        with engine.Engine() as eng:
            run = StagedRun(eng, files, "r", by_name=True)
            buckets = engine_buckets._partition_by_name(run, 300, None, "test")
            assert len(buckets) > 3
            if held is not None:
                assert (len(buckets[0].paths) > 1) == bool(direct) and not buckets[0].tables
            else:
                assert buckets[0].tables and not buckets[0].paths
            # A bucket travels to a worker as plain values: pickled and back, it reads the same rows.
            for bucket in buckets:
                frame = read_bucket(pickle.loads(pickle.dumps(bucket))).frame
                assert frame.equals(run.bucket(bucket.first, bucket.last).frame)
            # Together the buckets hold every row of the whole table, once (the columns the checks
            # read: keys, stats, shape, dtype, numel; not the extra columns of comm rows).
            got = pd.concat([read_bucket(b).frame for b in buckets], ignore_index=True)
            keys = ["family", "rank", "name", "step", "micro_step", "position", "occurrence"]
            stats = [s for family in table.family_stats.values() for s in family]
            columns = list(dict.fromkeys([*keys, "vpp_stage", "phase", "shape", "dtype", "numel", *stats]))
            whole = table.frame.sort_values(keys, ignore_index=True)[columns]
            pd.testing.assert_frame_equal(got.sort_values(keys, ignore_index=True)[columns], whole, check_dtype=False)


@pytest.mark.parametrize("fits", [False, True])
def test_a_run_whose_csv_rows_were_underestimated_is_held_only_while_it_fits(tmp_path, monkeypatch, fits):
    # A CSV file's rows are estimated from its first row's length, so a long first row (a long
    # tensor name first) makes the estimate low.  Held in memory, such a run must still stay within
    # TRAINMON_ENGINE_MEMORY_ROWS: past it, what is held goes to files and the rest follows.
    from trainmon.diagnosis.engine_buckets import HeldPart, StagedRun, bucket_scan_all, engine_ranks
    from trainmon.diagnosis.ranks import check_ranks
    from trainmon.testing.synthetic_run import SyntheticRun

    run = SyntheticRun(ranks=2, steps=12, params=20, steps_per_file=6).write(tmp_path / "run", "csv")
    long_name = "layers.0.weight" + "_long" * 60  # param 0 is the first row of every file
    for f in run.glob("rank*/*.csv"):
        f.write_text(f.read_text().replace("layers.0.weight,", f"{long_name},"))
    table = load_table(run)
    files = engine.run_files(run)
    estimate, actual = sum(files.family_rows(f) for f in files.family_stats), len(table.frame)
    assert estimate < actual / 2, (estimate, actual)
    monkeypatch.setattr(engine, "MEMORY_ROWS", actual if fits else (estimate + actual) // 2)
    with engine.Engine() as eng:
        staged = StagedRun(eng, files, "r", by_name=True)
        parts = [p for family in staged.parts for p in family]
        if fits:  # held whole, its reservation grown to the rows it holds
            assert staged.held_rows == actual and all(isinstance(p, HeldPart) for p in parts)
        else:  # spilled: every part a file, nothing left held
            assert staged.held_rows == 0 and all(isinstance(p, Path) and p.is_file() for p in parts)
        assert eng.con.execute("SELECT count(*) FROM r_staged").fetchone()[0] == actual
    rules = RULE_SETS["all"]
    want_scan, want_ranks = _everything(scan_all(table, rules)), check_ranks(table)
    assert want_scan[0] and want_ranks  # the planted NaN (and spike) are found
    assert _everything(bucket_scan_all(files, rules)) == want_scan
    assert engine_ranks(files) == want_ranks
