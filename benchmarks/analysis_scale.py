"""Analysis commands at scale: wall time, rows/s and peak RSS on synthetic runs of growing size.

    PYTHONPATH=. python benchmarks/analysis_scale.py --sizes 1m,10m --formats csv,parquet \\
        --paths bucket,memory --commands anomalies,ranks,compare --root /tmp/trainmon-scale

Each run is a consistent data-parallel run (``trainmon.testing.synthetic_run``: replicated
families equal on every rank) with a planted NaN and a planted spike, written once per size and
format under ``--root`` (reused when present).  Each command runs in its own process
(``python -m trainmon ... --json``, ``--cluster ADDRESS`` passed on; ``--paths memory``: the old
in-memory path, ``load_run`` and the checks on the whole table, for comparison, run from a
checkout of a commit that had it, ``--baseline PATH``: ``git worktree add /tmp/before 47ffcf1``);
its peak RSS is that child's ``ru_maxrss``.  ``anomalies`` runs the rules it plants faults for (``RULES``).  The first
finding is checked against the planted fault, so a fast wrong answer cannot pass: ``anomalies``
must find the spike first and the NaN, ``ranks`` exactly the NaN on its one rank, ``compare``
(the run against a copy whose ``param_updated`` drifts from step ``steps // 4``: written beside
it, ``<size>-<format>-drift``) the drift's first step and its every row.  rows/s counts the rows
a command reads (both runs for ``compare``).

``--read-floor`` measures, per size and format, what no command can go below: a fresh interpreter
importing what the commands import, and DuckDB reading every column of every family file of the
run once (CSV typed as the engine reads it), with nothing computed.  Its CSV/Parquet ratio is the
largest speedup Parquet can give any command that reads its whole run through DuckDB.  Sizes:

=====  =====================================  ===========
size   ranks x steps x params x families      rows
=====  =====================================  ===========
1m     4 x 100 x 420 x 6                      1,008,000
10m    8 x 500 x 400 x 6  (the issue's run)   9,600,000
100m   16 x 2,500 x 420 x 6                   100,800,000
=====  =====================================  ===========
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from trainmon.testing.synthetic_run import SyntheticRun

SIZES = {
    "tiny": SyntheticRun(ranks=2, steps=40, params=50, steps_per_file=10),
    "1m": SyntheticRun(ranks=4, steps=100, params=420, steps_per_file=10),
    "10m": SyntheticRun(ranks=8, steps=500, params=400, steps_per_file=10),
    "100m": SyntheticRun(ranks=16, steps=2500, params=420, steps_per_file=50),
}
REPO = Path(__file__).resolve().parents[1]


def _drifted(synth: SyntheticRun) -> SyntheticRun:
    return dataclasses.replace(synth, drift_step=synth.steps // 4)


def _run_dir(root: Path, size: str, fmt: str, synth: SyntheticRun) -> Path:
    path = root / (f"{size}-{fmt}" + ("-drift" if synth.drift_step is not None else "")) / "run"
    done = path.parent / "complete"
    if not done.exists():
        t0 = time.perf_counter()
        synth.write(path, fmt)
        done.write_text(f"{time.perf_counter() - t0:.1f}")
    return path


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _planted(command: str, doc: dict, synth: SyntheticRun) -> bool:
    """Whether the command's first findings are the planted faults."""
    if command == "anomalies":
        first = doc["anomalies"][0]
        nan = [a for a in doc["anomalies"] if a["rule"] == "nonfinite"]
        return (
            (first["step"], first["kind"], first["rule"]) == (synth.spike_step, "grad_reduced", "spike")
            and bool(nan)
            and (nan[0]["step"], nan[0]["rank"]) == (synth.nan_step, synth.nan_rank)
        )
    if command == "ranks":
        first = doc["issues"][0]
        want = (synth.nan_step, "grad_unreduced", synth.nan_rank, "nonfinite_some_ranks")
        return doc["count"] == 1 and (first["step"], first["kind"], first["rank"], first["check"]) == want
    first, drift = doc["first_divergence"], _drifted(synth)
    want = (drift.drift_step, "param_updated", synth.names()[synth.spike_param], 0)
    return (first["step"], first["kind"], first["name"], first["rank"]) == want and doc["diverged_rows"] == (
        synth.steps - drift.drift_step
    ) * synth.ranks


