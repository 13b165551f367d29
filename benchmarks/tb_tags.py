"""TensorBoard at scale: tags, tag-listing time on a real server, and event file size vs the CSV.

    python benchmarks/tb_tags.py server [--params 400] [--steps 20]   # tag listing, both layouts
    python benchmarks/tb_tags.py size [--params 400] [--steps 20]     # event bytes vs CSV bytes
    python benchmarks/tb_tags.py demo [--steps 30]                     # the demo's model, real training

``server`` writes an N-parameter run (grad_unreduced, grad_reduced, param_origin, param_updated,
exp_avg, exp_avg_sq with 4 ops, update_ratio) with the real sinks in each tag layout, starts
``tensorboard --logdir`` (its default data server) on it, waits until every tag is loaded and
times ``/data/plugin/scalars/tags`` (what the Scalars dashboard asks first), 3 times.

``size`` compares the event file of each layout with the CSV family files of the same rows.
``demo`` trains the demo's TinyGPT under ``TrainerMon`` with the demo config and
``format: [csv, tensorboard]`` and compares the native event file with the CSV.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.sinks.test_tensorboard_server import Server, scalar_tag_count, write_run
from trainmon.output.tb_tags import TensorBoardSettings

LAYOUTS = {"summary": TensorBoardSettings(), "per_tensor": TensorBoardSettings(tags="per_tensor")}


def _bytes(paths) -> int:
    return sum(p.stat().st_size for p in paths)


def _csv_bytes(rank_dir: Path) -> int:
    return _bytes(rank_dir.glob("*_*-*.csv"))


def _event_bytes(event_dir: Path) -> int:
    return _bytes(p for p in event_dir.iterdir() if "tfevents" in p.name)


def server(params: int, steps: int) -> None:
    for layout, settings in LAYOUTS.items():
        with tempfile.TemporaryDirectory() as d:
            run = Path(d) / "logdir" / f"run{params}"
            write_run(run, params, steps, settings, with_csv=False)
            n_tags = scalar_tag_count(run / "tensorboard" / "rank0")
            for loader in ("auto", "false"):  # the Rust data server (default), the Python one
                with Server(Path(d) / "logdir", f"--load_fast={loader}") as tb:
                    loaded = tb.wait_for_tags(f"{run.name}/tensorboard/rank0", n_tags, timeout=600)
                    seconds = tb.time_tag_list()
                print(
                    f"{layout:>10}, --load_fast={loader:5}: {n_tags:6,} scalar tags; all listed {loaded:.1f} s after "
                    f"start; tag list request {', '.join(f'{s:.3f}' for s in seconds)} s "
                    f"(median {statistics.median(seconds):.3f} s)"
                )


def size(params: int, steps: int) -> None:
    for layout, settings in LAYOUTS.items():
        with tempfile.TemporaryDirectory() as d:
            run = Path(d) / "run"
            write_run(run, params, steps, settings)
            csv, events = _csv_bytes(run / "rank0"), _event_bytes(run / "tensorboard" / "rank0")
            print(
                f"{layout:>10}: {params} params x {steps} steps: CSV {csv / 1e6:.2f} MB, events "
                f"{events / 1e6:.2f} MB ({events / csv:.2f}x the CSV)"
            )


def demo(steps: int) -> None:
    import torch

    from trainmon import TrainerMon, seed_all
    from trainmon.cli.demo import DEMO_CONFIG
    from trainmon.testing.tiny_gpt import TinyGPT, train

    with tempfile.TemporaryDirectory() as d:
        os.environ["MONITOR_OUTPUT_DIR"] = str(Path(d) / "out")
        config = Path(d) / "config.json"
        config.write_text(json.dumps({**DEMO_CONFIG, "format": ["csv", "tensorboard"], "alert": {}}))
        seed_all(0)
        model = TinyGPT()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with TrainerMon(config) as monitor:
            monitor.set_monitor(model, grad_acc_steps=2, optimizer=optimizer)
            train(model, optimizer, steps=steps, grad_acc_steps=2)
        run = monitor.run_dir
        csv, events = _csv_bytes(run / "rank0"), _event_bytes(run / "tensorboard" / "rank0")
        n_tags = scalar_tag_count(run / "tensorboard" / "rank0")
        n_params = sum(1 for _ in model.parameters())
        print(
            f"demo ({n_params} params, {steps} steps, summary layout): {n_tags} scalar tags; CSV {csv / 1e6:.2f} MB, "
            f"events {events / 1e6:.2f} MB ({events / csv:.2f}x the CSV)"
        )
        from trainmon.cli.csv2tb import convert_rank

        target = Path(d) / "per_tensor"
        convert_rank(run / "rank0", target, settings=LAYOUTS["per_tensor"])
        per_tensor = _event_bytes(target)
        print(
            f"demo, per_tensor layout (csv2tb): {scalar_tag_count(target):,} scalar tags; events "
            f"{per_tensor / 1e6:.2f} MB ({per_tensor / csv:.2f}x the CSV)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("server", "size", "demo"))
    parser.add_argument("--params", type=int, default=400)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if args.what == "server":
        server(args.params, args.steps)
    elif args.what == "size":
        size(args.params, args.steps)
    else:
        demo(args.steps)


if __name__ == "__main__":
    main()
