"""A real ``tensorboard`` server on a 400-tensor run: the default (summary) tag layout lists its
tags in under a second, and the custom-scalars and HParams plugins are active on it.

The helpers here (a synthetic N-parameter run through the real sinks, a server, a timed request)
are also used by ``benchmarks/tb_tags.py``.
"""
from __future__ import annotations

import json
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from trainmon.output.tb_tags import TensorBoardSettings
from trainmon.sinks import SinkOptions
from trainmon.sinks.async_writer import FanoutSink
from trainmon.sinks.csv import CsvSink
from trainmon.sinks.tensorboard import TensorBoardSink
from trainmon.stats.rows import RowBlock, StepRows

OPS = ("norm", "mean", "min", "max")
FAMILIES = ("grad_unreduced", "grad_reduced", "param_origin", "param_updated", "exp_avg", "exp_avg_sq")


def param_names(n: int) -> list[str]:
    return [f"model.layers.{i // 2}.linear.{'weight' if i % 2 == 0 else 'bias'}" for i in range(n)]


def step_blocks(step: int, names: list[str], rng) -> list[RowBlock]:
    """One step of an ``n``-parameter run: wg + mv + param families with 4 ops, and update_ratio."""
    n = len(names)
    shapes, dtypes, vpp = [(128, 128)] * n, ["torch.float32"] * n, [0] * n
    blocks = [RowBlock(f, step, None, None, OPS, names, vpp, shapes, dtypes,
                       (rng.standard_normal((n, 4)) * 10.0 ** rng.integers(-6, 3, (n, 1))).tolist())
              for f in FAMILIES]
    blocks.append(RowBlock("update_ratio", step, None, None, ("update_ratio",), names, vpp, shapes, dtypes,
                           rng.uniform(1e-5, 1e-2, (n, 1)).tolist()))
    return blocks


def write_run(run_dir: Path, n_params: int, steps: int, settings: TensorBoardSettings | None = None,
              with_csv: bool = True) -> None:
    """A run with a ``run.json`` and config (for HParams) written by the real CSV and TB sinks."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config = run_dir / "config.json"
    config.write_text(json.dumps({"wg_distribution": True, "mv_distribution": True, "param_distribution": True,
                                  "ur_distribution": True, "ops": list(OPS), "format": ["csv", "tensorboard"]}))
    (run_dir / "run.json").write_text(json.dumps({"run_id": run_dir.name, "world_size": 1,
                                                  "config_file": str(config)}))
    options = SinkOptions(rank_dir=run_dir / "rank0", step_count_per_record=100)
    sinks = [TensorBoardSink(options, settings)] + ([CsvSink(options)] if with_csv else [])
    sink = FanoutSink(sinks, options)
    rng, names = np.random.default_rng(0), param_names(n_params)
    for step in range(steps):
        blocks = step_blocks(step, names, rng)
        sink.write(StepRows(lambda blocks=blocks: blocks, 1_700_000_000.0 + step), step)
    sink.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port: int, path: str, **query):
    url = f"http://127.0.0.1:{port}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    with urllib.request.urlopen(url, timeout=120) as resp:
        return json.loads(resp.read())


class Server:
    """``tensorboard --logdir`` on a free port (its default data server), stopped on exit."""

    def __init__(self, logdir: Path, *options: str):
        exe = shutil.which("tensorboard")
        cmd = [exe] if exe else [sys.executable, "-m", "tensorboard.main"]
        self.port = free_port()
        self.started = time.perf_counter()
        self.proc = subprocess.Popen([*cmd, "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(self.port),
                                      *options], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def wait_for_tags(self, run: str, n_tags: int, timeout: float = 180) -> float:
        """Until the server has loaded all ``n_tags`` scalar tags of ``run``; seconds since its start."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "tensorboard exited"
            try:
                if len(get(self.port, "/data/plugin/scalars/tags").get(run, {})) >= n_tags:
                    return time.perf_counter() - self.started
            except OSError:
                pass  # not listening yet
            time.sleep(0.1)
        raise AssertionError(f"tensorboard did not list {n_tags} tags of {run} within {timeout} s")

    def time_tag_list(self, repeats: int = 3) -> list[float]:
        """Seconds per ``/data/plugin/scalars/tags`` request (what the Scalars dashboard asks first)."""
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            get(self.port, "/data/plugin/scalars/tags")
            times.append(time.perf_counter() - t0)
        return times


def scalar_tag_count(event_dir: Path) -> int:
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(event_dir), size_guidance={ea.SCALARS: 1})
    acc.Reload()
    return len(acc.Tags()["scalars"])


@pytest.mark.slow  # a tensorboard server process
def test_a_400_tensor_run_lists_its_tags_in_under_a_second(tmp_path):
    run = tmp_path / "logdir" / "run400"
    write_run(run, n_params=400, steps=5, with_csv=False)
    event_dir = run / "tensorboard" / "rank0"
    n_tags = scalar_tag_count(event_dir)
    assert n_tags < 150                                  # 7 families x 4 ops, not 400 x 7 x 4 = 11,200
    with Server(tmp_path / "logdir") as server:
        server.wait_for_tags("run400/tensorboard/rank0", n_tags)
        seconds = server.time_tag_list()
        assert statistics.median(seconds) <= 1.0, seconds
        plugins = get(server.port, "/data/plugins_listing")
        assert plugins["custom_scalars"]["enabled"] and plugins["hparams"]["enabled"]
        assert plugins["histograms"]["enabled"] and plugins["distributions"]["enabled"]
        layout = get(server.port, "/data/plugin/custom_scalars/layout")
        titles = [c["title"] for c in layout["category"]]
        assert titles[0] == "grad: before vs after the reduce" and "update_ratio" in titles
        chart = get(server.port, "/data/plugin/custom_scalars/scalars", run="run400/tensorboard/rank0",
                    tag=layout["category"][0]["chart"][0]["multiline"]["tag"][0])
        assert chart["regex_valid"] and set(chart["tag_to_events"]) == {
            "grad_unreduced.norm/global", "grad_unreduced.norm/max", "grad_unreduced.norm/min",
            "grad_unreduced.norm/nonfinite"}
