"""Step-time cost of monitoring: ratio against the same training run without a monitor.

    python benchmarks/overhead.py                 # trainmon configs (and msprobe's if importable)
    python benchmarks/overhead.py --memory        # peak RSS per config, on a bigger model
    python benchmarks/overhead.py --only all-on+xy --repeats 20   # one config, more rounds
    python benchmarks/overhead.py --format parquet  # the Parquet sink instead of the CSV sink
    python benchmarks/overhead.py --only all-on --format csv tensorboard csv,wandb csv,mlflow
                                  # several outputs, each against no monitor and against csv
    python benchmarks/overhead.py --eager         # without the fused CPU kernel
                                                  # (same as TRAINMON_FUSED_CPU=0)
    python benchmarks/overhead.py --read-floor    # beside each config: its reads alone, no monitor

A small GPT-like model (trainmon.testing.tiny_gpt.TinyGPT) trained with AdamW on the CPU, one thread.
Each config trains two identical models side by side, one monitored, alternating step by step
(so a shared machine's drifts hit both alike); the figure is the median of the per-step ratios
monitored / unmonitored over all rounds.
With several ``--format`` sets (each a comma-joined list of outputs, e.g. ``csv,wandb``) every config
runs once per set in each round, and each set's ratio is also given against the ``csv`` set's; the
runs then alternate in blocks of ``--steps`` steps, so that the work of the writer and tracker
threads during the monitored block (GIL time, CPU) is charged to it (``paired_ratio``).
W&B runs offline (``WANDB_MODE=offline``) and MLflow into a SQLite store, both in a temporary
folder, unless the environment says otherwise; timing starts once a tracker's worker has started
its run (the ``import`` and run start happen once per run, not per step).
``--read-floor`` adds, for each config, what no monitor of these statistics can go below on this
machine: a third model, unmonitored, whose plain torch hooks pass the tensors the config records
to the fused kernel, each read once where the monitor reads it (activations and their grads in
their hooks, while they are in cache; grads after backward and again before the step, as
``grad_unreduced``/``grad_reduced``; params before and after the step; the Adam moments after it),
with no rows, no names and no output.  Its ratio is the cost of the reads; the monitor's ratio
minus it is the monitor's own bookkeeping.
When ``mindstudio-probe`` is importable (``PYTHONPATH=<dir with msprobe>``) the same kinds are
also measured with msprobe's ``TrainerMon`` in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainmon.testing.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches

OPS = ["norm", "mean", "min", "max", "nans"]  # the shipped configs' list (README, monitor_config.json)
ALL = {"wg_distribution": True, "mv_distribution": True, "param_distribution": True}
XY = {"xy_distribution": True, "all_xy": True}
CONFIGS = {
    "wg": {"wg_distribution": True},
    "mv": {"mv_distribution": True},
    "param": {"param_distribution": True},
    "xy": XY,
    "all-on": ALL,
    "all-on+xy": {**ALL, **XY},
    "all-on+xy+ur": {**ALL, **XY, "ur_distribution": True},
    # only the steps step_interval does NOT select are timed for this one
    "all-on+xy, unselected steps": {**ALL, **XY, "step_interval": 10},
}
MSPROBE_CONFIGS = ("wg", "mv", "param", "xy", "all-on", "all-on+xy")
MODEL = GPTConfig(vocab=512, seq=64, dim=256, heads=4, layers=4)


def build(model_cfg: GPTConfig, seed: int = 0):
    torch.manual_seed(seed)
    model = TinyGPT(model_cfg)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def attach(kind: str, cfg: dict | None, model, optimizer, workdir: Path, fmt: str | None = None):
    if cfg is None:
        return None
    if kind == "floor":
        return ReadFloor(cfg, model, optimizer)
    path = workdir / f"{kind}_{abs(hash(json.dumps(cfg, sort_keys=True)))}.json"
    if kind == "trainmon":
        from trainmon import TrainerMon

        path.write_text(
            json.dumps(
                {
                    **cfg,
                    "ops": OPS,
                    "step_count_per_record": 1000,
                    "format": (fmt or os.environ.get("TRAINMON_BENCH_FORMAT", "csv")).split(","),
                }
            )
        )
        return TrainerMon(path).set_monitor(model, optimizer=optimizer)
    from msprobe.pytorch import TrainerMon as MsTrainerMon

    path.write_text(json.dumps({**cfg, "targets": {}, "ops": OPS, "format": "csv"}))
    mon = MsTrainerMon(str(path), params_have_main_grad=False)
    mon.set_monitor(model, optimizer=optimizer, grad_acc_steps=1)
    return mon


def paired_ratio(
    kind: str, cfg: dict, steps: int, warmup: int, workdir: Path, fmt: str | None = None, blocks: bool = False
) -> list[tuple[float, float]]:
    """(unmonitored, monitored) step times, the two runs alternating step by step, so slow drifts
    of a shared machine hit both alike.  ``blocks``: one pair, the mean step of ``steps`` steps
    of each run in turn, the monitored block ending once its writer thread is idle (training waits
    for it when it falls behind).  The work of the writer and tracker threads during the block is
    charged to the monitored run (step by step, it would land in whichever run's step it overlaps);
    a tracker's backlog after it is not (training never waits for a tracker: a tracker that cannot
    keep up skips steps, with a warning)."""
    base_model, base_opt = build(MODEL)
    model, optimizer = build(MODEL)
    monitor = attach(kind, cfg, model, optimizer, workdir, fmt)
    interval = cfg.get("step_interval", 1)
    pairs = []
    batches = list(synthetic_batches(MODEL, 8, steps + warmup, seed=1))
    if blocks:
        for batch in batches[:warmup]:
            _one_step(base_model, base_opt, batch)
            _one_step(model, optimizer, batch)
        _wait_for_trackers(monitor)
        t0 = time.perf_counter()
        for batch in batches[warmup:]:
            _one_step(base_model, base_opt, batch)
        t1 = time.perf_counter()
        for batch in batches[warmup:]:
            _one_step(model, optimizer, batch)
        _flush_writer(monitor)  # training waits for its writer thread when it falls behind
        t2 = time.perf_counter()
        monitor.close()
        return [((t1 - t0) / steps, (t2 - t1) / steps)]
    for i, batch in enumerate(batches):
        if i == warmup and kind == "trainmon":
            _wait_for_trackers(monitor)
        t_base = _one_step(base_model, base_opt, batch)
        t_mon = _one_step(model, optimizer, batch)
        if i >= warmup and (interval == 1 or i % interval != 0):
            pairs.append((t_base, t_mon))
    if monitor is not None and hasattr(monitor, "close"):
        monitor.close()
    return pairs


class ReadFloor:
    """The reads a config asks for, alone (``--read-floor``): plain hooks and the fused kernel, no
    monitor.  A tensor seen twice while it lives (a module's output, the next module's input) is
    read once, as the monitor's batches do; the weights' families are read as often as the monitor
    reads them."""

    def __init__(self, cfg: dict, model, optimizer):
        from trainmon.stats import _fused_cpu
        from trainmon.stats.partials import device_columns, fused_columns
        from trainmon.stats.table import partials_for

        cols = fused_columns(device_columns(partials_for(OPS)))
        if cols is None:
            raise SystemExit("--read-floor needs the fused CPU kernel (it is off or could not be built)")
        self._fill, self._cols, self._pairs = _fused_cpu.fill_rows, cols, _fused_cpu.pair_sumsq
        self._out = torch.empty((4096, len(cols)), dtype=torch.float64)
        self._seen: dict[tuple, tuple] = {}  # the elements read -> (a tensor holding them, its version)
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._optimizer = optimizer
        self._snapshots = [torch.empty_like(p) for p in self._params] if cfg.get("ur_distribution") else None
        if cfg.get("xy_distribution"):
            for module in model.modules():
                module.register_forward_pre_hook(self._inputs)
                module.register_forward_hook(self._outputs)
        optimizer.register_step_pre_hook(lambda *_: self._before_step(cfg))
        optimizer.register_step_post_hook(lambda *_: self._after_step(cfg))

    def read(self, tensors: list) -> None:
        fresh = []
        for t in tensors:
            key = (t.data_ptr(), t.dtype, t.numel())
            held = self._seen.get(key)
            # Same elements while the tensor lives (it keeps its memory) and has not changed in
            # place since (a grad accumulated into, an activation rewritten): the same values.
            if held is None or held[0]() is None or held[1] != t._version:
                self._seen[key] = (weakref.ref(t), t._version)
                fresh.append(t.detach())
        for i in range(0, len(fresh), len(self._out)):
            self._fill(fresh[i : i + len(self._out)], self._out, 0, self._cols)

    def _grad(self, grad) -> None:
        self.read([grad])

    def _inputs(self, _module, args):
        out = []
        for a in args:
            if isinstance(a, torch.Tensor) and a.is_floating_point():
                self.read([a])
                if a.requires_grad:
                    a = a[...]
                    a.register_hook(self._grad)
            out.append(a)
        return tuple(out)

    def _outputs(self, _module, _args, output) -> None:
        if isinstance(output, torch.Tensor) and output.is_floating_point():
            self.read([output])
            if output.requires_grad:
                output.register_hook(self._grad)

    def _before_step(self, cfg: dict) -> None:
        self._seen.clear()  # a new pass: the backward's grads were read in their hooks
        grads = [p.grad for p in self._params if p.grad is not None]
        if cfg.get("wg_distribution"):
            self.read(grads)  # grad_unreduced (at backward's end)
            self._seen.clear()
            self.read(grads)  # grad_reduced (before the step)
        if cfg.get("param_distribution"):
            self.read(self._params)  # param_origin
        if self._snapshots is not None:
            torch._foreach_copy_(self._snapshots, [p.detach() for p in self._params])  # update_ratio's
        self._seen.clear()

    def _after_step(self, cfg: dict) -> None:
        if cfg.get("param_distribution"):
            self.read(self._params)  # param_updated
        if cfg.get("mv_distribution"):
            state = self._optimizer.state
            self.read([state[p][k] for p in self._params if p in state for k in ("exp_avg", "exp_avg_sq")])
        if self._snapshots is not None:
            self._pairs(self._snapshots, [p.detach() for p in self._params])
        self._seen.clear()


def _sinks(sink) -> list:
    """``sink`` and every sink it wraps (writer thread, fan-out, family filter, ring)."""
    inner = [getattr(sink, "inner", None), *getattr(sink, "sinks", ())]
    return [sink, *[s for i in inner if i is not None for s in _sinks(i)]]


def _session(monitor):
    return monitor._driver.session if monitor is not None and getattr(monitor, "_driver", None) else None


def _flush_writer(monitor) -> None:
    session = _session(monitor)
    if session is not None:
        session.sink.flush()


def _wait_for_trackers(monitor, timeout: float = 120.0) -> None:
    """Let the W&B/MLflow workers import their package and start their run before timing: that
    happens once per run, not per step."""
    from trainmon.sinks.metrics import MetricSink

    session = _session(monitor)
    if session is None:
        return
    session.sink.flush()  # the writer thread has handed every step so far to the trackers
    for sink in _sinks(session.sink):
        if isinstance(sink, MetricSink):
            sink.wait_idle(timeout)


def _one_step(model, optimizer, batch) -> float:
    t0 = time.perf_counter()
    model.loss(batch).backward()
    optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - t0


def msprobe_available() -> bool:
    try:
        import msprobe.pytorch  # noqa: F401

        return True
    except Exception:
        return False


def _tracker_environment(tmp: Path) -> None:
    """W&B offline and MLflow into a SQLite file, both under ``tmp``, unless already set."""
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_DIR", str(tmp))
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{tmp / 'mlflow.db'}")


def run_timing(
    repeats: int,
    steps: int,
    warmup: int,
    only: str | None = None,
    formats: list[str] | None = None,
    threads: int = 1,
    read_floor: bool = False,
) -> dict[str, float]:
    torch.set_num_threads(threads)
    formats = formats or [os.environ.get("TRAINMON_BENCH_FORMAT", "csv")]
    several = len(formats) > 1
    runs: list[tuple[str, str, dict, str | None]] = [
        (f"trainmon {n}" + (f" [{fmt}]" if several else ""), "trainmon", c, fmt)
        for n, c in CONFIGS.items()
        for fmt in formats
    ]
    if read_floor:  # not for a config timed on steps it does not record
        runs += [(f"floor {n}", "floor", c, None) for n, c in CONFIGS.items() if "step_interval" not in c]
    if msprobe_available():
        runs += [(f"msprobe {n}", "msprobe", CONFIGS[n], None) for n in MSPROBE_CONFIGS]
    if only:
        runs = [r for r in runs if r[0].split(" ", 1)[1].split(" [")[0] == only]
        if not runs:
            raise SystemExit(f"--only: no config named {only!r}; configs: {', '.join(CONFIGS)}")
    pairs: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _, _ in runs}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MONITOR_OUTPUT_DIR"] = str(Path(tmp) / "out")
        _tracker_environment(Path(tmp))
        for _ in range(repeats):
            for name, kind, cfg, fmt in runs:
                pairs[name] += paired_ratio(kind, cfg, steps, warmup, Path(tmp), fmt, blocks=several)
    model = build(MODEL)[0]
    base = statistics.median(b for p in pairs.values() for b, _ in p)
    print(
        f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
        f"{len(list(model.parameters()))} tensors; unmonitored {base * 1e3:.1f} ms/step; "
        f"{repeats} rounds x {steps} paired steps; torch {torch.__version__}, "
        f"{threads} thread{'s' if threads > 1 else ''}"
    )
    ratios = {}
    for name, p in pairs.items():
        ratios[name] = statistics.median(m / b for b, m in p)
        print(f"  {name:34s} {statistics.median(m for _, m in p) * 1e3:8.1f} ms/step   {ratios[name]:.3f}x")
    if several and "csv" in formats:
        _print_against_csv(ratios, [f for f in formats if f != "csv"])
    return ratios


def _print_against_csv(ratios: dict[str, float], formats: list[str]) -> None:
    """Each format set's overhead minus the CSV sink's, config by config (the #32 target: <= 0.01x)."""
    print("against the csv set (ratio difference, same config):")
    for name, ratio in ratios.items():
        config, _, fmt = name.partition(" [")
        fmt = fmt.rstrip("]")
        if fmt in formats and f"{config} [csv]" in ratios:
            print(f"  {name:34s} {ratio - ratios[f'{config} [csv]']:+.3f}x")


# -- peak memory: one subprocess per config, ru_maxrss -------------------------------------------
MEM_MODEL = GPTConfig(vocab=8192, seq=64, dim=768, heads=12, layers=6)


def _memory_child(cfg_json: str) -> None:
    torch.set_num_threads(1)
    cfg = json.loads(cfg_json)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MONITOR_OUTPUT_DIR"] = str(Path(tmp) / "out")
        model, optimizer = build(MEM_MODEL)
        monitor = attach("trainmon", cfg, model, optimizer, Path(tmp)) if cfg else None
        for batch in synthetic_batches(MEM_MODEL, 4, 4, seed=1):
            model.loss(batch).backward()
            optimizer.step()
            optimizer.zero_grad()
        if monitor:
            monitor.close()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def run_memory() -> None:
    results = {}
    for name, cfg in [
        ("baseline", None),
        ("all-on", ALL),
        ("all-on+xy", {**ALL, **XY}),
        ("all-on+ur", {**ALL, "ur_distribution": True}),
    ]:
        out = subprocess.run(
            [sys.executable, __file__, "--memory-child", json.dumps(cfg)], capture_output=True, text=True, check=True
        )
        results[name] = int(out.stdout.split()[-1])
    n = sum(p.numel() for p in build(MEM_MODEL)[0].parameters())
    print(f"peak RSS, {n / 1e6:.1f}M-param model ({n * 4 / 2**20:.0f} MiB of fp32 params):")
    for name, kb in results.items():
        print(f"  {name:12s} {kb / 1024:8.0f} MiB   {kb / results['baseline']:.3f}x")


def _report_fused() -> None:
    from trainmon.stats import _fused_cpu

    # Builds the kernel (first use, ~0.3 s) here, outside the timed steps.
    print(f"fused CPU kernel: {'on' if _fused_cpu.enabled() else 'off'}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--memory", action="store_true", help="measure peak RSS instead of step time")
    parser.add_argument("--only", metavar="CONFIG", help="time one config, e.g. 'all-on+xy' (more rounds fit)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch's CPU threads for both runs (default 1, the figures quoted in docs/performance.md; "
        "the fused kernel reads with as many)",
    )
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    parser.add_argument(
        "--format",
        nargs="+",
        default=["csv"],
        metavar="FORMATS",
        help="output format set(s), each comma-joined: csv, parquet, csv,wandb, ...; "
        "several sets are timed side by side and compared with csv",
    )
    parser.add_argument(
        "--read-floor",
        action="store_true",
        help="also time each config's reads alone (plain hooks and the fused kernel, no monitor): "
        "what no monitor of these statistics can go below here",
    )
    parser.add_argument(
        "--eager", action="store_true", help="without the fused one-pass CPU stats kernel (sets TRAINMON_FUSED_CPU=0)"
    )
    args = parser.parse_args()
    os.environ["TRAINMON_BENCH_FORMAT"] = args.format[0]  # inherited by --memory children too
    if args.eager:
        os.environ["TRAINMON_FUSED_CPU"] = "0"  # inherited by --memory children too
    _report_fused()
    if args.memory_child is not None:
        _memory_child(args.memory_child)
    elif args.memory:
        run_memory()
    else:
        run_timing(args.repeats, args.steps, args.warmup, args.only, args.format, args.threads, args.read_floor)


if __name__ == "__main__":
    main()
