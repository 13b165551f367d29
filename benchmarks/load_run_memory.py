"""``trainmon.load_run`` on a big run: wall time, rows and peak RSS of one filtered load.

    PYTHONPATH=. python benchmarks/load_run_memory.py --size 10m --formats csv,parquet \\
        --families grad_reduced --engines auto,pandas --root /tmp/trainmon-scale

The run is ``benchmarks/analysis_scale.py``'s synthetic run of that size (``10m``: 8 ranks x 500
steps x 400 params x 6 families, 9,600,000 rows; written once under ``--root``, reused when
present).  Each load runs in a fresh interpreter (``python -c``), so its peak RSS
(``ru_maxrss`` of that child) counts the interpreter, pandas, DuckDB and the frame, nothing of
the parent's.  The frame is checked: one family's rows, all of them (ranks x steps x params).
``--limit-mb`` makes the script exit 1 when a load's peak RSS exceeds it (the issue's target:
1024 MB for one family of the 10m run).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from analysis_scale import SIZES, _run_dir

_CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
import trainmon
df = trainmon.load_run(sys.argv[1], families=sys.argv[2].split(","), engine=sys.argv[3])
wall = time.perf_counter() - t0
print(json.dumps({"rows": len(df), "families": sorted(df["family"].unique().tolist()), "wall_s": wall,
                  "frame_mb": df.memory_usage(deep=True).sum() / 2**20,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def measure(run: Path, families: str, engine: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(run), families, engine], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="1m", help=f"one of {', '.join(SIZES)}")
    ap.add_argument("--formats", default="csv,parquet")
    ap.add_argument("--families", default="grad_reduced", help="comma list handed to load_run")
    ap.add_argument("--engines", default="auto", help="comma list of auto, duckdb, pandas")
    ap.add_argument("--root", type=Path, default=Path("/tmp/trainmon-scale"))
    ap.add_argument("--limit-mb", type=float, default=None, help="exit 1 when a load's peak RSS exceeds this")
    args = ap.parse_args()
    synth = SIZES[args.size]
    want_rows = synth.ranks * synth.steps * synth.params * len(args.families.split(","))
    over = False
    for fmt in args.formats.split(","):
        run = _run_dir(args.root, args.size, fmt, synth)
        for engine in args.engines.split(","):
            got = measure(run, args.families, engine)
            ok = got["rows"] == want_rows and got["families"] == sorted(args.families.split(","))
            over |= args.limit_mb is not None and got["peak_rss_mb"] > args.limit_mb
            print(
                f"{args.size} {fmt:8s} {engine:7s} families={args.families}: {got['rows']:,} rows "
                f"({'ok' if ok else f'EXPECTED {want_rows:,}'}), {got['wall_s']:.1f} s, "
                f"frame {got['frame_mb']:.0f} MB, peak RSS {got['peak_rss_mb']:.0f} MB",
                flush=True,
            )
            over |= not ok
    sys.exit(1 if over else 0)


if __name__ == "__main__":
    main()
