"""TensorBoard output speed: ``csv2tb`` conversion rate, and native TB's cost on the training step.

    python benchmarks/tb_convert.py convert                  # 1,000 params x 1,000 steps, wg families
    python benchmarks/tb_convert.py convert --families all   # every per-param family (7 x the rows)
    python benchmarks/tb_convert.py overhead                 # step time, csv vs csv+tensorboard
    python benchmarks/tb_convert.py sink                     # native sink encode+write time per step

``convert`` writes a synthetic run with the real CSV sink (excluded from the timing), then
times ``convert_rank`` on it and reports rows/s, scalars/s and CSV MB/s.

``overhead`` trains a 1,000-param model (500 Linear layers, CPU, one thread) under
``TrainerMon`` with ``format: csv`` and with ``format: [csv, tensorboard]``, interleaved
(A B A B ...) so machine noise hits both alike.  It reports the median training-step time of
each (what the training thread sees, writer thread running alongside) and the wall time
including the final drain of the writer queue, and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OPS = ("norm", "mean", "min", "max")
WG = ("grad_unreduced", "grad_reduced")
ALL = (*WG, "param_origin", "param_updated", "exp_avg", "exp_avg_sq", "update_ratio")


def _names(n: int) -> list[str]:
    return [f"model.layers.{i // 2}.linear.{'weight' if i % 2 == 0 else 'bias'}" for i in range(n)]


def _step_rows(step: int, names: list[str], families: tuple[str, ...], rng: random.Random):
    """One step's rows as the sinks receive them from the engine (``StepRows``)."""
    from trainmon.stats.rows import StatRow, StepRows

    rows = []
    for family in families:
        for name in names:
            if family == "update_ratio":
                stats = {"update_ratio": rng.random() * 1e-3}
            else:
                stats = {op: rng.gauss(0, 1) * 10 ** rng.randint(-6, 2) for op in OPS}
            rows.append(StatRow(family, name, step, stats, (256, 256), "torch.float32"))
    return StepRows.of(rows)


def make_csv_run(run_dir: Path, params: int, steps: int, families: tuple[str, ...], per_record: int) -> None:
    from trainmon.sinks import SinkOptions
    from trainmon.sinks.csv import CsvSink

    sink = CsvSink(SinkOptions(rank_dir=run_dir / "rank0", step_count_per_record=per_record))
    names, rng = _names(params), random.Random(0)
    for step in range(steps):
        sink.write(_step_rows(step, names, families, rng), step)
    sink.close()


def bench_convert(args) -> None:
    from trainmon.cli.csv2tb import convert_rank

    families = ALL if args.families == "all" else tuple(args.families.split(","))
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        run = Path(tmp) / "run"
        t0 = time.perf_counter()
        make_csv_run(run, args.params, args.steps, families, args.per_record)
        made = time.perf_counter() - t0
        csv_bytes = sum(p.stat().st_size for p in (run / "rank0").glob("*.csv"))
        print(
            f"wrote {args.params} params x {args.steps} steps x {len(families)} families "
            f"({csv_bytes / 1e6:.0f} MB of CSV) in {made:.1f} s"
        )
        t0 = time.perf_counter()
        result = convert_rank(run / "rank0", run / "tensorboard" / "rank0")
        took = time.perf_counter() - t0
        out_bytes = sum(p.stat().st_size for p in (run / "tensorboard" / "rank0").iterdir())
    print(
        f"csv2tb: {result.rows:,} rows, {result.scalars:,} scalars in {took:.1f} s: "
        f"{result.rows / took:,.0f} rows/s, {result.scalars / took:,.0f} scalars/s, "
        f"{csv_bytes / took / 1e6:.1f} MB/s of CSV; events {out_bytes / 1e6:.0f} MB"
    )


def bench_sink(args) -> None:
    from trainmon.sinks import SinkOptions
    from trainmon.sinks.csv import CsvSink
    from trainmon.sinks.tensorboard import TensorBoardSink

    families = ALL if args.families == "all" else tuple(args.families.split(","))
    names, rng = _names(args.params), random.Random(0)
    steps = [_step_rows(s, names, families, rng) for s in range(args.steps)]
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for cls in (CsvSink, TensorBoardSink):
            sink = cls(SinkOptions(rank_dir=Path(tmp) / cls.__name__ / "rank0", step_count_per_record=100))
            sink.write(steps[0], 0)  # first step builds the per-name caches
            t0 = time.perf_counter()
            for s, rows in enumerate(steps[1:], 1):
                sink.write(rows, s)
            per = (time.perf_counter() - t0) / (len(steps) - 1)
            sink.close()
            print(
                f"{cls.__name__}: {per * 1e3:.1f} ms per step of {len(steps[0]) * len(OPS):,} scalars "
                f"(writer thread time)"
            )


