"""Young-generation garbage collections caused by writing rows (issue #31: no per-row garbage).

CPython collects generation 0 every 700 net container allocations; a Python list per row alive
while a step is written (what ``values`` lists are) is one collection per ~700 rows.  Counted
with ``gc.callbacks``: deterministic, not a timing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from trainmon.sinks import csv_text
from trainmon.sinks.async_writer import AsyncSink
from trainmon.sinks.base import SinkOptions
from trainmon.sinks.csv import CsvSink
from trainmon.stats.rows import RowBlock, StepRows
from trainmon.testing.gc_counter import young_collections

FAMILIES = ("grad_unreduced", "grad_reduced", "param_origin", "param_updated", "exp_avg", "exp_avg_sq")
OPS = ("norm", "mean", "min", "max", "nans")
N = 512


def _engine_like_steps(steps: int, as_matrix: bool) -> list[StepRows]:
    """Steps of 6 families x 512 tensors, as the engine hands them: a float64 matrix per family
    (or today's per-row value lists) and the layout's lists, the same objects every step."""
    rng = np.random.default_rng(0)
    names = [f"layers.{i}.weight" for i in range(N)]
    vpps, shapes, dtypes = [0] * N, [(4, 4)] * N, ["torch.float32"] * N
    out = []
    for step in range(steps):
        mats = {f: np.abs(rng.standard_normal((N, len(OPS)))) for f in FAMILIES}
        for m in mats.values():
            m[:, -1] = 0.0  # nans: a count

        def build(step=step, mats=mats):
            if as_matrix:
                return [
                    RowBlock(
                        f,
                        step,
                        None,
                        None,
                        OPS,
                        names,
                        vpps,
                        shapes,
                        dtypes,
                        None,
                        matrix=mats[f],
                        integer_columns=(4,),
                    )
                    for f in FAMILIES
                ]
            return [
                RowBlock(
                    f,
                    step,
                    None,
                    None,
                    OPS,
                    names,
                    vpps,
                    shapes,
                    dtypes,
                    [[*r[:-1], int(r[-1])] for r in mats[f].tolist()],
                )
                for f in FAMILIES
            ]

        out.append(StepRows(build, wall_time=1.0))
    return out


@pytest.mark.skipif(not csv_text.fast_available(), reason="orjson (the block formatter) not installed")
def test_writing_matrix_blocks_makes_no_per_row_garbage(tmp_path: Path):
    """20 steps of 3,072 rows through the writer thread and the CSV sink: at most one young
    collection every few steps (3,072 Python objects a step alive at once would make 4 a step)."""
    steps = _engine_like_steps(20, as_matrix=True)
    sink = AsyncSink(CsvSink(SinkOptions(rank_dir=tmp_path, step_count_per_record=100)))
    sink.write(steps[0], 0)  # templates built once, outside the count
    sink.flush()

    def write_all():
        for i, rows in enumerate(steps[1:], 1):
            sink.write(rows, i)
        sink.flush()

    collections = young_collections(write_all)
    sink.close()
    assert collections <= 5, collections  # <= 0.25 a step
    lines = sum(1 for p in tmp_path.glob("*.csv") for _ in p.open()) - len(FAMILIES)
    assert lines == 20 * len(FAMILIES) * N  # every row written


def test_value_lists_are_what_made_the_garbage(tmp_path: Path):
    """The same steps with a Python list per row (today's ``values``): the collections the matrix
    path avoids.  Keeps the test above honest: the count does see per-row objects."""
    steps = _engine_like_steps(6, as_matrix=False)
    sink = CsvSink(SinkOptions(rank_dir=tmp_path, step_count_per_record=100))
    collections = young_collections(lambda: [sink.write(rows, i) for i, rows in enumerate(steps)])
    sink.close()
    assert collections >= 6 * 3, collections  # ~4 a step (3,072 lists alive per step)


@pytest.mark.slow
@pytest.mark.parametrize("config", ["wg", "all-on"])
def test_a_monitored_step_collects_at_most_twice_as_often_as_an_unmonitored_one(tmp_path, monkeypatch, config):
    """The whole pipeline at N = 512 parameter tensors (``benchmarks/host_cost.py``'s model): young
    collections over 6 monitored steps, the writer's flush included, against 6 unmonitored steps."""
    import json

    import torch

    from trainmon import TrainerMon

    flags = {
        "wg": {"wg_distribution": True},
        "all-on": {"wg_distribution": True, "mv_distribution": True, "param_distribution": True},
    }[config]
    torch.set_num_threads(1)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(N // 2)])
        models.append((model, torch.optim.Adam(model.parameters(), lr=1e-3)))
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({**flags, "ops": list(OPS), "step_count_per_record": 1000}))
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    monitor = TrainerMon(cfg).set_monitor(models[1][0], optimizer=models[1][1])
    x = torch.randn(8, 4)

    def steps(model, opt, n=6):
        for _ in range(n):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

    steps(*models[0], 3)
    steps(*models[1], 3)  # warm-up: layouts and templates built
    monitor._driver.session.sink.flush()
    base = young_collections(lambda: steps(*models[0]))
    monitored = young_collections(lambda: (steps(*models[1]), monitor._driver.session.sink.flush()))
    monitor.close()
    assert monitored <= 2 * base + 6, (monitored, base)  # + 1 a step: the step's few Python objects
