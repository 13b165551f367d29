"""Rows that stress readers and converters, written with the real CSV sink: repeated names in a step
(comm calls, ``occurrence`` > 0), extra columns, -0.0, subnormals, inf, float64 max, quoted names,
a tensor called "NA", and a header variant (``ops`` changed mid-window: a ``.1`` file)."""
from __future__ import annotations

from pathlib import Path

from trainmon.sinks import SinkOptions
from trainmon.sinks.csv import CsvSink
from trainmon.stats.rows import StatRow, StepRows


def edge_rows(rank_dir: Path) -> None:
    sink = CsvSink(SinkOptions(rank_dir=rank_dir, step_count_per_record=2))
    for step in range(3):
        sink.write(StepRows.of([
            StatRow("comm", "all_reduce", step, {"norm": -0.0, "max": 5e-324}, (8,), "torch.float32",
                    extra={"op": "all_reduce", "call": step, "phase": "bwd"}),
            StatRow("comm", "all_reduce", step, {"norm": float("inf"), "max": 1.7976931348623157e308}, (8,),
                    "torch.float32", extra={"op": "all_reduce", "call": step + 1, "phase": "bwd"}),
            StatRow("grad_reduced", 'a,"b"', step, {"norm": 0.1 + 0.2, "nans": 3}, (), "torch.bfloat16"),
            StatRow("grad_reduced", "NA", step, {"norm": float("nan"), "nans": 0}, (2, 3), "torch.float32"),
        ]), step=step)
    sink.write(StepRows.of([StatRow("grad_reduced", "NA", 3, {"norm": 1.0, "nans": 0, "max": 2.0},
                                    (2, 3), "torch.float32")]), step=3)  # another header: a .1 file
    sink.close()


def as_parquet(run: Path, tmp: Path) -> Path:
    """``run`` converted to Parquet with ``trainmon convert`` under ``tmp`` (once)."""
    from trainmon.cli import main

    out = tmp / (run.name + "-pq")
    if not out.exists():
        assert main(["convert", str(run), "--to", "parquet", "-o", str(out), "--json"]) == 0
    return out
