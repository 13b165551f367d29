"""``trainmon.load_run``: a whole run as one DataFrame, checked against its files read one by one.

The truth is each file read on its own with plain pandas (CSV) or pyarrow (Parquet), tagged with
its rank and family and concatenated; ``load_run`` must equal it row for row, value for value
(exact floats), whatever the format, filter or engine.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import trainmon
from trainmon.errors import DamagedFileError
from trainmon.output.layout import parse_family_file, parse_rank_dir
from trainmon.output.load import LoadRunError
from trainmon.testing.synthetic_run import SyntheticRun

LEAD = ["rank", "family", "name", "step", "micro_step", "vpp_stage"]
TEXT = ("name", "shape", "dtype")
NAN_TEXT = ["nan", "NaN", "-nan", ""]
ENGINES = ["pandas", "duckdb"]


# ----------------------------------------------------------------------------- the truth


def _read_one(path: Path) -> pd.DataFrame:
    """One family file, read without trainmon."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pandas()
    return pd.read_csv(path, dtype=dict.fromkeys(TEXT, str), keep_default_na=False, na_values=NAN_TEXT)


def expected(run: Path, ext: str) -> pd.DataFrame:
    """Every ``ext`` file of the run: by rank, family, then step (file order kept within a step)."""
    frames = []
    for rank_dir in sorted(
        (p for p in run.iterdir() if parse_rank_dir(p.name) is not None), key=lambda p: parse_rank_dir(p.name)
    ):
        by_family: dict[str, list[Path]] = {}
        for p in sorted(rank_dir.glob(f"*.{ext}")):
            f = parse_family_file(p)
            if f is not None:
                by_family.setdefault(f.family, []).append(p)
        for family in sorted(by_family):
            files = sorted(by_family[family], key=lambda p: (parse_family_file(p).start, parse_family_file(p).part))
            df = pd.concat([_read_one(p) for p in files], ignore_index=True)
            df = df.sort_values("step", kind="stable", ignore_index=True)
            df.insert(0, "family", family)
            df.insert(0, "rank", parse_rank_dir(rank_dir.name))
            frames.append(df)
    return pd.concat(frames, ignore_index=True)


def assert_same(got: pd.DataFrame, want: pd.DataFrame) -> None:
    """Same rows in the same order, same values (floats bit for bit, NaN = NaN)."""
    assert list(got.columns[:6]) == LEAD and list(got.columns[-2:]) == ["shape", "dtype"]
    if "micro_step" not in want:
        want = want.assign(micro_step=pd.NA)
    assert set(got.columns) == set(want.columns)
    assert len(got) == len(want)
    for c in got.columns:
        g, w = got[c], want[c].reset_index(drop=True)
        if c in TEXT or c == "family" or not pd.api.types.is_numeric_dtype(g.dtype):
            assert g.astype(str).tolist() == w.astype(str).tolist(), c
        elif c == "micro_step":
            assert g.isna().tolist() == w.isna().tolist()
            assert g.dropna().astype(int).tolist() == w.dropna().astype(int).tolist()
        else:
            gv, wv = g.to_numpy(dtype=float), w.to_numpy(dtype=float)
            assert np.array_equal(gv, wv, equal_nan=True), c


def assert_frames_equal(a: pd.DataFrame, b: pd.DataFrame) -> None:
    pd.testing.assert_frame_equal(a, b, check_exact=True)


# ----------------------------------------------------------------------------- runs


