"""``ranks`` and ``compare`` in the engine, one bucket of names (or one alignment group) at a time.

Reference: ``check_ranks`` over the whole run as one bucket (``load_table``) and ``compare`` of
the whole runs in one alignment group per family.  The engine runs with a tiny bucket size (or
unit), so every run is cut into many buckets (groups); CSV and Parquet (``trainmon convert``) alike.
"""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("duckdb")
pytest.importorskip("pyarrow")

from tests._support.edge_rows import as_parquet
from tests._support.runs import compare_runs  # the reference: one alignment group per family
from tests._support.simulate import named_run
from tests.diagnosis.test_diag_engine import peak_mb
from trainmon.analysis.rules import Rules
from trainmon.cli import main
from trainmon.diagnosis import engine
from trainmon.diagnosis.engine_buckets import engine_ranks, load_table
from trainmon.diagnosis.engine_compare import engine_compare
from trainmon.diagnosis.ranks import check_ranks

TINY_BUCKET = 300  # rows per bucket: 3-7 buckets per run below


def _issues(issues) -> list[dict]:
    return [dict(i.to_json(), position=i.position) for i in issues]


@pytest.mark.slow  # 3.0-5.6 s on a loaded 2-core VM (2026-12-06)
@pytest.mark.parametrize("name", ["edge", "nan", "corrupt3"])
def test_engine_ranks_in_small_buckets_finds_what_one_bucket_finds_csv_and_parquet(name, edge_run, pq_dir):
    run = edge_run if name == "edge" else named_run(name)
    want = _issues(check_ranks(load_table(run)))
    assert want
    for files in (run, as_parquet(run, pq_dir)):
        assert _issues(engine_ranks(engine.run_files(files), rows_per_bucket=TINY_BUCKET)) == want


@pytest.mark.slow  # over the fast tier's 3 s on a loaded machine
@pytest.mark.parametrize("pair", [("edge", "nan"), ("base", "act")])
def test_engine_compare_of_parquet_finds_what_compare_of_csv_finds(pair, edge_run, pq_dir):
    base, target = (edge_run if name == "edge" else named_run(name) for name in pair)
    want = compare_runs(base, target, top=3).to_json()
    assert want["diverged_rows"] and want["first_divergence"] and want["only_in_base"] + want["renamed"]
    for b, t in ((base, target), (as_parquet(base, pq_dir), as_parquet(target, pq_dir))):
        got = engine_compare(engine.run_files(b), engine.run_files(t), top=3)
        assert got.to_json() == want


@pytest.mark.slow  # stages every file as its own unit
def test_ranks_and_compare_staged_one_step_window_at_a_time_find_the_same(edge_run, monkeypatch):
    # every file its own staging unit, every rank its own alignment group
    want_ranks = _issues(check_ranks(load_table(edge_run)))
    base, target = named_run("corrupt3"), named_run("nan")
    want_cmp = compare_runs(base, target, top=3).to_json()
    monkeypatch.setattr(engine, "UNIT_ROWS", 1)
    assert len(engine.run_files(edge_run).units("actv")) > 2
    # compare then aligns each rank in runs of one step (a rank's rows can outgrow any unit)
    from trainmon.diagnosis.engine_buckets import consecutive_runs

    assert consecutive_runs([(0, 1), (1, 1), (5, 2)], 1) == [(0, 0), (1, 1), (5, 5)]
    assert consecutive_runs([(0, 1), (1, 1), (5, 2)], 2) == [(0, 1), (5, 5)]
    assert _issues(engine_ranks(engine.run_files(edge_run), rows_per_bucket=TINY_BUCKET)) == want_ranks
    assert engine_compare(engine.run_files(base), engine.run_files(target), top=3).to_json() == want_cmp


@pytest.mark.slow  # 2.7 s on a loaded 2-core VM, near the fast tier's 3 s
def test_ranks_sorting_the_run_in_bounded_runs_of_buckets_finds_the_same(edge_run, monkeypatch):
    # a sort per bucket (SORT_ROWS 1): every bucket read from its own sorted file, each whole
    from trainmon.diagnosis import engine_buckets

    want = _issues(check_ranks(load_table(edge_run)))
    monkeypatch.setattr(engine_buckets, "SORT_ROWS", 1)
    assert _issues(engine_ranks(engine.run_files(edge_run), rows_per_bucket=TINY_BUCKET)) == want


