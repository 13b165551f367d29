"""The summary for the trainers' loggers (``trainmon.sinks.summary``): made on the real writer
thread from the rows the CSV sink writes, checked against those CSV files read back and against
numpy float64."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from trainmon.sinks import SinkOptions
from trainmon.sinks.async_writer import AsyncSink, FanoutSink
from trainmon.sinks.base import Sink
from trainmon.sinks.csv import CsvSink
from trainmon.sinks.summary import SummaryBoard, SummarySpec, summary_spec
from trainmon.stats.rows import StatRow, StepRows

RNG = np.random.default_rng(7)
NAMES = ["layers.0.attn.weight", "layers.0.mlp.weight", "layers.1.mlp.weight", "head.weight"]


def step_rows(step: int) -> list[StatRow]:
    rows = [
        StatRow(
            "grad_reduced", n, step, {"norm": float(RNG.random()), "max": float(RNG.normal())}, (4,), "torch.float32"
        )
        for n in NAMES
    ]
    rows += [StatRow("update_ratio", n, step, {"update_ratio": float(RNG.random() * 1e-3)}) for n in NAMES]
    rows += [StatRow("actv", "layers.0", step, {"norm": 3.0}, micro_step=0)]  # per micro-batch: not summarized
    return rows


def read_csv(rank_dir: Path, family: str) -> pd.DataFrame:
    return pd.concat([pd.read_csv(p) for p in sorted(rank_dir.glob(f"{family}_*.csv"))], ignore_index=True)


class SlowSink(Sink):
    """Holds the writer thread until released: the summary is not ready before its rows are built."""

    def __init__(self, options: SinkOptions):
        super().__init__(options)
        self.release = threading.Event()
        self.thread: str | None = None

    def write(self, rows: StepRows, step: int) -> None:
        self.thread = threading.current_thread().name
        self.release.wait(5)
        rows.blocks()


def test_summary_made_on_the_writer_thread_equals_the_csv_rows(tmp_path):
    options = SinkOptions(rank_dir=tmp_path / "rank0")
    board = SummaryBoard(SummarySpec())
    slow = SlowSink(options)
    sink = board.watch(AsyncSink(FanoutSink([slow, CsvSink(options)])))
    for step in range(3):
        sink.write(StepRows.of(step_rows(step)), step)
    assert board.take() == []  # nothing built yet: the training thread did no summary work
    assert not board.wait_for_submitted(0.05)
    slow.release.set()
    assert board.wait_for_submitted(5)
    taken = board.take()
    sink.close()
    assert slow.thread == "trainmon-writer"
    assert [s for s, _ in taken] == [0, 1, 2]
    grads, ratios = read_csv(options.rank_dir, "grad_reduced"), read_csv(options.rank_dir, "update_ratio")
    for step, values in taken:
        g, r = grads[grads["step"] == step], ratios[ratios["step"] == step]
        want = {f"trainmon/grad_reduced/norm/{n}": v for n, v in zip(g["name"], g["norm"])}
        want["trainmon/grad_reduced/norm"] = math.sqrt(float(np.sum(g["norm"].to_numpy(np.float64) ** 2)))
        want.update({f"trainmon/update_ratio/update_ratio/{n}": v for n, v in zip(r["name"], r["update_ratio"])})
        assert values.keys() == want.keys()  # max not in the default stats; actv not summarized
        for key, value in want.items():
            assert values[key] == pytest.approx(value, rel=1e-12, abs=0)


def test_selection_names_stats_totals_and_late_rows(tmp_path):
    board = SummaryBoard(SummarySpec(families=("grad_reduced", "loss"), stats=None, names=("*.mlp.*", "loss")))
    sink = board.watch(FanoutSink([CsvSink(SinkOptions(rank_dir=tmp_path))]))
    rows = step_rows(5)
    rows[1] = StatRow("grad_reduced", NAMES[1], 5, {"norm": 2.0, "max": float("nan")})
    sink.write(StepRows.of(rows), 5)
    sink.write(StepRows.of([StatRow("loss", "loss", 5, {"loss": 0.5})]), 5)  # record_loss: a late write
    sink.close()
    [(step, values)] = board.take()
    assert step == 5
    per_tensor = sorted(k for k in values if k.count("/") == 3 and k.startswith("trainmon/grad_reduced/"))
    assert per_tensor == sorted(f"trainmon/grad_reduced/{s}/{n}" for s in ("norm", "max") for n in NAMES[1:3])
    norms = np.array([r.stats["norm"] for r in rows if r.family == "grad_reduced"], dtype=np.float64)
    assert values["trainmon/grad_reduced/norm"] == pytest.approx(float(np.sqrt(np.sum(norms**2))), rel=1e-12)
    assert math.isnan(values["trainmon/grad_reduced/max"])  # a NaN in the family shows in its max
    assert values["trainmon/loss/loss/loss"] == 0.5


def test_max_and_min_totals_without_nan():
    board = SummaryBoard(SummarySpec(families=("grad_reduced",), stats=("max", "min"), per_tensor=False))
    rows = [StatRow("grad_reduced", n, 0, {"max": v, "min": -v}) for n, v in zip(NAMES, [0.5, 3.0, -1.0, 2.0])]
    assert board.summarize(StepRows.of(rows).blocks()) == {
        "trainmon/grad_reduced/max": 3.0,
        "trainmon/grad_reduced/min": -3.0,
    }


def test_forward_to_loggers_values():
    assert summary_spec(False) is None and summary_spec(None) is None
    assert summary_spec(True) == SummarySpec()
    assert summary_spec("exp_avg") == SummarySpec(families=("exp_avg",), stats=None)
    assert summary_spec(["exp_avg", "grad_reduced"]).families == ("exp_avg", "grad_reduced")
    with pytest.raises(ValueError, match=r"unknown family 'grad_reduce' \(did you mean 'grad_reduced'\?\)"):
        summary_spec(["grad_reduce"])
    with pytest.raises(ValueError, match=r"unknown stat 'nrom' \(did you mean 'norm'\?\)"):
        SummarySpec(stats=("nrom",))
    with pytest.raises(ValueError, match="forward_to_loggers=3: must be"):
        summary_spec(3)


def test_a_failing_summary_warns_once_and_the_files_get_their_rows(tmp_path, caplog):
    board = SummaryBoard(SummarySpec())
    board.summarize = None  # type: ignore[method-assign]  # calling it raises TypeError
    sink = board.watch(FanoutSink([CsvSink(SinkOptions(rank_dir=tmp_path))]))
    for step in range(2):
        sink.write(StepRows.of(step_rows(step)), step)
    sink.close()
    assert board.take() == []
    assert len(read_csv(tmp_path, "grad_reduced")) == 2 * len(NAMES)
    warnings = [r.getMessage() for r in caplog.records if "summary for the trainer's loggers failed" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("trainmon: ")