def _train(root: Path, fmt, monkeypatch, steps=4, acc=2) -> Path:
    """A real monitored run (TinyGPT, grads, moments, params, activations per micro-step)."""
    import torch

    from trainmon import TrainerMon
    from trainmon.testing.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(root))
    monkeypatch.delenv("TRAINMON_RUN_ID", raising=False)
    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    cfg = root.parent / f"{root.name}.json"
    cfg.write_text(
        json.dumps(
            {
                "wg_distribution": True,
                "mv_distribution": True,
                "param_distribution": True,
                "xy_distribution": True,
                "all_xy": True,
                "format": fmt,
                "ops": ["norm", "mean", "max", "nans"],
                "step_count_per_record": 2,
            }
        )
    )
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with TrainerMon(cfg) as monitor:
        monitor.set_monitor(model, grad_acc_steps=acc, optimizer=opt)
        data = synthetic_batches(model.cfg, 2, steps * acc, seed=1)
        for _ in range(steps):
            for _ in range(acc):
                (model.loss(next(data)) / acc).backward()
            opt.step()
            opt.zero_grad()
    (run,) = [p for p in root.iterdir() if p.is_dir()]
    return run


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory):
    pytest.importorskip("pyarrow")
    base = tmp_path_factory.mktemp("real")
    with pytest.MonkeyPatch.context() as mp:
        return {
            name: _train(base / name, fmt, mp)
            for name, fmt in (("csv", ["csv"]), ("parquet", ["parquet"]), ("both", ["csv", "parquet"]))
        }


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """Three ranks, five step windows, as CSV (and as Parquet when pyarrow is installed)."""
    base = tmp_path_factory.mktemp("synthetic")
    spec = SyntheticRun(
        ranks=3, steps=25, params=6, steps_per_file=5, families=("grad_unreduced", "grad_reduced", "exp_avg")
    )
    out = {"csv": spec.write(base / "csv")}
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return out
    out["parquet"] = spec.write(base / "parquet", "parquet")
    return out


def _need(engine: str) -> None:
    if engine == "duckdb":
        pytest.importorskip("duckdb")


@pytest.fixture
def fallbacks(monkeypatch):
    """Files the DuckDB path handed to pandas' read (a spy: the real function runs).  A clean run
    read with ``engine="duckdb"`` must need none, or DuckDB's read would go untested."""
    import trainmon.output.load as load

    seen: list = []
    real = load._pandas_fallback
    monkeypatch.setattr(load, "_pandas_fallback", lambda files, *a: seen.extend(files) or real(files, *a))
    return seen


# ----------------------------------------------------------------------------- whole runs


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_a_real_run_equals_its_files_in_csv_parquet_and_both(real_runs, engine, fallbacks):
    _need(engine)
    csv_rows = expected(real_runs["csv"], "csv")
    assert {"actv", "actv_grad", "grad_reduced", "exp_avg", "param_origin"} <= set(csv_rows["family"])
    for name, ext in (("csv", "csv"), ("parquet", "parquet"), ("both", "parquet")):
        got = trainmon.load_run(real_runs[name], engine=engine)
        assert_same(got, expected(real_runs[name], ext))
    # the same training written three ways: the same frame (a run in both formats read once)
    assert_frames_equal(
        trainmon.load_run(real_runs["parquet"], engine=engine), trainmon.load_run(real_runs["both"], engine=engine)
    )
    assert fallbacks == []
    assert_frames_equal(
        trainmon.load_run(real_runs["csv"], engine=engine), trainmon.load_run(real_runs["both"], engine=engine)
    )


@pytest.mark.slow
def test_micro_step_is_an_integer_only_where_the_family_has_it(real_runs):
    df = trainmon.load_run(real_runs["csv"], engine="pandas")
    assert str(df["micro_step"].dtype) == "Int64"
    per_micro = df["family"].isin(["actv", "actv_grad"])
    assert sorted(df.loc[per_micro, "micro_step"].unique().tolist()) == [0, 1]
    assert df.loc[~per_micro, "micro_step"].isna().all()
    assert df["rank"].dtype == df["step"].dtype == df["vpp_stage"].dtype == np.int64
    assert df["norm"].dtype == df["nans"].dtype == np.float64


