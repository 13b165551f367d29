"""DuckDB vs Polars on the heavy part of ``anomalies``: per-series running-median baselines + non-finite rows.

    PYTHONPATH=. python benchmarks/engine_choice.py RUN_DIR [--engine duckdb|polars] [--threads N]

Runs ONE engine in this process and prints wall time, peak RSS and the number of hits, so each
engine's figure is its own process's.  The query is the same for both: for every family and the
``norm`` stat, the median of the previous 16 finite values of each (rank, vpp_stage, name) series
(judged from 5 values on), hits where the ratio leaves [1/10, 10]; plus rows whose nans/infs > 0.
"""
from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

from trainmon.output.runs import family_files, rank_dirs


def _files(run: Path) -> dict[str, list[tuple[int, str]]]:
    out: dict[str, list[tuple[int, str]]] = {}
    for rdir in rank_dirs(run):
        rank = int(rdir.name[4:])
        for family, files in family_files(rdir).items():
            out.setdefault(family, []).extend((rank, str(f.path)) for f in files)
    return out


def run_duckdb(run: Path, threads: int) -> int:
    import duckdb

    con = duckdb.connect(config={"threads": threads, "memory_limit": "1GB", "preserve_insertion_order": False})
    hits = 0
    for family, files in _files(run).items():
        paths = [p for _, p in files]
        reader = "read_parquet" if paths[0].endswith(".parquet") else "read_csv"
        src = (f"SELECT CAST(regexp_extract(filename, 'rank([0-9]+)/', 1) AS INTEGER) AS rank, * "
               f"FROM {reader}({paths!r}, filename=true)")
        q = f"""
        WITH t AS ({src}),
        b AS (SELECT rank, name, step, norm, list_sort(list(norm) OVER w) AS l FROM t WHERE isfinite(norm)
              WINDOW w AS (PARTITION BY rank, vpp_stage, name ORDER BY step ROWS BETWEEN 16 PRECEDING AND 1 PRECEDING)),
        m AS (SELECT *, CASE WHEN len(l) % 2 = 1 THEN l[len(l) // 2 + 1] ELSE (l[len(l) // 2] + l[len(l) // 2 + 1]) / 2 END
              AS base FROM b WHERE len(l) >= 5)
        SELECT count(*) FROM m WHERE (abs(norm) + 1e-6) / (abs(base) + 1e-6) >= 10
                                   OR (abs(norm) + 1e-6) / (abs(base) + 1e-6) <= 0.1
        """
        hits += con.execute(q).fetchone()[0]
        hits += con.execute(f"SELECT count(*) FROM ({src}) WHERE nans > 0 OR infs > 0").fetchone()[0]
    return hits


def run_polars(run: Path, threads: int) -> int:
    import os
    os.environ["POLARS_MAX_THREADS"] = str(threads)
    import polars as pl

    hits = 0
    for family, files in _files(run).items():
        frames = []
        for rank, p in files:
            scan = pl.scan_parquet(p) if p.endswith(".parquet") else pl.scan_csv(p)
            frames.append(scan.with_columns(pl.lit(rank).alias("rank")))
        t = pl.concat(frames, how="diagonal_relaxed")
        series = ["rank", "vpp_stage", "name"]
        fin = t.filter(pl.col("norm").is_finite()).sort([*series, "step"])
        base = pl.col("norm").rolling_median(16, min_samples=5).shift(1).over(series)
        ratio = (pl.col("norm").abs() + 1e-6) / (pl.col("base").abs() + 1e-6)
        q = fin.with_columns(base.alias("base")).filter((ratio >= 10) | (ratio <= 0.1)).select(pl.len())
        hits += q.collect(engine="streaming").item()
        hits += t.filter((pl.col("nans") > 0) | (pl.col("infs") > 0)).select(pl.len()).collect(engine="streaming").item()
    return hits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", type=Path)
    ap.add_argument("--engine", choices=["duckdb", "polars"], required=True)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    t0 = time.perf_counter()
    hits = (run_duckdb if args.engine == "duckdb" else run_polars)(args.run, args.threads)
    wall = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{args.engine}: {wall:.2f} s, peak RSS {rss:.0f} MB, hits {hits}")


if __name__ == "__main__":
    main()