# The synthetic runs do not carry a param's value from one step's ``param_updated`` to the next
# step's ``param_origin``, so the ``param_changed`` rule would flag every ``param_origin`` row
# (1.6M findings at 9.6M rows, which the JSON and the findings' memory would then measure): the
# benchmark runs the rules it plants faults for.
RULES = ("--rules", "nonfinite,spike")


def _command(command: str, runs: list[Path], path: str, cluster: str | None) -> list[str]:
    """``python -m trainmon COMMAND RUNS --json`` (``path`` "bucket", the commands' one path), or
    the in-memory path the commands used before (``memory``: the whole run read into pandas,
    ``_memory`` in a child), with the same rules and the same JSON fields the check reads."""
    if path == "memory":
        child = f"import analysis_scale as a; a._memory({command!r}, {[str(r) for r in runs]!r})"
        return [sys.executable, "-c", child]
    extra = [*RULES] if command == "anomalies" else []
    extra += ["--cluster", cluster] if cluster else []
    return [sys.executable, "-m", "trainmon", command, *map(str, runs), "--json", *extra]


def _memory(command: str, runs: list[str]) -> None:
    """(Child process, the ``--baseline`` checkout first on its path) the old in-memory path:
    ``scan`` / ``check_ranks`` / ``compare_runs`` of ``load_run``'s whole table, printed as the
    command's JSON fields the check reads."""
    from trainmon.diagnosis.reader import load_run

    if command == "anomalies":
        from trainmon.diagnosis.scan import scan

        try:
            from trainmon.diagnosis.rules import Rules  # where the rules lived before the move
        except ImportError:
            from trainmon.analysis.rules import Rules
        off = {k: False for k in ("param_changed",) if k in Rules.__dataclass_fields__}  # RULES only
        found = scan(load_run(runs[0]), Rules(**off))
        doc: dict = {"count": len(found), "anomalies": [a.to_json() for a in found]}
    elif command == "ranks":
        from trainmon.diagnosis.ranks import check_ranks

        issues = check_ranks(load_run(runs[0]))
        doc = {"count": len(issues), "issues": [i.to_json() for i in issues]}
    else:
        from trainmon.diagnosis.compare import compare_runs

        doc = compare_runs(load_run(runs[0]), load_run(runs[1])).to_json()
    json.dump(doc, sys.stdout)


def _one(
    command: str, runs: list[Path], synth: SyntheticRun, path: str, cluster: str | None = None, baseline=None
) -> dict:
    # A fresh interpreter per measurement keeps ru_maxrss per command (RUSAGE_CHILDREN is a max).
    code = (
        "import resource, subprocess, sys; p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
        "sys.stdout.write(p.stdout); sys.stderr.write(p.stderr); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(p.returncode)"
    )
    tree = baseline if path == "memory" else REPO  # the in-memory path: the old checkout's code
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(REPO / "benchmarks")]), OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    argv = _command(command, runs, path, cluster)
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{command} {runs[0]} ({path}) failed: {proc.stderr.strip()[-500:]}")
    doc = json.loads(proc.stdout)
    findings = doc.get("count", doc.get("diverged_rows"))
    return {
        "wall_s": wall,
        "peak_rss_mb": int(proc.stderr.strip().splitlines()[-1]) / 1024,
        "findings": findings,
        "first_is_planted": _planted(command, doc, synth),
    }


def _floor_read(run: str, fmt: str) -> None:
    """(Child process of ``_read_floor``) prints the seconds DuckDB takes to read every column of
    every family file of ``run`` once, through the engine's own scan of each header's files (CSV
    typed as ``anomalies`` reads it), and the rows."""
    from trainmon.diagnosis import engine, sql

    files = engine.run_files(run)
    with engine.Engine() as eng:
        scans = []  # (the scan of one header's files, that header)
        for family, stats in files.family_stats.items():
            fam = sql.Family(eng.con, family, files.files[family], stats, headers=files.headers)
            scans += [(fam._scan(header, paths, filename=False), header) for header, paths in fam.groups.items()]
        t0, rows = time.perf_counter(), 0
        for scan, header in scans:
            every = ", ".join(sql.quote(c) for c in header)  # every column consumed: neither format skips one
            rows += eng.con.execute(f"SELECT count(*), bit_xor(hash({every})) FROM {scan}").fetchone()[0]
        print(time.perf_counter() - t0, rows)