@pytest.mark.slow
def test_a_window_only_the_csv_holds_is_read_from_the_csv(real_runs, tmp_path):
    # after a crash the Parquet sink has not written the open window: the CSV files are read
    run = tmp_path / "run"
    for p in real_runs["both"].rglob("*"):
        if p.is_file():
            (run / p.relative_to(real_runs["both"])).parent.mkdir(parents=True, exist_ok=True)
            (run / p.relative_to(real_runs["both"])).write_bytes(p.read_bytes())
    (run / "rank0" / "grad_reduced_2-3.parquet").unlink()
    got = trainmon.load_run(run, families="grad_reduced", engine="pandas")
    assert_same(got, expected(run, "csv").query("family == 'grad_reduced'"))


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
@pytest.mark.parametrize("engine", ENGINES)
def test_a_multi_rank_run_equals_its_files(synthetic, fmt, engine):
    _need(engine)
    if fmt not in synthetic:
        pytest.importorskip("pyarrow")
    got = trainmon.load_run(synthetic[fmt], engine=engine)
    assert sorted(got["rank"].unique()) == [0, 1, 2]
    assert_same(got, expected(synthetic[fmt], fmt))


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_duckdb_and_pandas_give_equal_frames(synthetic, fmt, fallbacks):
    pytest.importorskip("duckdb")
    if fmt not in synthetic:
        pytest.importorskip("pyarrow")
    for kw in ({}, {"steps": range(7, 13), "names": ["layers.1.bias", "layers.2.weight"]}, {"steps": [3, 24]}):
        assert_frames_equal(
            trainmon.load_run(synthetic[fmt], engine="duckdb", **kw),
            trainmon.load_run(synthetic[fmt], engine="pandas", **kw),
        )
    assert fallbacks == []


# ----------------------------------------------------------------------------- filters

