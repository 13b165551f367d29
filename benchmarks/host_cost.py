"""Host cost per recorded row: what the training thread pays for each row trainmon records.

    python benchmarks/host_cost.py                       # N = 64, 512, 4096; CPU path and seam
    python benchmarks/host_cost.py --n 512 --path cpu    # one size, one path
    python benchmarks/host_cost.py --json out.json       # the figures, machine-readable

The model is a chain of N/2 tiny ``nn.Linear(4, 4)`` layers (N parameter tensors), trained with
Adam on one thread, so the tensors are too small for their arithmetic to matter and what is left
is the per-tensor bookkeeping.  For each config (``wg``, ``all-on``, ``xy``, ``all-on+xy``; ops
``norm, mean, min, max, nans``, the shipped configs' list) two identical models are stepped in
turn, one monitored, and the difference is taken per step:

* **Python calls** on the training thread (``sys.setprofile``: Python function calls, and C
  function calls apart), exact;
* **aten ops** (``trainmon.testing.op_counter.OpCounter``: non-view ops), exact;
* **µs** of training-thread CPU time (``time.thread_time``), median of the paired steps, and
  **floor**: the fastest fifth of the monitored steps against the fastest fifth of the
  unmonitored ones (a loaded machine only ever adds time, so this moves least with the load); for
  ``xy``, also **beyond** torch's own cost of the same hooks: a third model carrying hooks of the
  activation collector's shape that do nothing (``_torch_hooks_only``) is stepped in turn;
* **writer µs**: the process's other threads' CPU time (the sink's writer thread) over all the
  paired steps and the flush after them, per step: the writer formats a step while the next runs,
  so it is not measured inside one step;
* **gen-0 GC collections** per step (``gc.callbacks``), monitored and unmonitored, over ``--steps``
  steps of each (the monitored ones flushed through the writer), exact for a given machine;

each divided by the rows the monitored step recorded (counted from the sink's own rows), weight
rows (``wg``/``all-on``) and activation rows (``xy``) apart.  ``--path seam`` sets
``TRAINMON_DEVICE_PATH=1``: CPU tensors take the accelerator path, the host work of a GPU run.
``--path triton`` takes the accelerator path's Triton route (what a CUDA GPU with ``triton`` runs)
with every kernel launch stubbed out: its host bookkeeping only (the rows' values are not computed
and the aten op column counts the monitor's own ops).  Needs ``triton``; not part of ``both``.
Counts are deterministic; times depend on the machine and its load (say which when quoting).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OPS = ["norm", "mean", "min", "max", "nans"]
ALL = {"wg_distribution": True, "mv_distribution": True, "param_distribution": True}
XY = {"xy_distribution": True, "all_xy": True}
CONFIGS = {"wg": {"wg_distribution": True}, "all-on": ALL, "xy": XY, "all-on+xy": {**ALL, **XY}}
ACTIVATION_FAMILIES = ("actv", "actv_grad")
HOOKED = ("xy",)  # configs timed against torch's own hooks too (activation rows only)


def _model(n_tensors: int, seed: int = 0):
    import torch
    import torch.nn as nn

    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(max(1, n_tensors // 2))])
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _torch_hooks_only(model) -> None:
    """The hooks an activation config asks of torch, doing nothing else: a forward pre-hook that
    returns an alias of each tensor input and hooks its grad, a forward hook that hooks each tensor
    output's grad (the shape of trainmon's activation hooks); what is left of a monitored step's
    cost beyond this model's is trainmon's own."""

    def grad(_g):
        return None

    def inputs(_module, args):
        out = []
        for a in args:
            if a.requires_grad:
                a = a[...]
                a.register_hook(grad)
            out.append(a)
        return tuple(out)

    def outputs(_module, _args, output):
        if output.requires_grad:
            output.register_hook(grad)

    for module in model.modules():
        module.register_forward_pre_hook(inputs)
        module.register_forward_hook(outputs)


def _step(model, optimizer, x) -> None:
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _rows_per_step(run_root: Path, steps: int) -> tuple[int, int]:
    """(weight rows, activation rows) per monitored step, counted in the files after close (counting
    on the training thread would build the rows there instead of on the writer thread)."""
    weight = activation = 0
    for path in run_root.rglob("*.csv"):
        family = re.sub(r"_\d+-\d+(\.\d+)?$", "", path.stem)
        lines = sum(1 for _ in path.open()) - 1
        if family in ACTIVATION_FAMILIES:
            activation += lines
        elif family not in ("steps", "loss"):
            weight += lines
    return weight // steps, activation // steps


def _python_calls(fn) -> tuple[int, int]:
    """(Python function calls, C function calls) of ``fn`` on this thread."""
    count = {"call": 0, "c_call": 0}

    def profile(_frame, event, _arg):
        if event in count:
            count[event] += 1

    sys.setprofile(profile)  # this thread only: the writer thread is measured apart
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count["call"], count["c_call"]


def _aten_ops(fn) -> int:
    from trainmon.testing.op_counter import OpCounter

    with OpCounter() as counter:
        fn()
    return counter.ops


def _timed(fn) -> tuple[float, float]:
    """(training-thread CPU s, other threads' CPU s) of one call."""
    t0, p0 = time.thread_time(), time.process_time()
    fn()
    t1, p1 = time.thread_time(), time.process_time()
    return t1 - t0, (p1 - p0) - (t1 - t0)


def _flush_writer(monitor) -> None:
    """Wait until the sink's writer thread has written every step handed to it."""
    monitor._driver.session.sink.flush()


def _repeat(fn, times: int):
    def run():
        for _ in range(times):
            fn()

    return run


def measure(n_tensors: int, config: str, steps: int, workdir: Path) -> dict:
    import torch

    from trainmon import TrainerMon
    from trainmon.testing.gc_counter import young_collections

    torch.set_num_threads(1)
    base_model, base_opt = _model(n_tensors)
    model, opt = _model(n_tensors)
    cfg_path = workdir / f"{config}.json"
    cfg_path.write_text(json.dumps({**CONFIGS[config], "ops": OPS, "step_count_per_record": 1000}))
    os.environ["MONITOR_OUTPUT_DIR"] = str(workdir / config)
    monitor = TrainerMon(cfg_path).set_monitor(model, optimizer=opt)
    x = torch.randn(8, 4)
    for _ in range(3):  # warm-up: kernels built, layouts cached, hooks seen once (5 + 2 * steps monitored in all)
        _step(base_model, base_opt, x)
        _step(model, opt, x)

    hooks_model, hooks_opt = _model(n_tensors)
    if config in HOOKED:
        _torch_hooks_only(hooks_model)
    for _ in range(3):
        _step(hooks_model, hooks_opt, x)

    def base():
        _step(base_model, base_opt, x)

    def hooks():
        _step(hooks_model, hooks_opt, x)

    def mon():
        _step(model, opt, x)

    (mon_py, mon_c), (base_py, base_c) = _python_calls(mon), _python_calls(base)
    ops = _aten_ops(mon) - _aten_ops(base)
    _flush_writer(monitor)
    gc_base = young_collections(_repeat(base, steps), collect_first=False) / steps
    gc_mon = young_collections(lambda: (_repeat(mon, steps)(), _flush_writer(monitor)), collect_first=False) / steps
    own, base_own, beyond, mon_own = [], [], [], []
    _flush_writer(monitor)
    t0, p0 = time.thread_time(), time.process_time()
    for _ in range(steps):
        b, _ = _timed(base)
        h, _ = _timed(hooks) if config in HOOKED else (b, 0.0)
        m, _ = _timed(mon)
        base_own.append(b)
        mon_own.append(m)
        own.append(m - b)
        beyond.append(m - h)
    _flush_writer(monitor)
    writer = ((time.process_time() - p0) - (time.thread_time() - t0)) / steps
    monitor.close()
    weight_rows, activation_rows = _rows_per_step(workdir / config, 5 + 2 * steps)
    total = weight_rows + activation_rows
    return {
        "n_tensors": n_tensors,
        "config": config,
        "weight_rows": weight_rows,
        "activation_rows": activation_rows,
        "python_calls_per_row": (mon_py - base_py) / total,
        "c_calls_per_row": (mon_c - base_c) / total,
        "aten_ops_per_row": ops / total,
        "us_per_row": statistics.median(own) / total * 1e6,
        # robust to a noisy machine: the fastest fifth of the monitored steps against the fastest
        # fifth of the unmonitored ones (interference only ever adds time)
        "us_per_row_floor": (_fastest(mon_own) - _fastest(base_own)) / total * 1e6,
        # activation configs: beyond torch's own cost of the same hooks (``_torch_hooks_only``)
        "us_per_row_beyond_hooks": statistics.median(beyond) / total * 1e6 if config in HOOKED else None,
        "writer_us_per_row": writer / total * 1e6,
        "gc_gen0_per_step": gc_mon,
        "gc_gen0_per_step_unmonitored": gc_base,
        "unmonitored_ms_per_step": statistics.median(base_own) * 1e3,
    }


def _fastest(times: list[float]) -> float:
    """Mean of the fastest fifth of ``times`` (at least one)."""
    fastest = sorted(times)[: max(1, len(times) // 5)]
    return sum(fastest) / len(fastest)


def _optional(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _stub_triton_launches() -> None:
    """The Triton route without running its kernels (``--path triton``): host bookkeeping only."""
    from trainmon.stats import device_triton

    device_triton._launch = lambda kernel, grid, *args, **meta: None


def _child(n_tensors: int, steps: int) -> None:
    if os.environ.get("TRAINMON_TRITON_INTERPRET") == "1":
        _stub_triton_launches()
    with tempfile.TemporaryDirectory() as tmp:
        results = [measure(n_tensors, config, steps, Path(tmp)) for config in CONFIGS]
    print(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, nargs="+", default=[64, 512, 4096], help="parameter tensors in the model")
    parser.add_argument("--path", choices=["cpu", "seam", "triton", "both"], default="both")
    parser.add_argument("--steps", type=int, default=9, help="paired timed steps per config")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        _child(args.child, args.steps)
        return
    paths = ["cpu", "seam"] if args.path == "both" else [args.path]
    results = []
    print(
        f"{'path':5s} {'N':>5s} {'config':10s} {'rows w/a':>11s} {'py/row':>7s} {'C/row':>6s} {'aten/row':>8s} "
        f"{'us/row':>7s} {'floor':>6s} {'beyond':>7s} {'writer':>7s} {'gc0 mon/base':>12s}"
    )
    for path in paths:
        for n in args.n:
            env = dict(os.environ, OMP_NUM_THREADS="1")
            for name in ("TRAINMON_DEVICE_PATH", "TRAINMON_TRITON_INTERPRET", "TRITON_INTERPRET", "TRAINMON_TRITON"):
                env.pop(name, None)
            if path in ("seam", "triton"):
                env["TRAINMON_DEVICE_PATH"] = "1"
            if path == "triton":
                env.update(TRAINMON_TRITON_INTERPRET="1", TRITON_INTERPRET="1")
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(n), "--steps", str(args.steps)],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            for r in json.loads(out.stdout.splitlines()[-1]):
                r["path"] = path
                results.append(r)
                print(
                    f"{path:5s} {n:5d} {r['config']:10s} {r['weight_rows']:5d}/{r['activation_rows']:<5d} "
                    f"{r['python_calls_per_row']:7.1f} {r['c_calls_per_row']:6.1f} {r['aten_ops_per_row']:8.2f} "
                    f"{r['us_per_row']:7.1f} {r['us_per_row_floor']:6.1f} "
                    f"{_optional(r['us_per_row_beyond_hooks']):>7s} "
                    f"{r['writer_us_per_row']:7.2f} "
                    f"{r['gc_gen0_per_step']:6.1f}/{r['gc_gen0_per_step_unmonitored']:<5.1f}",
                    flush=True,
                )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
