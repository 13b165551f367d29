"""Step-time overhead of xy_distribution (activations + their grads) on TinyGPT, CPU, 1 thread.

    OMP_NUM_THREADS=1 python benchmarks/overhead_xy.py [--rounds 7] [--steps 10]

Configurations run interleaved (round-robin, one block of steps each per round) so machine noise
hits all of them alike; each reports the median step time over all its timed steps and its ratio
to the unmonitored run:

* ``xy``: ``xy_distribution`` + ``all_xy`` (every module's input/output and their grads)
* ``all-on``: ``wg`` + ``mv`` + ``param`` + ``xy``
* ``interval10``: all-on with ``step_interval: 10``, timing only the steps that are NOT collected
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainmon import TrainerMon  # noqa: E402
from trainmon.demo import GPTConfig, TinyGPT, synthetic_batches  # noqa: E402

CFG = GPTConfig(vocab=256, seq=128, dim=256, heads=4, layers=4)
BASE_OPS = {"ops": ["norm", "mean", "min", "max"]}
XY = {"xy_distribution": True, "all_xy": True}
ALL = {"wg_distribution": True, "mv_distribution": True, "param_distribution": True, **XY}
CONFIGS = {"baseline": None, "xy": XY, "all-on": ALL, "interval10": {**ALL, "step_interval": 10}}


class Run:
    """One model + optimizer (+ monitor) trained step by step."""

    def __init__(self, name: str, monitor_cfg: dict | None, tmp: Path, batch: int):
        torch.manual_seed(0)
        self.name = name
        self.model = TinyGPT(CFG)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.monitor = None
        if monitor_cfg is not None:
            path = tmp / f"{name}.json"
            path.write_text(json.dumps({**BASE_OPS, **monitor_cfg}))
            self.monitor = TrainerMon(path).set_monitor(self.model, optimizer=self.optimizer)
        self.data = synthetic_batches(CFG, batch, 10**6, seed=1)
        self.step = 0
        self.times: list[float] = []

    def run_steps(self, n: int, timed: bool) -> None:
        for _ in range(n):
            tokens = next(self.data)
            t0 = time.perf_counter()
            self.model.loss(tokens).backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            skipped_by_interval = self.name != "interval10" or self.step % 10 != 0
            if timed and skipped_by_interval:
                self.times.append(dt)
            self.step += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10, help="steps per config per round")
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MONITOR_OUTPUT_DIR"] = str(Path(tmp) / "out")
        runs = [Run(name, cfg, Path(tmp), args.batch) for name, cfg in CONFIGS.items()]
        for r in runs:
            r.run_steps(2, timed=False)  # warm-up (allocator, first-step files)
        for _ in range(args.rounds):
            for r in runs:
                r.run_steps(args.steps, timed=True)
        for r in runs:
            if r.monitor:
                r.monitor.close()
    params = sum(p.numel() for p in runs[0].model.parameters())
    base = statistics.median(runs[0].times)
    print(f"TinyGPT {CFG} ({params / 1e6:.2f}M params), batch {args.batch}, 1 thread, "
          f"{args.rounds} rounds x {args.steps} steps")
    for r in runs:
        med = statistics.median(r.times)
        print(f"{r.name:>11}: {med * 1e3:8.1f} ms/step  {med / base:5.3f}x  (n={len(r.times)})")


if __name__ == "__main__":
    main()
