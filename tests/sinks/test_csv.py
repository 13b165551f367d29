"""CsvSink: files written for real under tmp_path and read back with pandas / raw bytes."""
from __future__ import annotations

import csv
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

from trainmon.stats.rows import StatRow, StepRows
from trainmon.sinks import SinkOptions
from trainmon.sinks.csv import CsvSink

REPO = Path(__file__).resolve().parents[2]


def _sink(rank_dir: Path, **kw) -> CsvSink:
    max_open = kw.pop("max_open_files", 64)
    return CsvSink(SinkOptions(rank_dir=rank_dir, **kw), max_open_files=max_open)


def _row(family="grad_reduced", name="layer.weight", step=0, stats=None, **kw) -> StatRow:
    return StatRow(family, name, step, stats if stats is not None else {"norm": 1.5, "mean": -0.25},
                   kw.pop("shape", (4, 2)), kw.pop("dtype", "torch.float32"), **kw)


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def _csv_files(d: Path) -> list[str]:
    return sorted(p.name for p in d.glob("*.csv"))


def test_columns_order_micro_step_and_extra(tmp_path):
    sink = _sink(tmp_path)
    sink.write(StepRows.of([
        _row("actv", "block.0.output", 5, {"norm": 2.0, "max": 3.0, "nans": 0}, micro_step=1,
             vpp_stage=1, extra={"rank": 3, "tag": "fwd"}),
        _row("grad_reduced", "w", 5, {"min": -1.0, "norm": 0.5}, shape=(64, 32)),
    ]), step=5)
    sink.close()

    actv = pd.read_csv(tmp_path / "actv_5-5.csv")
    assert list(actv.columns) == ["vpp_stage", "name", "step", "micro_step", "rank", "tag",
                                  "norm", "max", "nans", "shape", "dtype"]
    assert actv.iloc[0].tolist() == [1, "block.0.output", 5, 1, 3, "fwd", 2.0, 3.0, 0, "[4, 2]",
                                     "torch.float32"]
    grad = pd.read_csv(tmp_path / "grad_reduced_5-5.csv")
    assert list(grad.columns) == ["vpp_stage", "name", "step", "min", "norm", "shape", "dtype"]
    assert grad.iloc[0].tolist() == [0, "w", 5, -1.0, 0.5, "[64, 32]", "torch.float32"]
    # shape is one csv-quoted cell; a scalar is "[]"; the header appears once
    raw = (tmp_path / "grad_reduced_5-5.csv").read_text()
    assert raw == "vpp_stage,name,step,min,norm,shape,dtype\n0,w,5,-1.0,0.5,\"[64, 32]\",torch.float32\n"


def test_scalar_shape_and_names_needing_quotes(tmp_path):
    sink = _sink(tmp_path)
    names = ['plain', 'with,comma', 'with "quote"', 'multi\nline']
    sink.write(StepRows.of([_row(name=n, shape=()) for n in names]), step=0)
    sink.close()
    df = pd.read_csv(tmp_path / "grad_reduced_0-0.csv")
    assert df["name"].tolist() == names
    assert df["shape"].tolist() == ["[]"] * 4