def _read_floor(run: Path, fmt: str) -> tuple[float, float, int]:
    """(interpreter start and imports, DuckDB's read of every column, rows read), in seconds."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import duckdb, pandas, trainmon.cli"], check=True, env=env)
    start = time.perf_counter() - t0
    child = f"import analysis_scale as a; a._floor_read({str(run)!r}, {fmt!r})"
    env["PYTHONPATH"] += os.pathsep + str(REPO / "benchmarks")
    out = subprocess.run([sys.executable, "-c", child], check=True, capture_output=True, text=True, env=env)
    read, rows = out.stdout.split()
    return start, float(read), int(rows)


def read_floor(sizes: list[str], formats: list[str], root: Path) -> None:
    print("size  rows        format   start s  read s  floor s  CSV/Parquet floor")
    for size in sizes:
        synth, floor = SIZES[size], {}
        for fmt in formats:
            start, read, rows = _read_floor(_run_dir(root, size, fmt, synth), fmt)
            assert rows == synth.rows, (rows, synth.rows)
            floor[fmt] = start + read
            ratio = f"{floor['csv'] / floor['parquet']:.2f}x" if len(floor) == 2 else ""
            cells = f"{size:<5} {rows:<11,} {fmt:<8} {start:>7.2f}  {read:>6.2f}  {start + read:>7.2f}"
            print(f"{cells}  {ratio}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1m", help=f"comma list of {', '.join(SIZES)}")
    ap.add_argument("--formats", default="csv,parquet")
    ap.add_argument(
        "--paths",
        default="bucket",
        help="comma list of bucket (the commands: DuckDB stages, checks per bucket) and memory (the "
        "old in-memory path: the whole run read into pandas, for comparison; needs --baseline)",
    )
    ap.add_argument(
        "--baseline",
        type=Path,
        default=None,
        metavar="PATH",
        help="a checkout of a commit with the in-memory path, for --paths memory "
        "(git worktree add /tmp/before 47ffcf1)",
    )
    ap.add_argument("--cluster", default=None, metavar="ADDRESS", help="pass --cluster ADDRESS to the commands")
    ap.add_argument("--commands", default="anomalies", help="comma list of anomalies, ranks, compare")
    ap.add_argument("--root", type=Path, default=Path("/tmp/trainmon-scale"))
    ap.add_argument("--read-floor", action="store_true", help="only the read floor of each size and format")
    args = ap.parse_args()
    if "memory" in args.paths.split(",") and args.baseline is None:
        ap.error("--paths memory needs --baseline PATH (a checkout with the old in-memory path)")
    if args.read_floor:
        read_floor(args.sizes.split(","), sorted(args.formats.split(",")), args.root)
        return
    print(
        "command    size  rows        format   MB on disk  path    wall s  rows/s      peak RSS MB  findings  first ok"
    )
    for size in args.sizes.split(","):
        synth = SIZES[size]
        for fmt in args.formats.split(","):
            run = _run_dir(args.root, size, fmt, synth)
            mb = _du(run) / 2**20
            for command in args.commands.split(","):
                runs = [run, _run_dir(args.root, size, fmt, _drifted(synth))] if command == "compare" else [run]
                rows = synth.rows * len(runs)
                for path in args.paths.split(","):
                    r = _one(command, runs, synth, path, args.cluster, args.baseline)
                    print(
                        f"{command:<10} {size:<5} {synth.rows:<11,} {fmt:<8} {mb:>10.0f}  {path:<7} "
                        f"{r['wall_s']:>6.1f}  {rows / r['wall_s']:>10,.0f}  {r['peak_rss_mb']:>11.0f}  "
                        f"{r['findings']:>8}  {r['first_is_planted']}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
