"""trainmon on third-party training code: nanoGPT's own ``train.py``, its CPU recipe, two lines added.

    python benchmarks/nanogpt.py --nanogpt PATH              # PATH: a checkout of karpathy/nanoGPT
    python benchmarks/nanogpt.py --nanogpt PATH --rounds 7 --iters 120

The checkout is copied to a temporary folder (it is never modified), and the copy gets:

* synthetic character data in ``data/shakespeare_char`` (``train.bin``, ``val.bin``, ``meta.pkl``:
  the layout ``data/shakespeare_char/prepare.py`` writes, without its download);
* trainmon's two lines right after the optimizer is created (where a user puts them)::

      monitor = TrainerMon(os.environ["TM_CFG"])
      monitor.set_monitor(model, grad_acc_steps=gradient_accumulation_steps, optimizer=optimizer)

  only when ``TM_CFG`` is set, so the unmonitored run is nanoGPT as it is.

Each round runs ``train.py`` once per config (none, the README's ``monitor_config.json``, and that
config with every module's activations: ``xy_distribution`` + ``all_xy``), one after the other, with
the CPU command of nanoGPT's README (``--device=cpu --compile=False ... --n_layer=4 --n_head=4
--n_embd=128 --block_size=64 --batch_size=12``), one thread.  A run's figure is the median of the
``time ...ms`` nanoGPT prints per iteration, leaving out the first ten; a config's ratio is the
median over rounds of its figure divided by the unmonitored run's of the same round.  Wall time:
the writer thread's work counts, as it does for a user.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
HOOK_AFTER = "checkpoint = None # free up memory\n"
TWO_LINES = """if os.environ.get("TM_CFG"):
    from trainmon import TrainerMon
    monitor = TrainerMon(os.environ["TM_CFG"])
    monitor.set_monitor(model, grad_acc_steps=gradient_accumulation_steps, optimizer=optimizer)
"""
CPU_RECIPE = [  # nanoGPT README's "on a MacBook / CPU" command, a short eval and a log every iteration
    "config/train_shakespeare_char.py",
    "--device=cpu",
    "--compile=False",
    "--eval_iters=2",
    "--eval_interval=1000000",
    "--log_interval=1",
    "--block_size=64",
    "--batch_size=12",
    "--n_layer=4",
    "--n_head=4",
    "--n_embd=128",
    "--lr_decay_iters=2000",
    "--dropout=0.0",
]
ITER = re.compile(r"^iter (\d+): .*time ([0-9.]+)ms")


def _prepare(source: Path, work: Path) -> Path:
    """A patched copy of the checkout with synthetic data; returns its folder."""
    repo = work / "nanoGPT"
    shutil.copytree(source, repo, ignore=shutil.ignore_patterns(".git", "out*", "*.bin"))
    train = repo / "train.py"
    text = train.read_text()
    if HOOK_AFTER not in text:
        sys.exit(f"{train}: the line {HOOK_AFTER.strip()!r} (where the two lines go) is not there")
    train.write_text(text.replace(HOOK_AFTER, HOOK_AFTER + TWO_LINES, 1))
    data = repo / "data" / "shakespeare_char"
    data.mkdir(parents=True, exist_ok=True)
    text = "First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. " * 4000
    chars = sorted(set(text))
    ids = np.array([chars.index(c) for c in text], dtype=np.uint16)
    cut = len(ids) * 9 // 10
    ids[:cut].tofile(data / "train.bin")
    ids[cut:].tofile(data / "val.bin")
    meta = {"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": {c: i for i, c in enumerate(chars)}}
    with open(data / "meta.pkl", "wb") as f:
        pickle.dump(meta, f)
    return repo


def _configs(work: Path) -> dict[str, Path | None]:
    readme = json.loads((ROOT / "monitor_config.json").read_text())
    paths: dict[str, Path | None] = {"none": None}
    for name, cfg in (("readme", readme), ("readme+xy", {**readme, "xy_distribution": True, "all_xy": True})):
        paths[name] = work / f"{name}.json"
        paths[name].write_text(json.dumps(cfg))  # type: ignore[union-attr]
    return paths


def _run(repo: Path, config: Path | None, iters: int, out: Path) -> float:
    """Median ms per iteration of one ``train.py`` run (the first ten left out)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MONITOR_OUTPUT_DIR": str(out)}
    env.pop("TM_CFG", None)
    if config is not None:
        env["TM_CFG"] = str(config)
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "train.py", *CPU_RECIPE, f"--max_iters={iters}", f"--out_dir={out}-ckpt"]
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"train.py failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    times = [float(m.group(2)) for line in proc.stdout.splitlines() if (m := ITER.match(line))]
    return statistics.median(times[10:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nanogpt", type=Path, required=True, help="a checkout of karpathy/nanoGPT")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=80, help="iterations per run (the first ten are left out)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        repo = _prepare(args.nanogpt, work)
        configs = _configs(work)
        ms: dict[str, list[float]] = {name: [] for name in configs}
        for r in range(args.rounds):
            for name, path in configs.items():
                ms[name].append(_run(repo, path, args.iters, work / f"out-{name}"))
            print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1]:.1f} ms" for n, v in ms.items()), flush=True)
    base = ms["none"]
    print(f"\nunmonitored: median {statistics.median(base):.1f} ms/iter")
    for name in list(configs)[1:]:
        ratios = [a / b for a, b in zip(ms[name], base)]
        print(f"{name:10s} {statistics.median(ratios):.3f}x  (rounds: {', '.join(f'{x:.3f}' for x in ratios)})")


if __name__ == "__main__":
    main()