FILTERS = [
    ({"families": "grad_reduced"}, lambda d: d["family"] == "grad_reduced"),
    ({"families": ["exp_avg", "grad_unreduced"]}, lambda d: d["family"].isin(["exp_avg", "grad_unreduced"])),
    ({"ranks": 2}, lambda d: d["rank"] == 2),
    ({"ranks": np.int64(1)}, lambda d: d["rank"] == 1),
    ({"ranks": (0, 2)}, lambda d: d["rank"].isin([0, 2])),
    ({"steps": 7}, lambda d: d["step"] == 7),
    ({"steps": range(4, 11)}, lambda d: d["step"].between(4, 10)),
    ({"steps": range(0, 25, 6)}, lambda d: d["step"].isin([0, 6, 12, 18, 24])),
    ({"steps": slice(20, None)}, lambda d: d["step"] >= 20),
    ({"steps": slice(None, 3)}, lambda d: d["step"] < 3),
    ({"steps": {1, 13, 99}}, lambda d: d["step"].isin([1, 13])),
    ({"steps": np.int64(5)}, lambda d: d["step"] == 5),
    ({"names": "layers.0.bias"}, lambda d: d["name"] == "layers.0.bias"),
    ({"names": ["layers.0.bias", "no.such"]}, lambda d: d["name"] == "layers.0.bias"),
    (
        {"families": "grad_reduced", "ranks": [1], "steps": range(9, 16), "names": ("layers.2.weight",)},
        lambda d: (
            (d["family"] == "grad_reduced")
            & (d["rank"] == 1)
            & d["step"].between(9, 15)
            & (d["name"] == "layers.2.weight")
        ),
    ),
    ({"steps": [], "names": None}, lambda d: d["step"] < -1),
]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kw,keep", FILTERS, ids=[str(k) for k, _ in FILTERS])
def test_each_filter_equals_filtering_the_whole_frame(synthetic, engine, kw, keep):
    _need(engine)
    whole = trainmon.load_run(synthetic["csv"], engine="pandas")
    want = whole[keep(whole).to_numpy()].reset_index(drop=True)
    got = trainmon.load_run(synthetic["csv"], engine=engine, **kw)
    if want.empty and got.empty:  # no file to read: the key columns only (documented)
        assert list(got.columns) == [*LEAD, "shape", "dtype"] and set(got.columns) <= set(want.columns)
        return
    assert_frames_equal(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_filters_on_a_micro_step_family(real_runs, engine):
    _need(engine)
    whole = trainmon.load_run(real_runs["both"], engine="pandas")
    name = whole.loc[whole["family"] == "actv", "name"].iloc[0]
    got = trainmon.load_run(real_runs["both"], families="actv", steps=slice(1, 3), names=name, engine=engine)
    keep = (whole["family"] == "actv") & whole["step"].isin([1, 2]) & (whole["name"] == name)
    assert_frames_equal(got, whole[keep.to_numpy()].reset_index(drop=True))
    assert len(got) == 4  # two steps x two micro-steps


@pytest.mark.parametrize("engine", ENGINES)
def test_files_the_filters_exclude_are_never_opened(synthetic, tmp_path, engine):
    _need(engine)
    run = _copy(synthetic["csv"], tmp_path)
    (run / "rank1" / "exp_avg_10-14.csv").write_bytes(b"\0garbage")  # damaged: reading it would raise
    (run / "rank2" / "grad_reduced_10-14.csv").write_bytes(b"\0garbage")
    whole = trainmon.load_run(synthetic["csv"], engine="pandas")
    got = trainmon.load_run(run, steps=range(10), engine=engine)
    assert_frames_equal(got, whole[whole["step"] < 10].reset_index(drop=True))
    got = trainmon.load_run(run, families="grad_unreduced", engine=engine)
    assert_frames_equal(got, whole[whole["family"] == "grad_unreduced"].reset_index(drop=True))
    with pytest.raises(DamagedFileError, match=r"exp_avg_10-14\.csv"):
        trainmon.load_run(run, ranks=1, engine=engine)


# ----------------------------------------------------------------------------- paths and arguments


def test_a_rank_dir_is_that_rank_and_an_output_root_with_one_run_is_that_run(synthetic, tmp_path):
    whole = trainmon.load_run(synthetic["csv"], engine="pandas")
    assert_frames_equal(
        trainmon.load_run(synthetic["csv"] / "rank1", engine="pandas"), whole[whole["rank"] == 1].reset_index(drop=True)
    )
    root = tmp_path / "out"
    _copy(synthetic["csv"], root, "run_a")
    assert_frames_equal(trainmon.load_run(root, engine="pandas"), whole)
    _copy(synthetic["csv"], root, "run_b")
    with pytest.raises(LoadRunError) as err:
        trainmon.load_run(root)
    text = str(err.value)
    assert "\n" not in text and "2 runs" in text and "run_a" in text and "run_b" in text


@pytest.mark.parametrize(
    "kw,words",
    [
        ({"steps": "7"}, "steps='7': steps must be an int, a range, a slice"),
        ({"steps": [1, "x"]}, "steps=[1, 'x']"),
        ({"steps": range(0, 9, 2)[::-1]}, None),
        ({"steps": slice(0, 10, 2)}, "steps=slice(0, 10, 2)"),
        ({"ranks": "0"}, "ranks=['0']: must be an int or an iterable of them"),
        ({"ranks": 7}, "has no rank 7 (ranks held: 0, 1, 2)"),
        ({"families": "grad_reduce"}, "no family 'grad_reduce' (families held: exp_avg, grad_reduced, grad_unreduced)"),
        ({"engine": "spark"}, "engine='spark': must be one of auto, duckdb, pandas"),
    ],
)
def test_a_bad_argument_is_one_line_naming_it(synthetic, kw, words):
    if words is None:  # a descending range is an iterable of ints: allowed
        got = trainmon.load_run(synthetic["csv"], engine="pandas", **kw)
        assert sorted(got["step"].unique()) == [0, 2, 4, 6, 8]
        return
    with pytest.raises(LoadRunError) as err:
        trainmon.load_run(synthetic["csv"], **kw)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_missing_path_or_a_folder_without_runs_is_one_line(tmp_path):
    with pytest.raises(LoadRunError, match="no such directory"):
        trainmon.load_run(tmp_path / "nope")
    with pytest.raises(LoadRunError, match="no trainmon run here"):
        trainmon.load_run(tmp_path)


# ----------------------------------------------------------------------------- damaged files


def _copy(run: Path, dest: Path, name: str = "run") -> Path:
    out = dest / name
    for p in run.rglob("*"):
        if p.is_file():
            target = out / p.relative_to(run)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(p.read_bytes())
    return out


def _stat_text(text: str) -> str:
    lines = text.splitlines(keepends=True)
    cells = lines[3].split(",")
    cells[3] = "np.float64(1.5)"  # the norm column of the third row
    lines[3] = ",".join(cells)
    return "".join(lines)


def _empty_step(text: str) -> str:
    head, _, body = text.partition("\n")
    first, _, rest = body.partition("\n")
    cells = first.split(",")
    cells[2] = ""
    return head + "\n" + ",".join(cells) + "\n" + rest


DAMAGE = {
    "stat text": (_stat_text, "'np.float64(1.5)' is not a number"),
    "empty step": (_empty_step, "an empty cell is not an integer"),
    "NUL byte": (lambda t: "\0" + t, "NUL byte"),
    "empty file": (lambda t: "", "empty file"),
    "foreign header": (lambda t: "a,b,c\n" + t, "not a trainmon header"),
}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_csv_file_is_one_error_naming_it(synthetic, tmp_path, engine, kind):
    _need(engine)
    damage, words = DAMAGE[kind]
    run = _copy(synthetic["csv"], tmp_path)
    target = run / "rank1" / "grad_reduced_5-9.csv"
    target.write_text(damage(target.read_text()))
    for kw in ({}, {"names": "layers.5.bias"}):  # reported whether or not the damaged row is asked for
        with pytest.raises(DamagedFileError) as err:
            trainmon.load_run(run, engine=engine, **kw)
        msg = str(err.value)
        assert msg.startswith(str(target)) and words in msg and "\n" not in msg, msg


@pytest.mark.parametrize("engine", ENGINES)
def test_a_damaged_parquet_file_is_one_error_naming_it(synthetic, tmp_path, engine):
    _need(engine)
    if "parquet" not in synthetic:
        pytest.importorskip("pyarrow")
    run = _copy(synthetic["parquet"], tmp_path)
    target = run / "rank0" / "exp_avg_15-19.parquet"
    target.write_bytes(target.read_bytes()[:-100])  # cut short
    with pytest.raises(DamagedFileError) as err:
        trainmon.load_run(run, engine=engine)
    msg = str(err.value)
    assert msg.startswith(str(target)) and "not a readable Parquet file" in msg and "\n" not in msg


@pytest.mark.parametrize("engine", ENGINES)
def test_a_last_line_cut_short_is_left_out_with_a_warning_by_both_engines(synthetic, tmp_path, engine, caplog):
    _need(engine)
    run = _copy(synthetic["csv"], tmp_path)
    target = run / "rank0" / "grad_reduced_20-24.csv"
    target.write_bytes(target.read_bytes()[:-25])  # the last row loses its end: "0.12" of "0.1234..."
    whole = trainmon.load_run(synthetic["csv"], engine="pandas")
    last = whole[(whole["family"] == "grad_reduced") & (whole["rank"] == 0)].index[-1]
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        got = trainmon.load_run(run, engine=engine)
    assert_frames_equal(got, whole.drop(index=last).reset_index(drop=True))
    assert any("grad_reduced_20-24.csv" in r.getMessage() and "cut short" in r.getMessage() for r in caplog.records)


def test_auto_uses_duckdb_only_for_big_selections(synthetic, monkeypatch):
    pytest.importorskip("duckdb")
    import trainmon.output.load as load

    seen = []
    real = load._duckdb_read
    monkeypatch.setattr(load, "_duckdb_read", lambda *a, **k: seen.append(1) or real(*a, **k))
    small = trainmon.load_run(synthetic["csv"])
    assert not seen
    monkeypatch.setattr(load, "DUCKDB_FROM_BYTES", 1)
    assert_frames_equal(trainmon.load_run(synthetic["csv"]), small)
    assert seen


ODD_NAMES = ['w,"odd" name', "NA", "null", "line\nbreak", "é.ü"]


def _odd_rows(step: int):
    from trainmon.stats.rows import StatRow

    rows = [
        StatRow(
            "grad_reduced",
            name,
            step,
            {
                "norm": 0.1 * (i + 1) + step / 3,
                "min": float("-inf") if i == 0 else -1e-310,
                "max": float("nan") if i == 1 else 2.0 / 3.0,
                "nans": i,
            },
            (4, i + 1),
            "torch.float32",
        )
        for i, name in enumerate(ODD_NAMES)
    ]
    # a family with an ``extra`` column (read by pandas on both engines), per micro-step
    rows += [
        StatRow(
            "actv",
            f"block.{i}.output",
            step,
            {"norm": 1.0 / (i + 3), "min": 0.0, "max": 1.5, "nans": 0},
            (2,),
            "torch.bfloat16",
            micro_step=m,
            extra={"tag": "fwd"},
        )
        for i in range(2)
        for m in range(2)
    ]
    return rows


@pytest.mark.parametrize("formats", [["csv"], ["parquet"], ["csv", "parquet"]])
@pytest.mark.parametrize("engine", ENGINES)
def test_odd_names_infinities_and_extra_columns_read_alike(tmp_path, formats, engine, fallbacks):
    _need(engine)
    if "parquet" in formats:
        pytest.importorskip("pyarrow")
    from trainmon.sinks import SinkOptions, create_sink
    from trainmon.stats.rows import StepRows

    run = tmp_path / "run"
    for rank in (0, 1):
        sink = create_sink(list(formats), SinkOptions(rank_dir=run / f"rank{rank}", step_count_per_record=2))
        for s in range(5):
            sink.write(StepRows.of(_odd_rows(s)), step=s)
        sink.close()
    got = trainmon.load_run(run, engine=engine)
    assert_same(got, expected(run, "parquet" if "parquet" in formats else "csv"))
    assert set(got["name"]) >= set(ODD_NAMES) and list(got.columns).index("tag") == 6
    assert_frames_equal(got, trainmon.load_run(run, engine="pandas"))
    odd = trainmon.load_run(run, names=ODD_NAMES[0], steps=[1, 4], engine=engine)
    assert odd["name"].tolist() == [ODD_NAMES[0]] * 4 and odd["step"].tolist() == [1, 4, 1, 4]
    assert fallbacks == []


def _gloo_rank(rank, world, cfg):
    """A DDP rank on gloo: 4 steps of 2 micro-batches (the first under ``no_sync``)."""
    import contextlib
    import os

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests._support.dist_checks import batch, micro, tiny_model
    from trainmon import TrainerMon

    os.environ["TRAINMON_RUN_ID"] = "gloo"
    ddp = DDP(tiny_model())
    opt = torch.optim.Adam(ddp.parameters(), lr=0.05)
    with TrainerMon(cfg) as mon:
        mon.set_monitor(ddp, optimizer=opt, grad_acc_steps=2)
        for step in range(4):
            x, y = batch(step, world * 2 * 4)
            for k in range(2):
                xb, yb = micro(x, y, world, 2, rank, k)
                with ddp.no_sync() if k == 0 else contextlib.nullcontext():
                    torch.nn.functional.mse_loss(ddp(xb), yb).backward()
            opt.step()
            opt.zero_grad()


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_a_real_gloo_run_equals_its_files_on_every_rank(output_root, tmp_path, engine):
    pytest.importorskip("pyarrow")
    _need(engine)
    from tests._support.distributed import run_distributed

    cfg = tmp_path / "gloo.json"
    cfg.write_text(
        json.dumps(
            {
                "wg_distribution": True,
                "mv_distribution": True,
                "xy_distribution": True,
                "all_xy": True,
                "format": ["csv", "parquet"],
                "ops": ["norm", "min", "nans"],
                "step_count_per_record": 3,
            }
        )
    )
    run_distributed(_gloo_rank, world_size=2, timeout=180, args=(cfg,))
    run = output_root / "gloo"
    got = trainmon.load_run(output_root, engine=engine)  # the output root holds this one run
    assert sorted(got["rank"].unique()) == [0, 1] and "actv" in set(got["family"])
    assert_same(got, expected(run, "parquet"))
    assert_same(got, expected(run, "csv"))
    pre = trainmon.load_run(run, families="grad_unreduced", steps=[1, 3], engine=engine)
    whole = got[(got["family"] == "grad_unreduced") & got["step"].isin([1, 3])].reset_index(drop=True)
    assert_frames_equal(pre, whole)