def test_a_partitioned_run_hands_over_every_row_once_by_name_code_ranges(edge_run):
    # Truth: the staged rows themselves; after ``partition`` the buckets are read from the sorted
    # files alone (the staged files are gone), and together hold each row exactly once.
    from trainmon.diagnosis.engine import Engine
    from trainmon.diagnosis.engine_buckets import StagedRun, consecutive_runs

    with Engine() as eng:
        run = StagedRun(eng, engine.run_files(edge_run), "r", by_name=True)
        cols = "fam, rank, name, step, micro_step, position, occurrence"
        staged = sorted(eng.con.execute(f"SELECT {cols} FROM r_staged").fetchall())
        per_name = run.code_rows()
        assert sum(n for _, n in per_name) == len(staged) and len(per_name) > 4
        # the run lives in files: DuckDB's own tables hold only codes and file lists
        tables = dict(eng.con.execute("SELECT table_name, estimated_size FROM duckdb_tables()").fetchall())
        assert sum(tables.values()) < len(staged) / 10, (tables, len(staged))
        ranges = consecutive_runs(per_name, TINY_BUCKET)
        run.partition([(ranges[0][0], ranges[1][1]), *ranges[2:]])  # two buckets share a sorted file
        assert not list(eng.dir.glob("r-[0-9]*.parquet"))
        got = []
        for first, last in ranges:
            frame = run.bucket(first, last).frame
            codes = {name: i for i, name in enumerate(run.texts["name"])}
            assert {codes[n] for n in frame["name"]} <= set(range(first, last + 1))
            fams = frame["family_order"].tolist()
            got += zip(
                fams,
                frame["rank"],
                frame["name"].map(codes),
                frame["step"],
                frame["micro_step"],
                frame["position"],
                frame["occurrence"],
            )
    assert sorted(tuple(int(v) for v in row) for row in got) == staged
    assert consecutive_runs([(0, 5), (1, 5), (2, 30), (3, 5), (4, 5)], 10) == [(0, 1), (2, 2), (3, 4)]


@pytest.mark.parametrize(
    "options",
    [
        {"top": 5, "rtol": 0.0},  # every difference diverges
        pytest.param({"top": 2, "atol": 1e-3, "ops": ["norm", "max"]}, marks=pytest.mark.slow),
        pytest.param({"top": 4, "rtol": 0.5}, marks=pytest.mark.slow),
    ],
)
@pytest.mark.slow  # 3.0-5.6 s on a loaded 2-core VM (2026-12-06)
@pytest.mark.parametrize("pair", [("nan", "healthy"), pytest.param(("corrupt", "corrupt3"), marks=pytest.mark.slow)])
def test_groups_of_a_few_rows_compare_as_one_group_with_nan_other_ranks_and_any_tolerance(
    pair, options, monkeypatch
):
    # NaN against finite values (the nan run), a third rank only in the target (corrupt3)
    base, target = (named_run(name) for name in pair)
    want = compare_runs(base, target, **options).to_json()
    assert want["diverged_rows"] and want["largest_by_family"]
    monkeypatch.setattr(engine, "UNIT_ROWS", 40)  # each rank aligned in runs of a few steps
    assert engine_compare(engine.run_files(base), engine.run_files(target), **options).to_json() == want


@pytest.mark.slow  # four whole commands: 3.4 s, over the fast tier's limit
def test_the_deprecated_engine_flag_changes_nothing_ranks_and_compare_print(capsys):
    """``--engine`` is a no-op kept for a release: either choice prints the same JSON."""
    for argv in (["ranks", str(named_run("corrupt"))], ["compare", str(named_run("base")), str(named_run("lr"))]):
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


@pytest.mark.slow
def test_every_command_stays_bounded_in_memory_whatever_engine_is_asked_for(tmp_path):
    from trainmon.testing.synthetic_run import SyntheticRun

    synth = SyntheticRun(ranks=4, steps=60, params=500, steps_per_file=25)  # 720,000 rows
    run = synth.write(tmp_path / "run", "parquet")
    # measured (VmHWM of the command's process; a 128 MB engine cap, 50k-row buckets): engine
    # 258 / 324 / 266 MB for anomalies / ranks / compare, in-memory 600 / 594 / 929 MB (2026-12-04).
    # Since anomalies and ranks hold a run within TRAINMON_ENGINE_MEMORY_ROWS (2M) in memory as
    # Arrow instead of staging it in files (2026-12-05: 368 / 378 / 329 MB with 50k-row buckets,
    # 518 / 531 / 327 MB with the defaults, 425 / 446 / 327 MB with the run in files).
    limit_mb, held_limit_mb = 480, 580
    # (a synthetic run: its param_origin rows do not continue its param_updated ones: no param_changed)
    anomalies = ["anomalies", str(run), "--rules", "nonfinite,spike"]
    for argv in (anomalies, ["ranks", str(run)], ["compare", str(run), str(run)]):
        engine_mb, engine_doc = peak_mb(argv, "duckdb", TRAINMON_ENGINE_BUCKET_ROWS="50000")
        memory_mb, memory_doc = peak_mb(argv, "memory")
        assert engine_doc == memory_doc
        # no in-memory path left: --engine memory is a deprecated no-op (issue 33)
        assert engine_mb < limit_mb and memory_mb < held_limit_mb, (argv[0], engine_mb, memory_mb)
        if argv[0] == "anomalies":
            first = engine_doc["anomalies"][0]
            assert (first["step"], first["kind"], first["rule"]) == (synth.spike_step, "grad_reduced", "spike")
    assert engine_doc["aligned_rows"] == synth.rows and engine_doc["diverged_rows"] == 0


