"""Cost of grad_probe (L0/L1/L2) and loss_alignment: step-time ratio against the same training
without a monitor, aten ops per probed param, and the bytes L2 writes per param and step.

    python benchmarks/grad_probe.py                # every config, 30 steps each
    python benchmarks/grad_probe.py --steps 60 --only L2

A TinyGPT (dim 256, 4 layers) trained with AdamW on the CPU, one thread.  Two identical models
train side by side, one monitored, alternating step by step (a shared machine's drifts hit both
alike); the figure is the median of the per-step ratios monitored / unmonitored.
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

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainmon import TrainerMon  # noqa: E402
from trainmon.collectors.grad_probe import direction_positions, direction_words, interval_counts  # noqa: E402
from trainmon.testing.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches  # noqa: E402

MODEL = GPTConfig(vocab=512, seq=64, dim=256, heads=4, layers=4)
BOUNDS = [-10, -1, -0.1, -0.01, -0.001, 0, 0.001, 0.01, 0.1, 1, 10]   # msprobe's example bounds
CONFIGS = {
    "wg (reference)": {"wg_distribution": True},
    "L0": {"grad_probe": {"grad_level": "L0", "bounds": BOUNDS}},
    "L1": {"grad_probe": {"grad_level": "L1", "bounds": BOUNDS}},
    "L2": {"grad_probe": {"grad_level": "L2", "bounds": BOUNDS}},
    "loss_alignment+record_loss": {"loss_alignment": True},
}


def build(seed: int = 0):
    torch.manual_seed(seed)
    model = TinyGPT(MODEL)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def step(model, opt, batch, monitor=None) -> float:
    t0 = time.perf_counter()
    loss = model.loss(batch)
    if monitor is not None:
        monitor.record_loss(loss)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def ratio(cfg: dict, steps: int, workdir: Path) -> float:
    os.environ["MONITOR_OUTPUT_DIR"] = str(workdir / "out")
    plain, plain_opt = build()
    mon_model, mon_opt = build()
    path = workdir / "cfg.json"
    path.write_text(json.dumps(cfg))
    monitor = TrainerMon(path).set_monitor(mon_model, optimizer=mon_opt)
    data = synthetic_batches(MODEL, 8, steps + 5, seed=1)
    ratios = []
    for i in range(steps + 5):
        batch = next(data)
        a = step(plain, plain_opt, batch)
        b = step(mon_model, mon_opt, batch, monitor)
        if i >= 5:                       # warm-up: first files, kernel build
            ratios.append(b / a)
    monitor.close()
    return statistics.median(ratios)


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def op_counts() -> dict[str, float]:
    model, _ = build()
    model.loss(next(synthetic_batches(MODEL, 8, 1, seed=1))).backward()
    grads = [(n, p.grad) for n, p in model.named_parameters()]
    positions = {n: torch.from_numpy(direction_positions(n, tuple(g.shape))) for n, g in grads}
    with _Count() as c1:
        for _, g in grads:
            interval_counts(g, BOUNDS)
    with _Count() as c2:
        for n, g in grads:
            direction_words(g, positions[n])
    t0 = time.perf_counter()
    for _ in range(5):
        for _, g in grads:
            interval_counts(g, BOUNDS)
    t1 = time.perf_counter()
    for _ in range(5):
        for n, g in grads:
            direction_words(g, positions[n])
    t2 = time.perf_counter()
    numel = sum(g.numel() for _, g in grads)
    return {"params": len(grads), "elements": numel,
            "L1 aten ops per param": c1.n / len(grads), "L2 aten ops per param": c2.n / len(grads),
            "L1 ms per step (all grads)": (t1 - t0) / 5 * 1e3, "L2 ms per step (all grads)": (t2 - t1) / 5 * 1e3}


def l2_bytes(workdir: Path) -> float:
    files = list((workdir / "out").rglob("grad_direction_*.csv"))
    rows = sum(len(f.read_text().splitlines()) - 1 for f in files)
    size = sum(len("".join(f.read_text().splitlines(True)[1:])) for f in files)
    return size / max(rows, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--only", default=None, help="one config name")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(json.dumps(op_counts(), indent=1))
    for name, cfg in CONFIGS.items():
        if args.only and name != args.only:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            r = ratio(cfg, args.steps, Path(tmp))
            extra = f", {l2_bytes(Path(tmp)):.0f} bytes per L2 row" if name == "L2" else ""
            print(f"{name:28s} step time x{r:.3f} vs unmonitored{extra}")


if __name__ == "__main__":
    main()
