"""What ``on_anomaly`` costs while nothing fires, and what the flight recorder holds in memory.

1. Step time (TinyGPT on CPU, one thread): medians of per-step times, in interleaved blocks, of
   * ``none``     no monitor;
   * ``base``     ``wg_distribution`` every step + the AnomalyNan alert rule;
   * ``escalate`` base + ``on_anomaly`` (no flight recorder): the boundary waits until the writer
     thread has judged the step, then one agreement (a no-op in one process);
   * ``recorder`` escalate + ``history_steps`` H: activations of every module recorded every step
     into the in-memory ring (``xy_distribution`` + ``all_xy``), nothing written.
   Ratios are against ``none``; the differences against ``base`` are what escalation adds.
2. Flight recorder memory: ``tracemalloc`` bytes held by a full ring, per recorded tensor per step
   (the ring holds H + 1 steps), for a per-parameter family (``param_distribution``) and for
   activations, with the default 4 ops.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/escalation.py [--steps 20] [--repeats 5] [--history 8]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainmon.testing.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches  # noqa: E402

MODEL = GPTConfig(vocab=128, seq=32, dim=64, heads=4, layers=2)
BASE = {"wg_distribution": True, "alert": {"rules": [{"rule_name": "AnomalyNan"}]}}
XY = {"xy_distribution": True, "all_xy": True}


def configs(history: int) -> dict[str, dict | None]:
    return {"none": None, "base": BASE,
            "escalate": {**BASE, "on_anomaly": {"config": XY, "steps": 5}},
            "recorder": {**BASE, "on_anomaly": {"config": XY, "steps": 5, "history_steps": history}}}


class Job:
    def __init__(self, config: dict | None, folder: Path, name: str):
        from trainmon import TrainerMon

        torch.manual_seed(0)
        self.model = TinyGPT(MODEL)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.batches = synthetic_batches(MODEL, 8, 10_000)
        self.mon = None
        if config is not None:
            path = folder / f"{name}.json"
            path.write_text(json.dumps(config))
            os.environ["TRAINMON_RUN_ID"] = name
            self.mon = TrainerMon(path)
            self.mon.set_monitor(self.model, optimizer=self.opt)

    def steps(self, n: int) -> list[float]:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.model.loss(next(self.batches)).backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
        return times

    def close(self) -> None:
        if self.mon is not None:
            self.mon.close()


def step_times(args: argparse.Namespace, folder: Path) -> dict[str, float]:
    jobs = {name: Job(cfg, folder, name) for name, cfg in configs(args.history).items()}
    for job in jobs.values():
        job.steps(3)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in jobs}
    for r in range(args.repeats):
        order = list(jobs) if r % 2 == 0 else list(reversed(jobs))
        for name in order:
            times[name] += jobs[name].steps(args.steps)
    for job in jobs.values():
        job.close()
    return {name: statistics.median(t) for name, t in times.items()}


def ring_bytes_per_row(history: int, partial: dict, folder: Path) -> tuple[float, int]:
    """Bytes a full ring holds per recorded row (one tensor at one step), and the rows held."""
    cfg = {**BASE, "on_anomaly": {"config": partial, "steps": 1, "history_steps": history}}
    job = Job(cfg, folder, f"mem{len(partial)}")
    session = job.mon._driver.session
    tracemalloc.start()
    job.steps(history + 3)       # the ring is full (H + 1 steps) from here on
    gc.collect()
    full = tracemalloc.get_traced_memory()[0]
    held = session.ring._held
    rows = sum(len(rows) for rows, _ in held)   # builds the rows: count them, then drop everything
    session.ring.discard()
    gc.collect()
    empty = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    job.close()
    return (full - empty) / max(rows, 1), rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per block")
    parser.add_argument("--repeats", type=int, default=5, help="blocks per variant")
    parser.add_argument("--history", type=int, default=8, help="history_steps of the recorder variant")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MONITOR_OUTPUT_DIR"] = tmp
        folder = Path(tmp)
        med = step_times(args, folder)
        print(f"step time, median of {args.steps * args.repeats} steps (ms) and ratio to no monitor:")
        for name, t in med.items():
            print(f"  {name:9s} {t * 1e3:8.2f} ms  x{t / med['none']:.3f}")
        for what, partial in (("param_distribution (per parameter)", {"param_distribution": True}),
                              ("activations (per module input/output)", XY)):
            per_row, rows = ring_bytes_per_row(args.history, partial, folder)
            print(f"flight recorder, {what}: {per_row:.0f} bytes per tensor per held step "
                  f"({rows} rows held for history_steps={args.history})")


if __name__ == "__main__":
    main()
