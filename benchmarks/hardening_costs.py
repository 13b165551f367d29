"""What the hardening of issue 12 costs (docs/hardening.md quotes these figures).

1. CSV sink: one step's ``write()`` (4 families x 200 rows, files open) with the per-append
   ``fstat`` that notices a deleted output folder, against the same sink with that check off.
   Interleaved blocks, medians of per-step times.
2. Kernel cache: loading the cached, verified library (open, fstat, sha256, dlopen) in a fresh
   state, microseconds per load (once per process).
3. Dynamic watcher: one background check (re-resolve the config path, compare what it reads),
   microseconds; it runs once per ``TRAINMON_WATCH_INTERVAL`` (1 s) on the watcher thread.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/hardening_costs.py [--steps 300]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainmon.sinks import SinkOptions  # noqa: E402
from trainmon.sinks.csv import CsvSink  # noqa: E402
from trainmon.stats.rows import StatRow, StepRows  # noqa: E402


def _rows(step: int) -> StepRows:
    return StepRows.of([StatRow(f, f"layer.{i}.weight", step, {"norm": step + i / 3, "mean": 0.5 * i}, (i + 1, 3),
                                "torch.float32") for f in ("a", "b", "c", "d") for i in range(200)])


def csv_check_ratio(steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        checked = CsvSink(SinkOptions(rank_dir=Path(tmp) / "on", step_count_per_record=100_000))
        unchecked = CsvSink(SinkOptions(rank_dir=Path(tmp) / "off", step_count_per_record=100_000))
        unchecked._unlinked = lambda path, fd: False  # type: ignore[method-assign]
        rows = [_rows(s) for s in range(steps)]
        times: dict[str, list[float]] = {"on": [], "off": []}
        for s, r in enumerate(rows):
            order = (("on", checked), ("off", unchecked)) if s % 2 else (("off", unchecked), ("on", checked))
            for name, sink in order:
                t = time.perf_counter()
                sink.write(r, s)
                times[name].append(time.perf_counter() - t)
        checked.close()
        unchecked.close()
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    return {"write_us_with_check": on * 1e6, "write_us_without": off * 1e6, "ratio": on / off}


def kernel_load_us(repeats: int = 20) -> dict:
    from trainmon.stats import _fused_cpu, _kernel_cache

    if not _fused_cpu.enabled():
        return {"skipped": "no C compiler"}
    path = _kernel_cache.cache_dir() / _fused_cpu._library_name()
    t = time.perf_counter()
    for _ in range(repeats):
        assert _kernel_cache._load_verified(path) is not None
    return {"verified_load_us": (time.perf_counter() - t) / repeats * 1e6, "library_bytes": path.stat().st_size}


def watcher_check_us(repeats: int = 2000) -> dict:
    from trainmon.config import load_config
    from trainmon.dynamic import ConfigStager, ConfigWatcher, WatchSettings

    with tempfile.TemporaryDirectory() as tmp:
        mount = Path(tmp) / "etc" / "config"
        (mount / "..2026_01").mkdir(parents=True)
        (mount / "..2026_01" / "config.json").write_text('{"dynamic_on": false}')
        (mount / "..data").symlink_to("..2026_01")
        (mount / "config.json").symlink_to("..data/config.json")
        stager = ConfigStager(mount / "config.json", load_config)
        watcher = ConfigWatcher(stager, WatchSettings(polling=True, interval_s=3600)).start()
        try:
            t = time.perf_counter()
            for _ in range(repeats):
                watcher._check()
            per = (time.perf_counter() - t) / repeats
        finally:
            watcher.stop()
    return {"check_us_configmap_layout": per * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    print(json.dumps({"csv_sink": csv_check_ratio(args.steps), "kernel_cache": kernel_load_us(),
                      "dynamic_watcher": watcher_check_us()}, indent=1))


if __name__ == "__main__":
    main()
