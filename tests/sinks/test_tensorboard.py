"""TensorBoardSink: real event files, read back with TensorBoard's own event_accumulator.

The expected values are computed here from the rows handed to the sink: the tag from the
documented layout, the value as ``numpy.float32`` of the row's value (TensorBoard scalars
are float32; see docs/tensorboard.md).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from trainmon.output.tb_tags import TensorBoardSettings
from trainmon.sinks import SinkOptions
from trainmon.sinks.csv import CsvSink
from trainmon.sinks.tensorboard import (
    TensorBoardSink,
    crc32c,
    encode_event,
    f32_bytes,
    frame_record,
    masked_crc32c,
    value_prefix,
)
from trainmon.stats.rows import StatRow, StepRows

REPO = Path(__file__).resolve().parents[2]
ALL_OPS = ("norm", "mean", "min", "max", "std", "zeros", "nans", "infs")
PARAM_FAMILIES = ("grad_unreduced", "grad_reduced", "param_origin", "param_updated", "exp_avg", "exp_avg_sq")
# Values that stress the float32 conversion: rounding, overflow, underflow, specials.
SPECIAL = (0.1 + 0.2, 1e-30, 3.4e38, 1e39, -1e39, 1e-50, math.nan, math.inf, -math.inf, -0.0)
PER_TENSOR = TensorBoardSettings(tags="per_tensor")


# ---------------------------------------------------------------------------------------------
# Helpers shared with tests/commands/test_csv2tb.py
# ---------------------------------------------------------------------------------------------
def family_rows(step: int, n_params: int = 3, micro_steps: int = 2, ops=ALL_OPS, vpp_stages=1) -> list[StatRow]:
    """One step's rows of every family, with varied values (incl. the SPECIAL ones)."""
    rng = np.random.default_rng(step)
    names = [f"layers.{i}.mlp.weight" for i in range(n_params)]

    def stats(k: int, keys=ops) -> dict:
        out = {}
        for j, op in enumerate(keys):
            if op in ("nans", "infs"):
                out[op] = int(rng.integers(0, 3)) if op == "nans" else 2 ** 24 + 1
            elif (k + j + step) % 7 == 0:
                out[op] = SPECIAL[(k + j + step) % len(SPECIAL)]
            else:
                out[op] = float(rng.standard_normal() * 10.0 ** rng.integers(-8, 4))
        return out

    rows, k = [], 0
    for vpp in range(vpp_stages):
        for family in PARAM_FAMILIES:
            for name in names:
                rows.append(StatRow(family, name, step, stats(k), (64, 32), "torch.float32", vpp_stage=vpp))
                k += 1
        for name in names:
            rows.append(StatRow("update_ratio", name, step, {"update_ratio": stats(k, ("x",))["x"]},
                                (64, 32), "torch.float32", vpp_stage=vpp))
            k += 1
        for micro in range(micro_steps):
            for family in ("actv", "actv_grad"):
                for i in range(n_params):
                    rows.append(StatRow(family, f"layers.{i}.mlp.output", step, stats(k), (8, 16, 32),
                                        "torch.bfloat16", vpp_stage=vpp, micro_step=micro))
                    k += 1
    for call in range(2):
        for phase in ("pre", "post"):
            rows.append(StatRow("comm", "all_reduce", step, stats(k, ("norm", "max")), (128,), "torch.float32",
                                extra={"op": "all_reduce", "call": call, "phase": phase, "arg": 0}))
            k += 1
    return rows


def expected_tag(row: StatRow, op: str) -> str:
    """The documented tag layout, written out independently of trainmon.output.tb_tags."""
    tag = f"{row.family}.{op}/vp{row.vpp_stage}:{row.name}"
    for key, value in row.extra.items():
        tag += f":{key}={value}"
    if row.micro_step is not None:
        tag += f":micro{row.micro_step}"
    return tag


def f32(v) -> float:
    with np.errstate(over="ignore"):
        return float(np.float32(v))


def expected_scalars(rows) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for op, v in row.stats.items():
            out.setdefault(expected_tag(row, op), []).append((row.step, f32(v)))
    return out