@pytest.mark.parametrize("n", [1, 3])
def test_step_windows(tmp_path, n):
    sink = _sink(tmp_path, step_count_per_record=n)
    for step in range(8):
        sink.write(StepRows.of([_row("param_origin", "a", step), _row("param_origin", "b", step)]), step)
    sink.close()

    expected = {}
    for step in range(8):
        a = step // n * n
        expected.setdefault(f"param_origin_{a}-{a + n - 1}.csv", []).extend([step, step])
    assert _csv_files(tmp_path) == sorted(expected)
    for name, steps in expected.items():
        df = pd.read_csv(tmp_path / name)
        assert df["step"].tolist() == steps
        assert df["name"].tolist() == ["a", "b"] * (len(steps) // 2)
        assert (tmp_path / name).read_text().count("vpp_stage") == 1


def test_full_precision_round_trip(tmp_path):
    values = [1e-30, 0.1 + 0.2, 3.4e38, 5e-324, 2.2250738585072014e-308, 1 / 3, math.pi,
              1.7976931348623157e308, -0.0, float(np.float32(0.1)), float("nan"), float("inf"),
              float("-inf")]
    stats = {f"s{i}": v for i, v in enumerate(values)}
    stats["nans"] = 7
    stats["np_float"] = np.float64(2.0) / 3
    stats["np_int"] = np.int64(12)
    sink = _sink(tmp_path)
    sink.write(StepRows.of([_row(stats=stats)]), step=0)
    sink.close()

    path = tmp_path / "grad_reduced_0-0.csv"
    df = pd.read_csv(path)
    for i, v in enumerate(values):
        got = float(df[f"s{i}"].iloc[0])
        assert _bits(got) == _bits(v) or (math.isnan(v) and math.isnan(got)), (i, v, got)
    assert df["np_float"].iloc[0] == float(np.float64(2.0) / 3)
    # counts stay integers
    assert df["nans"].dtype.kind == "i" and df["nans"].iloc[0] == 7
    assert df["np_int"].dtype.kind == "i" and df["np_int"].iloc[0] == 12
    header, cells = list(csv.reader(path.open()))
    spelled = dict(zip(header, cells))
    assert [spelled["s10"], spelled["s11"], spelled["s12"]] == ["nan", "inf", "-inf"]
    assert spelled["s1"] == "0.30000000000000004" and spelled["nans"] == "7"


def test_ndigits_significant_digits(tmp_path):
    values = {"norm": 123456.789, "mean": 1.23456789e-9, "min": -0.000987654, "max": float("nan"),
              "std": 2.0, "nans": 3}
    sink = _sink(tmp_path, ndigits=3)
    sink.write(StepRows.of([_row("exp_avg_sq", stats=values)]), step=0)
    sink.close()
    df = pd.read_csv(tmp_path / "exp_avg_sq_0-0.csv")
    for key, v in values.items():
        if key == "nans":
            assert df[key].iloc[0] == 3
        elif math.isnan(v):
            assert math.isnan(df[key].iloc[0])
        else:
            assert df[key].iloc[0] == float(f"{v:.3g}")
    # small second moments keep their magnitude instead of rounding to 0.0
    assert df["mean"].iloc[0] == 1.23e-9
    with pytest.raises(ValueError, match="ndigits"):
        _sink(tmp_path, ndigits=0)


def test_header_change_goes_to_new_file(tmp_path):
    sink = _sink(tmp_path, step_count_per_record=10)
    sink.write(StepRows.of([_row(step=0, stats={"norm": 1.0, "mean": 2.0})]), 0)
    sink.write(StepRows.of([_row(step=1, stats={"norm": 3.0, "max": 4.0, "std": 5.0})]), 1)  # ops reloaded
    sink.write(StepRows.of([_row(step=2, stats={"norm": 6.0, "mean": 7.0})]), 2)  # and back again
    sink.write(StepRows.of([_row(step=3, stats={"norm": 8.0})]), 3)
    sink.close()

    assert _csv_files(tmp_path) == ["grad_reduced_0-9.1.csv", "grad_reduced_0-9.2.csv", "grad_reduced_0-9.csv"]
    base = pd.read_csv(tmp_path / "grad_reduced_0-9.csv")
    assert list(base.columns[3:-2]) == ["norm", "mean"]
    assert base[["step", "norm", "mean"]].values.tolist() == [[0, 1.0, 2.0], [2, 6.0, 7.0]]
    first = pd.read_csv(tmp_path / "grad_reduced_0-9.1.csv")
    assert list(first.columns[3:-2]) == ["norm", "max", "std"]
    assert first[["step", "norm", "max", "std"]].values.tolist() == [[1, 3.0, 4.0, 5.0]]
    second = pd.read_csv(tmp_path / "grad_reduced_0-9.2.csv")
    assert second[["step", "norm"]].values.tolist() == [[3, 8.0]]


def test_existing_files_are_continued_or_sidestepped(tmp_path):
    # A restarted process writing into the same rank dir: same header -> append without a
    # second header; a different header on disk -> never append under it.
    first = _sink(tmp_path, step_count_per_record=10)
    first.write(StepRows.of([_row(step=0)]), 0)
    first.close()
    (tmp_path / "actv_0-9.csv").write_text("vpp_stage,name,step,micro_step,norm,shape,dtype\n")

    second = _sink(tmp_path, step_count_per_record=10)
    second.write(StepRows.of([_row(step=1), _row("actv", step=1, micro_step=0)]), 1)
    second.close()
    raw = (tmp_path / "grad_reduced_0-9.csv").read_text().splitlines()
    assert len(raw) == 3 and raw[0].startswith("vpp_stage") and raw[2].startswith("0,layer.weight,1,")
    assert pd.read_csv(tmp_path / "actv_0-9.csv").empty
    moved = pd.read_csv(tmp_path / "actv_0-9.1.csv")
    assert moved[["step", "micro_step", "norm", "mean"]].values.tolist() == [[1, 0, 1.5, -0.25]]


def test_many_files_with_bounded_fd_cache(tmp_path):
    fd_dir = Path("/proc/self/fd")
    before = len(os.listdir(fd_dir))
    sink = _sink(tmp_path, step_count_per_record=100, max_open_files=4)
    families = [f"fam{i}" for i in range(12)]
    for step in range(5):
        sink.write(StepRows.of([_row(f, step=step, stats={"norm": float(step)}) for f in families]), step)
        assert len(os.listdir(fd_dir)) - before <= 4
    sink.close()
    assert len(os.listdir(fd_dir)) == before
    for f in families:
        df = pd.read_csv(tmp_path / f"{f}_0-99.csv")
        assert df["step"].tolist() == list(range(5))
        assert df["norm"].tolist() == [float(s) for s in range(5)]


def test_creates_rank_dir_and_recreates_removed_files(tmp_path):
    rank_dir = tmp_path / "out" / "run" / "rank0"
    sink = _sink(rank_dir, step_count_per_record=10, max_open_files=1)
    sink.write(StepRows.of([_row("a", step=0), _row("b", step=0)]), 0)  # "a" evicted from the fd cache
    (rank_dir / "a_0-9.csv").unlink()
    sink.write(StepRows.of([_row("a", step=1)]), 1)
    sink.close()
    df = pd.read_csv(rank_dir / "a_0-9.csv")
    assert df["step"].tolist() == [1]


def test_unwritable_directory_warns_once(tmp_path, caplog):
    (tmp_path / "file.txt").write_text("not a directory")
    rank_dir = tmp_path / "file.txt" / "sub"
    sink = _sink(rank_dir)
    with caplog.at_level(logging.WARNING, logger="trainmon.sinks.csv"):
        for step in range(5):
            sink.write(StepRows.of([_row("a", step=step), _row("b", step=step)]), step)
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        assert str(rank_dir) in warnings[0].getMessage()
        assert "Not a directory" in warnings[0].getMessage()
        sink.close()
    assert sink.lost_rows == 10
    closing = [r.getMessage() for r in caplog.records][-1]
    assert "10 monitor rows" in closing


def test_disk_full_keeps_other_files_going(tmp_path, caplog):
    # /dev/full answers every write with ENOSPC: a real full-disk error for one file.
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    tmp_path.joinpath("grad_reduced_0-9.csv").symlink_to("/dev/full")
    sink = _sink(tmp_path, step_count_per_record=10)
    with caplog.at_level(logging.WARNING, logger="trainmon.sinks.csv"):
        for step in range(3):
            sink.write(StepRows.of([_row("grad_reduced", step=step), _row("actv", step=step, micro_step=0)]), step)
        sink.close()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2  # the first failure, then the total at close
    assert "No space left" in warnings[0] and "grad_reduced_0-9.csv" in warnings[0]
    assert "3 monitor rows" in warnings[1]
    assert pd.read_csv(tmp_path / "actv_0-9.csv")["step"].tolist() == [0, 1, 2]


_FSIZE_SCRIPT = textwrap.dedent("""
    import logging, resource, signal, sys
    from pathlib import Path
    from trainmon.stats.rows import StatRow, StepRows
    from trainmon.sinks import SinkOptions
    from trainmon.sinks.csv import CsvSink

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # get EFBIG instead of dying
    resource.setrlimit(resource.RLIMIT_FSIZE, (5000, 5000))
    sink = CsvSink(SinkOptions(rank_dir=Path(sys.argv[1]), step_count_per_record=1000))
    for step in range(40):
        sink.write(StepRows.of([StatRow("grad_reduced", f"w{i}", step, {"norm": step + i / 3}, (3, 3), "torch.float32")
                    for i in range(6)]), step)
    sink.close()
    print(sink.lost_rows)
""")


def test_write_cut_short_is_rolled_back(tmp_path):
    # A file size limit makes the kernel accept only part of a step's text, then refuse the
    # rest (EFBIG): the real shape of a disk filling up mid-write.
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", _FSIZE_SCRIPT, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=60, check=True)
    path = tmp_path / "grad_reduced_0-999.csv"
    raw = path.read_bytes()
    assert 4000 < len(raw) <= 5000 and raw.endswith(b"\n")
    df = pd.read_csv(path)
    steps = sorted(set(df["step"]))
    assert steps == list(range(len(steps))) and (df.groupby("step").size() == 6).all()
    assert df["norm"].tolist() == [s + i / 3 for s in steps for i in range(6)]
    assert int(done.stdout) == (40 - len(steps)) * 6
    warnings = [line for line in done.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 2 and "File too large" in warnings[0] and str(path) in warnings[0]


_KILL_SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    from trainmon.stats.rows import StatRow, StepRows
    from trainmon.sinks import SinkOptions
    from trainmon.sinks.csv import CsvSink

    sink = CsvSink(SinkOptions(rank_dir=Path(sys.argv[1]), step_count_per_record=7))
    families = ["grad_reduced", "param_origin", "exp_avg"]
    step = 0
    while True:
        rows = [StatRow(f, f"layer.{i}.weight", step, {"norm": step + i / 3, "mean": 0.1 * i},
                        (i + 1, 3), "torch.float32") for f in families for i in range(200)]
        sink.write(StepRows.of(rows), step)
        print(step, flush=True)   # write() returned: this step must survive the kill
        step += 1
""")


def test_sigkill_keeps_every_returned_step(tmp_path):
    out = tmp_path / "rank0"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", _KILL_SCRIPT, str(out)], stdout=subprocess.PIPE,
                            text=True, env=env)
    last = -1
    try:
        for line in proc.stdout:
            last = int(line)
            if last >= 40:
                break
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    assert last >= 40
    steps_seen = {}
    for path in out.glob("*.csv"):
        raw = path.read_bytes()
        assert raw.endswith(b"\n"), path  # only whole rows
        df = pd.read_csv(path)
        assert df.notna().all().all(), path
        counts = df.groupby("step").size()
        assert (counts == 200).all(), path  # a step's rows of one file arrive together
        family = path.name.rsplit("_", 1)[0]
        steps_seen.setdefault(family, set()).update(counts.index)
    assert len(steps_seen) == 3
    for family, steps in steps_seen.items():
        assert steps == set(range(max(steps) + 1)), family
        assert max(steps) >= last


def test_engine_blocks_and_plain_rows_give_the_same_bytes(tmp_path):
    """The CSV sink formats the engine's columnar blocks without building rows; rows built by hand
    (``StepRows.of``) give exactly the same text (quoting, micro steps, extra columns, ints, nan/inf)."""
    from trainmon.stats.rows import StepRows, RowBlock
    from trainmon.sinks.base import SinkOptions
    from trainmon.sinks.csv import CsvSink

    blocks = [
        RowBlock("actv", 7, 2, None, ("norm", "mean", "nans"), ["a.output", 'odd,"name"'], [0, 1],
                 [(2, 3), ()], ["torch.float32", "torch.bfloat16"], [[1.5, math.nan, 0], [math.inf, -0.0, 3]]),
        RowBlock("comm", 7, None, {"op": "all_reduce", "when": "pre"}, ("norm",), ["x"], [0], [(4,)],
                 ["torch.float32"], [[0.1 + 0.2]]),
        RowBlock("grad_reduced", 7, None, None, ("norm", "min"), ["w", "b"], [0, 0], [(3, 3), (3,)],
                 ["torch.float32"] * 2, [[1e-300, -1e300], [2.0, 5e-324]]),
    ]
    for ndigits in (None, 4):
        out = {}
        for how in ("blocks", "rows"):
            sink = CsvSink(SinkOptions(rank_dir=tmp_path / f"{how}{ndigits}", ndigits=ndigits,
                                       step_count_per_record=5))
            lazy = StepRows(lambda: blocks)
            sink.write(lazy if how == "blocks" else StepRows.of(list(lazy)), 7)
            sink.close()
            out[how] = {p.name: p.read_bytes() for p in sorted((tmp_path / f"{how}{ndigits}").iterdir())
                        if p.name != "step_times.tsv"}  # family files (the step times are when each was written)
        assert out["blocks"] == out["rows"] and len(out["rows"]) == 3, out
