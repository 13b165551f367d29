"""What dynamic mode costs while monitoring is off.

1. Idle step time: TinyGPT on CPU, one thread, a step with ``DYNAMIC_MONITOR=true`` and a config
   whose ``dynamic_on`` is false (only the step-boundary wrapper and the watcher exist) against
   the same step without any monitor.  Two identical jobs in one process, timed in interleaved
   blocks (order alternating), medians of the per-step times.
   Because a shared machine makes that ratio noisy, the absolute cost of the idle boundary is
   measured too: ``optimizer.step()`` of a 1-element SGD with and without the idle monitor.
2. Agreement cost: the per-step broadcast that makes every rank switch on the same step,
   microseconds per step boundary on 2 and 4 gloo ranks (an idle controller's boundary, which is
   that broadcast plus a few attribute reads).

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/dynamic_idle.py [--repeats 15] [--boundaries 2000]
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

from trainmon.testing.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches  # noqa: E402

MODEL = GPTConfig(vocab=128, seq=32, dim=64, heads=4, layers=2)


class Job:
    """One model and optimizer; the monitor is attached for some blocks and closed for others,
    so both variants run on the very same tensors and allocator state."""

    def __init__(self, monitor_config: Path):
        from trainmon import TrainerMon

        torch.manual_seed(0)
        self.model = TinyGPT(MODEL)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.data = synthetic_batches(MODEL, 8, 10**9, seed=1)
        self.mon = TrainerMon(monitor_config)

    def steps(self, n: int, monitored: bool) -> list[float]:
        if monitored:
            self.mon.set_monitor(self.model, optimizer=self.opt)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.model.loss(next(self.data)).backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
        self.mon.close()
        return times


def idle_ratio(repeats: int, block: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.update(DYNAMIC_MONITOR="true", MONITOR_OUTPUT_DIR=str(Path(tmp) / "out"))
        cfg = Path(tmp) / "conf" / "monitor_config.json"
        cfg.parent.mkdir()
        cfg.write_text(json.dumps({"dynamic_on": False, "wg_distribution": True}))
        job = Job(cfg)
        job.steps(5, False), job.steps(5, True)  # warm-up
        times: dict[bool, list[float]] = {False: [], True: []}
        for r in range(repeats):
            for monitored in ((False, True) if r % 2 else (True, False)):
                times[monitored].extend(job.steps(block, monitored))
    mb, mi = statistics.median(times[False]), statistics.median(times[True])
    return {"step_ms_no_monitor": mb * 1e3, "step_ms_dynamic_idle": mi * 1e3, "ratio": mi / mb,
            "steps_each": len(times[False])}


def boundary_overhead_us(repeats: int, n: int = 5000) -> dict:
    """Absolute cost of the idle boundary: ``optimizer.step()`` of a 1-element SGD, with the idle
    dynamic monitor attached or not (interleaved blocks; median of the block means)."""
    from trainmon import TrainerMon

    with tempfile.TemporaryDirectory() as tmp:
        os.environ.update(DYNAMIC_MONITOR="true", MONITOR_OUTPUT_DIR=str(Path(tmp) / "out"))
        cfg = Path(tmp) / "monitor_config.json"
        cfg.write_text(json.dumps({"dynamic_on": False}))
        model = torch.nn.Linear(1, 1, bias=False)
        model.weight.grad = torch.zeros_like(model.weight)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        mon = TrainerMon(cfg)
        blocks: dict[bool, list[float]] = {False: [], True: []}
        for r in range(repeats):
            for monitored in ((False, True) if r % 2 else (True, False)):
                if monitored:
                    mon.set_monitor(model, optimizer=opt)
                t0 = time.perf_counter()
                for _ in range(n):
                    opt.step()
                blocks[monitored].append((time.perf_counter() - t0) / n)
                mon.close()
    base, idle = statistics.median(blocks[False]), statistics.median(blocks[True])
    return {"bare_step_us": base * 1e6, "idle_monitor_step_us": idle * 1e6,
            "overhead_us_per_step": (idle - base) * 1e6}


def _agreement_rank(rank: int, world: int, n: int, out_dir: str) -> None:
    import torch.distributed as dist

    from trainmon import TrainerMon

    cfg = Path(out_dir) / "conf" / "monitor_config.json"
    mon = TrainerMon(cfg)
    mon.set_monitor(torch.nn.Linear(2, 2))      # no optimizer: we drive the boundary by hand
    controller = mon._driver
    for _ in range(50):
        controller.after_step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        controller.after_step()
    per = (time.perf_counter() - t0) / n
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        dist.barrier()                            # a reference: the cheapest collective there is
    barrier = (time.perf_counter() - t0) / n
    mon.close()
    Path(out_dir, f"r{rank}.json").write_text(json.dumps({"boundary_us": per * 1e6, "barrier_us": barrier * 1e6}))


def agreement_cost(world: int, n: int) -> dict:
    from tests._support.distributed import run_distributed

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "conf").mkdir()
        (Path(tmp) / "conf" / "monitor_config.json").write_text(json.dumps({"dynamic_on": False}))
        env = {"DYNAMIC_MONITOR": "1", "MONITOR_OUTPUT_DIR": str(Path(tmp) / "out")}
        run_distributed(_agreement_rank, world, timeout=600, args=(n, tmp), env=env)
        rows = [json.loads(Path(tmp, f"r{r}.json").read_text()) for r in range(world)]
    return {"world": world, "boundary_us_rank0": rows[0]["boundary_us"],
            "boundary_us_max": max(r["boundary_us"] for r in rows),
            "gloo_barrier_us": rows[0]["barrier_us"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--block", type=int, default=4)
    ap.add_argument("--boundaries", type=int, default=2000)
    ap.add_argument("--skip-distributed", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    result = {"idle": idle_ratio(args.repeats, args.block), "boundary": boundary_overhead_us(20)}
    print(json.dumps(result["idle"]), flush=True)
    print(json.dumps(result["boundary"]), flush=True)
    if not args.skip_distributed:
        result["agreement"] = [agreement_cost(w, args.boundaries) for w in (2, 4)]
        for row in result["agreement"]:
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