@pytest.mark.parametrize("interleaved", [False, True])
def test_staged_positions_follow_the_file_order_whether_or_not_a_steps_rows_are_one_run(tmp_path, interleaved):
    # The sinks write a step's rows together (positions from the group's first row); a file whose
    # steps interleave takes the numbering window instead.  Truth: each name's place among its
    # step's rows in the file (b, a, c in both layouts).
    from trainmon.diagnosis.engine import Engine
    from trainmon.diagnosis.engine_buckets import StagedRun

    header = "vpp_stage,name,step,norm,mean,shape,dtype\n"
    rows = [(step, name) for step in (0, 1) for name in ("b", "a", "c")]
    if interleaved:
        rows = [rows[i] for i in (0, 3, 1, 4, 2, 5)]
    for rank in (0, 1):
        lines = "".join(f"0,{name},{step},{1 + step + rank},0.5,[2],torch.float32\n" for step, name in rows)
        (tmp_path / f"rank{rank}").mkdir()
        (tmp_path / f"rank{rank}" / "grad_reduced_0-1.csv").write_text(header + lines)
    want = sorted((rank, step, name, "bac".index(name)) for rank in (0, 1) for step in (0, 1) for name in "bac")
    frame = load_table(tmp_path).frame
    assert sorted(zip(frame["rank"], frame["step"], frame["name"], frame["position"])) == want
    with Engine() as eng:
        run = StagedRun(eng, engine.run_files(tmp_path), "b")
        got = eng.con.execute("SELECT rank, step, name, position FROM b_staged").fetchall()
        names = run.texts["name"]
    assert sorted((r, s, names[n], p) for r, s, n, p in got) == want
    assert {p for *_, p in want} == {0, 1, 2}


@pytest.mark.slow  # 3.0-5.6 s on a loaded 2-core VM (2026-12-06)
def test_ranks_and_compare_show_progress_after_staging_too(edge_run, monkeypatch):
    # Staging is the first third of the time at 100.8M rows; the sorts, buckets and alignment
    # groups after it are counted too, each phase to its end.
    import io
    import re

    from trainmon.cli._progress import Progress
    from trainmon.diagnosis import engine_buckets

    monkeypatch.setattr(engine_buckets, "DIRECT_FILES", 0)  # sorted again by name, as a large run is
    monkeypatch.setattr(engine, "MEMORY_ROWS", 0)  # and staged in files, as a large run is

    class Tty(io.StringIO):
        def isatty(self):
            return True

    files = engine.run_files(edge_run)
    out = Tty()
    progress = Progress("ranks", sum(len(v) for v in files.files.values()), out=out, interval_s=0)
    engine_ranks(files, rows_per_bucket=TINY_BUCKET, progress=progress)
    drawn = out.getvalue()
    staged = progress.rows
    assert f"{len(files.rows)}/{len(files.rows)} files, {staged:,} rows" in drawn
    sorts = re.findall(r"ranks: sorting \[#*\s*\] (\d+)/(\d+) runs of names", drawn)
    checks = re.findall(r"ranks: checking \[#*\s*\] (\d+)/(\d+) buckets", drawn)
    assert sorts[-1][0] == sorts[-1][1] == "1" and int(checks[-1][0]) == int(checks[-1][1]) > 2
    out = Tty()
    progress = Progress("compare", 0, out=out, interval_s=0)
    engine_compare(files, files, progress=progress)
    groups = re.findall(r"compare: aligning \[#*\s*\] (\d+)/(\d+) groups", out.getvalue())
    assert groups[0][0] == "0" and int(groups[-1][0]) == int(groups[-1][1]) >= 1


@pytest.mark.slow  # 3.0-5.6 s on a loaded 2-core VM (2026-12-06)
@pytest.mark.parametrize("name", ["edge", "blow3"])
def test_anomalies_per_bucket_of_names_find_what_the_whole_table_scan_finds(name, edge_run, pq_dir):
    from trainmon.diagnosis.engine_buckets import bucket_scan_all
    from trainmon.diagnosis.scan import scan_all

    run = edge_run if name == "edge" else named_run(name)
    want = scan_all(load_table(run))
    assert want.anomalies
    for files in (run, as_parquet(run, pq_dir)):
        got = bucket_scan_all(engine.run_files(files), Rules(), rows_per_bucket=TINY_BUCKET)
        assert [a.to_json(position=True) for a in got.anomalies] == [a.to_json(position=True) for a in want.anomalies]
        assert [n.to_json() for n in got.by_design] == [n.to_json() for n in want.by_design]
        assert got.unjudged == want.unjudged