def expected_from_csv(rank_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Tags and float32 values derived from a rank's CSV files with plain pandas."""
    want: dict[str, list] = {}
    for path in sorted(rank_dir.glob("*_*-*.csv")):
        family = path.name.split(".")[0].rsplit("_", 1)[0]
        df = pd.read_csv(path, keep_default_na=False, na_values=["nan"], dtype={"name": str})
        cols = list(df.columns)
        first = next(i for i, c in enumerate(cols) if c in (*ALL_OPS, "update_ratio"))
        extras, stats = cols[3 + ("micro_step" in cols):first], cols[first:-2]
        for rec in df.to_dict("records"):
            series = f"vp{rec['vpp_stage']}:{rec['name']}" + "".join(f":{k}={rec[k]}" for k in extras)
            if "micro_step" in rec:
                series += f":micro{rec['micro_step']}"
            for op in stats:
                want.setdefault(f"{family}.{op}/{series}", []).append((rec["step"], f32(rec[op])))
    return want


PER_ROW = ("loss", "hyperparams", "steps")


def csv_frames(rank_dir: Path):
    """(family, stat columns, frame) of every family file of a rank, read with plain pandas."""
    for path in sorted(rank_dir.glob("*_*-*.csv")):
        family = path.name.split(".")[0].rsplit("_", 1)[0]
        df = pd.read_csv(path, keep_default_na=False, na_values=["nan"], dtype={"name": str})
        cols = list(df.columns)
        first = next(i for i, c in enumerate(cols) if c in (*ALL_OPS, "update_ratio", "loss") or c.startswith("("))
        yield family, cols[first:-2], df


def expected_summary_from_csv(rank_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """The documented summary series (docs/tensorboard.md), computed from the CSV files with
    pandas/numpy in float64: ``<family>.<op>/global|max|min|nonfinite|sum``."""
    want: dict[str, list] = {}
    for family, stats, df in csv_frames(rank_dir):
        if family in PER_ROW:
            continue
        for step, g in df.groupby("step", sort=True):
            for op in stats:
                x = g[op].to_numpy(dtype=np.float64)
                finite, numbers = np.isfinite(x), x[~np.isnan(x)]
                if op in ("nans", "infs"):
                    aggs = {"sum": x.sum(), "max": x.max()}
                else:
                    aggs = {"max": numbers.max() if numbers.size else math.nan,
                            "min": numbers.min() if numbers.size else math.nan,
                            "nonfinite": float((~finite).sum())}
                    if op == "norm":
                        aggs["global"] = float(np.sqrt(np.sum(x * x)))
                for agg, v in aggs.items():
                    want.setdefault(f"{family}.{op}/{agg}", []).append((int(step), float(v)))
    return want


def assert_same_summary(got: dict, want: dict) -> None:
    """``got`` (event scalars) holds exactly the summary series of ``want``: aggregates that are
    one of the CSV values (max, min) or counts are float32 of them exactly; the global norm
    (a sum) to float32 precision."""
    summary = {t: v for t, v in got.items() if not t.split("/", 1)[1].startswith("vp") and t != "loss.loss/step"}
    assert sorted(summary) == sorted(want)
    for tag, series in want.items():
        g = summary[tag]
        assert [s for s, _ in g] == [s for s, _ in series], tag
        for (step, a), (_, b) in zip(g, series):
            b32 = f32(b)
            if tag.endswith("/global") and math.isfinite(b32):
                assert a == pytest.approx(b32, rel=2e-7), (tag, step)
            else:
                assert (math.isnan(a) and math.isnan(b32)) or a == b32, (tag, step, a, b)


def load_accumulator(event_dir: Path):
    """TensorBoard's own EventAccumulator over a directory, keeping every event."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(event_dir), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0, ea.HISTOGRAMS: 0})
    acc.Reload()
    return acc


def load_scalars(event_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of a directory's event files, via TensorBoard's own loader (keep all)."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(event_dir), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def assert_same_scalars(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for tag in want:
        g, w = got[tag], sorted(want[tag], key=lambda sv: sv[0])
        assert [s for s, _ in g] == [s for s, _ in w], tag
        for (step, a), (_, b) in zip(g, w):
            assert (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b)), \
                (tag, step, a, b)


def write_rows(sink, steps: int, **kw) -> list[StatRow]:
    written = []
    for step in range(steps):
        rows = family_rows(step, **kw)
        sink.write(StepRows.of(rows), step)
        written.extend(rows)
    return written


def tb_dir(run_dir: Path, rank: int = 0) -> Path:
    return run_dir / "tensorboard" / f"rank{rank}"


# ---------------------------------------------------------------------------------------------
# Wire format
# ---------------------------------------------------------------------------------------------
def test_crc32c_matches_tensorboard_reference():
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import crc32c as ref_crc
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as ref_masked

    assert crc32c(b"123456789") == 0xE3069283          # the standard check value
    rng = np.random.default_rng(0)
    for n in (0, 1, 3, 4, 5, 511, 512, 513, 1000, 4096, 4099, 65537, 150_001):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert crc32c(data) == ref_crc(data), n
        assert masked_crc32c(data) == ref_masked(data), n
    assert crc32c(b"\0" * 5000) == ref_crc(b"\0" * 5000)
    assert crc32c(b"\xff" * 5000) == ref_crc(b"\xff" * 5000)


def test_event_bytes_parse_as_tensorboard_protos():
    from tensorboard.compat.proto import event_pb2

    tag = "grad_reduced.norm/vp0:" + "layers.0.weight" * 20     # a tag longer than 127 bytes
    body = value_prefix(tag) + f32_bytes(0.1) + value_prefix("x.y/z") + f32_bytes(1e39)
    event = event_pb2.Event.FromString(encode_event(2 ** 40 + 3, 1234.5, body))
    assert (event.step, event.wall_time) == (2 ** 40 + 3, 1234.5)
    assert [(v.tag, v.simple_value) for v in event.summary.value] == [(tag, f32(0.1)), ("x.y/z", math.inf)]
    record = frame_record(b"abc")
    length, = struct.unpack("<Q", record[:8])
    assert length == 3 and record[12:15] == b"abc"
    assert struct.unpack("<I", record[8:12])[0] == masked_crc32c(record[:8])


# ---------------------------------------------------------------------------------------------
# The sink
# ---------------------------------------------------------------------------------------------
def test_every_family_step_and_op_reads_back_exactly(tmp_path):
    run = tmp_path / "run"
    sink = TensorBoardSink(SinkOptions(rank_dir=run / "rank1", rank=1), PER_TENSOR)
    rows = write_rows(sink, steps=4, vpp_stages=2)
    sink.close()

    files = list(tb_dir(run, 1).iterdir())
    assert len(files) == 1 and files[0].name.startswith("events.out.tfevents.")
    got = load_scalars(tb_dir(run, 1))
    assert_same_scalars(got, expected_scalars(rows))
    families = {tag.split(".", 1)[0] for tag in got}
    assert families == {*PARAM_FAMILIES, "update_ratio", "actv", "actv_grad", "comm"}
    assert "comm.norm/vp0:all_reduce:op=all_reduce:call=1:phase=post:arg=0" in got
    assert "actv_grad.max/vp1:layers.2.mlp.output:micro1" in got
    # the float32 conversion, spelled out on the extremes
    vals = {v for series in got.values() for _, v in series}
    assert {math.inf, -math.inf, 0.0, f32(3.4e38), f32(0.1 + 0.2)} <= vals
    assert f32(2 ** 24 + 1) == 2 ** 24                   # counts are exact only below 2**24


def test_native_events_equal_the_csv_cells(tmp_path):
    """The per-tensor layout behind the real off-thread writer, beside the CSV sink: TB == float32(CSV)."""
    from trainmon.sinks.async_writer import AsyncSink, FanoutSink

    run = tmp_path / "run"
    options = SinkOptions(rank_dir=run / "rank0", step_count_per_record=2)
    sink = AsyncSink(FanoutSink([CsvSink(options), TensorBoardSink(options, PER_TENSOR)], options))
    write_rows(sink, steps=5)
    sink.close()
    assert_same_scalars(load_scalars(tb_dir(run)), expected_from_csv(run / "rank0"))


def test_rows_that_change_between_steps_keep_their_own_tags(tmp_path):
    """Steps usually repeat the previous step's rows; every kind of change must still be seen."""
    base = [StatRow("grad_reduced", "a", 0, {"norm": 1.0, "mean": 2.0}),
            StatRow("actv", "m.output", 0, {"max": 3.0}, micro_step=0),
            StatRow("comm", "x", 0, {"norm": 4.0}, extra={"call": 0})]
    variants = [
        base,
        [dataclasses.replace(base[0], stats={"mean": 12.0, "norm": 11.0}), *base[1:]],   # ops permuted
        [dataclasses.replace(base[0], name="b"), *base[1:]],                              # renamed
        [base[0], dataclasses.replace(base[1], micro_step=1), base[2]],                  # micro-step
        [*base[:2], dataclasses.replace(base[2], extra={"call": 1})],                     # extra value
        [*base, StatRow("grad_reduced", "c", 0, {"norm": 5.0, "mean": math.nan})],      # row added
        base[1:],                                                                         # row removed
        [dataclasses.replace(base[0], stats={"norm": "n/a", "mean": 2.0}), *base[1:]],   # not a number
        [*base[:2], dataclasses.replace(base[2], step=9)],                                # mixed steps
        base,
    ]
    sink = TensorBoardSink(SinkOptions(rank_dir=tmp_path / "run" / "rank0"), PER_TENSOR)
    written = []
    for step, rows in enumerate(variants):
        rows = [dataclasses.replace(r, step=r.step if r.step == 9 else step,
                                    stats={k: (v + step if isinstance(v, float) else v) for k, v in r.stats.items()})
                for r in rows]
        sink.write(StepRows.of(rows), step)
        written.extend(rows)
    sink.close()
    # something that is not a number is written as NaN
    want = expected_scalars(dataclasses.replace(r, stats={k: math.nan if isinstance(v, str) else v
                                                          for k, v in r.stats.items()}) for r in written)
    assert math.isnan(dict(want["grad_reduced.norm/vp0:a"])[7])
    assert_same_scalars(load_scalars(tmp_path / "run" / "tensorboard" / "rank0"), want)


def test_ndigits_gives_the_rounded_csv_value(tmp_path):
    run = tmp_path / "run"
    options = SinkOptions(rank_dir=run / "rank0", ndigits=3)
    csv_sink, tb_sink = CsvSink(options), TensorBoardSink(options, PER_TENSOR)
    rows = [StatRow("grad_reduced", "w", 0, {"norm": 0.123456789, "max": 98765.4321, "nans": 7, "min": math.nan})]
    for sink in (csv_sink, tb_sink):
        sink.write(StepRows.of(rows), 0)
        sink.close()
    cells = pd.read_csv(run / "rank0" / "grad_reduced_0-0.csv").iloc[0]
    assert cells["norm"] == 0.123 and cells["max"] == 98800.0
    got = load_scalars(tb_dir(run))
    for op in ("norm", "max", "nans"):
        assert got[f"grad_reduced.{op}/vp0:w"] == [(0, f32(cells[op]))]
    assert math.isnan(got["grad_reduced.min/vp0:w"][0][1])


def test_each_step_is_readable_as_soon_as_write_returns(tmp_path):
    """No buffering: a TensorBoard watching a live run sees every step that was written."""
    run = tmp_path / "run"
    sink = TensorBoardSink(SinkOptions(rank_dir=run / "rank0"), PER_TENSOR)
    for step in range(3):
        sink.write(StepRows.of([StatRow("grad_reduced", "w", step, {"norm": float(step)})]), step)
        assert load_scalars(tb_dir(run))["grad_reduced.norm/vp0:w"][-1] == (step, float(step))
    sink.close()
    sink.close()                                                    # idempotent
    sink.write(StepRows.of([StatRow("grad_reduced", "w", 9, {"norm": 9.0})]), 9)  # after close: ignored, no error
    assert [s for s, _ in load_scalars(tb_dir(run))["grad_reduced.norm/vp0:w"]] == [0, 1, 2]


def test_a_record_cut_by_a_kill_leaves_earlier_steps_readable(tmp_path):
    run = tmp_path / "run"
    sink = TensorBoardSink(SinkOptions(rank_dir=run / "rank0"), PER_TENSOR)
    rows = write_rows(sink, steps=3)
    sink.close()
    path = next(tb_dir(run).iterdir())
    whole = frame_record(encode_event(3, 0.0, value_prefix("grad_reduced.norm/vp0:x") + f32_bytes(1.0)))
    with open(path, "ab") as fh:
        fh.write(whole[: len(whole) // 2])
    assert_same_scalars(load_scalars(tb_dir(run)), expected_scalars(rows))


_CHILD = textwrap.dedent("""
    from pathlib import Path
    from trainmon.sinks import SinkOptions
    from trainmon.sinks.tensorboard import TensorBoardSink
    from tests.sinks.test_tensorboard import PER_TENSOR, family_rows
    from trainmon.stats.rows import StepRows
    sink = TensorBoardSink(SinkOptions(rank_dir=Path({rank_dir!r})), PER_TENSOR)
    step = 0
    while True:
        sink.write(StepRows.of(family_rows(step, n_params=40)), step)
        print(step, flush=True)
        step += 1
""")


@pytest.mark.slow  # a child process killed mid-run
def test_sigkilled_writer_leaves_every_written_step_readable(tmp_path):
    run = tmp_path / "run"
    code = _CHILD.format(rank_dir=str(run / "rank0"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        done = -1
        for line in child.stdout:
            done = int(line)
            if done >= 15:
                break
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert done >= 15, "the writer never got going"
    got = load_scalars(tb_dir(run))
    steps = sorted({s for series in got.values() for s, _ in series})
    assert steps[: done + 1] == list(range(done + 1))          # every reported step, maybe one more
    want = expected_scalars(r for step in steps for r in family_rows(step, n_params=40))
    assert_same_scalars(got, want)


def test_unwritable_directory_warns_once_and_never_raises(tmp_path, caplog):
    blocker = tmp_path / "file.txt"
    blocker.write_text("not a directory")
    sink = TensorBoardSink(SinkOptions(rank_dir=blocker / "run" / "rank0"))
    with caplog.at_level(logging.WARNING, logger="trainmon.sinks.tensorboard"):
        for step in range(5):
            sink.write(StepRows.of([StatRow("grad_reduced", "w", step, {"norm": 1.0})]), step)
        sink.close()
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if "cannot write TensorBoard events" in m]) == 1
    assert any("5 step(s) of TensorBoard output were not written" in m for m in messages)


def test_importing_the_sink_does_not_import_tensorboard():
    code = ("import sys, trainmon.sinks.tensorboard, trainmon.output.tb_tags, trainmon.output.runs; "
            "print('tensorboard' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.stdout.split() == ["False", "False"]