# ---------------------------------------------------------------------------------------------
def _model(params: int, width: int):
    import torch.nn as nn

    layers = []
    for _ in range(params // 2):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def _time_run(fmt: list[str], args, workdir: Path) -> tuple[float, float]:
    import torch

    from trainmon import TrainerMon

    torch.manual_seed(0)
    model = _model(args.params, args.width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cfg = workdir / f"cfg_{'_'.join(fmt)}.json"
    cfg.write_text(
        json.dumps(
            {
                "wg_distribution": True,
                "mv_distribution": True,
                "param_distribution": True,
                "ur_distribution": True,
                "ops": list(OPS),
                "format": fmt,
                "step_count_per_record": 100,
            }
        )
    )
    x = torch.randn(args.batch, args.width)
    times = []
    t_start = time.perf_counter()
    monitor = TrainerMon(cfg).set_monitor(model, optimizer=optimizer)
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    monitor.close()  # drains the writer queue
    return statistics.median(times), time.perf_counter() - t_start


def _time_tb_writes() -> dict[str, float]:
    """Wrap TensorBoardSink.write to add up its time on the writer thread (an upper bound on what
    it can take from the training thread, were it holding the GIL all along)."""
    from trainmon.sinks.tensorboard import TensorBoardSink

    spent = {"wall": 0.0, "cpu": 0.0, "calls": 0}
    write = TensorBoardSink.write

    def timed(self, rows, step):
        t0, c0 = time.perf_counter(), time.thread_time()
        write(self, rows, step)
        spent["wall"] += time.perf_counter() - t0
        spent["cpu"] += time.thread_time() - c0
        spent["calls"] += 1

    TensorBoardSink.write = timed
    return spent


def bench_overhead(args) -> None:
    import torch

    torch.set_num_threads(1)
    tb_time = _time_tb_writes()
    labels = {"csv": ["csv"], "csv+tensorboard": ["csv", "tensorboard"]}
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in labels}
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        os.environ["MONITOR_OUTPUT_DIR"] = str(Path(tmp) / "out")
        for r in range(args.repeats):
            order = list(labels) if r % 2 == 0 else list(labels)[::-1]  # ABBA: drift hits both alike
            for label in order:
                results[label].append(_time_run(labels[label], args, Path(tmp)))
            line = ", ".join(f"{k} {results[k][-1][0] * 1e3:.1f} ms" for k in labels)
            print(f"  repeat {r}: median step {line}", flush=True)
    paired = [tb[0] / csv[0] for csv, tb in zip(results["csv"], results["csv+tensorboard"])]
    paired_wall = [tb[1] / csv[1] for csv, tb in zip(results["csv"], results["csv+tensorboard"])]
    print(
        f"{args.params} params (width {args.width}), {args.steps} steps x {args.repeats} repeats, "
        f"wg+mv+param+ur families, ops {','.join(OPS)}"
    )
    for k, v in results.items():
        print(
            f"  {k:16s} median step {statistics.median(m for m, _ in v) * 1e3:7.1f} ms   "
            f"wall incl. drain {statistics.median(w for _, w in v):6.1f} s"
        )
    print(
        f"  native TB step-time cost over CSV-only: {(statistics.median(paired) - 1) * 100:+.1f}% "
        f"(paired repeats: {min(paired) - 1:+.1%} .. {max(paired) - 1:+.1%}); "
        f"wall incl. drain {(statistics.median(paired_wall) - 1) * 100:+.1f}%"
    )
    per_write = tb_time["wall"] / max(tb_time["calls"], 1)
    step_tb = statistics.median(m for m, _ in results["csv+tensorboard"])
    print(
        f"  TensorBoardSink.write on the writer thread: {per_write * 1e3:.1f} ms per step "
        f"({tb_time['cpu'] / max(tb_time['calls'], 1) * 1e3:.1f} ms CPU) = {per_write / step_tb:.1%} of a step: "
        f"the most it could take from the training thread"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("convert", "overhead", "sink"))
    parser.add_argument("--params", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=None, help="default: 1000 (convert), 12 (overhead), 20 (sink)")
    parser.add_argument("--families", default="wg", help="'wg', 'all' or a comma list (convert, sink)")
    parser.add_argument("--per-record", type=int, default=100, help="step_count_per_record of the CSV run")
    parser.add_argument("--width", type=int, default=128, help="Linear width (overhead)")
    parser.add_argument("--batch", type=int, default=32, help="batch size (overhead)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--workdir", default=None, help="where temporary runs go (default: system temp)")
    args = parser.parse_args()
    if args.families == "wg":
        args.families = ",".join(WG)
    args.steps = args.steps or {"convert": 1000, "overhead": 12, "sink": 20}[args.mode]
    {"convert": bench_convert, "overhead": bench_overhead, "sink": bench_sink}[args.mode](args)


if __name__ == "__main__":
    main()
