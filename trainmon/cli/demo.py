"""``trainmon demo``: train a tiny GPT on synthetic data on the CPU with monitoring on."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

HELP = "train a tiny GPT on synthetic data with monitoring on and show where the output went"
OWN_LOGGING = True  # it logs the monitor's INFO lines itself (logging.basicConfig below)

DEMO_CONFIG = {
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
    "ur_distribution": True,
    "xy_distribution": True,
    "all_xy": True,
    "ops": ["norm", "mean", "min", "max", "std", "nans", "infs", "zeros"],
    "alert": {"rules": [{"rule_name": "AnomalyNan"}, {"rule_name": "AnomalyTurbulence"}]},
    "step_count_per_record": 10,
    "format": "csv",
}


def add_arguments(parser) -> None:
    parser.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    parser.add_argument("--grad-acc-steps", type=int, default=2, help="micro-batches per step (default 2)")
    parser.add_argument("--config", type=Path, help="monitor config JSON (default: a built-in one, all kinds on)")
    parser.add_argument(
        "--output", type=Path, default=None, help="output root (default: $MONITOR_OUTPUT_DIR or ./monitor_output)"
    )


def run(args) -> int:
    from trainmon.cli import CommandError

    if args.steps < 1 or args.grad_acc_steps < 1:
        raise CommandError("--steps and --grad-acc-steps must be >= 1")
    if args.config is not None and not args.config.is_file():
        raise CommandError(f"config file not found: {args.config}")
    if args.output is not None:
        os.environ["MONITOR_OUTPUT_DIR"] = str(args.output)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return _train(args)


def _train(args) -> int:
    import torch

    from trainmon import TrainerMon, seed_all
    from trainmon.runtime.run_dir import output_root
    from trainmon.testing.tiny_gpt import TinyGPT, train

    config_path = args.config
    if config_path is None:
        output_root().mkdir(parents=True, exist_ok=True)
        config_path = output_root() / "demo_config.json"
        config_path.write_text(json.dumps(DEMO_CONFIG, indent=2) + "\n")
    torch.set_num_threads(min(2, torch.get_num_threads()))
    seed_all(1234)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with TrainerMon(config_path) as monitor:
        monitor.set_monitor(model, grad_acc_steps=args.grad_acc_steps, optimizer=optimizer)
        losses = train(model, optimizer, args.steps, args.grad_acc_steps, record_loss=monitor.record_loss)
    print(f"trained {args.steps} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    if monitor.run_dir is None:
        print("nothing was recorded (output directory not writable)")
        return 1
    files = sorted(p.relative_to(monitor.run_dir) for p in monitor.run_dir.rglob("*.csv"))
    print(f"monitor output: {monitor.run_dir.resolve()} ({len(files)} CSV files)")
    for f in files[:12]:
        print(f"  {f}")
    if len(files) > 12:
        print(f"  ... and {len(files) - 12} more")
    print(
        f"next: trainmon anomalies {monitor.run_dir} | trainmon csv2tb {monitor.run_dir} | "
        f"trainmon plot {monitor.run_dir} --kind grad_reduced --op norm"
    )
    return 0
