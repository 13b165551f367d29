"""``csv2tb`` in the default summary layout: the same events as the native sink (scalars, histograms,
custom-scalars layout, HParams), stamped with the wall times the run recorded (step_times.tsv)."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from tests.sinks.test_tensorboard import (
    assert_same_scalars,
    assert_same_summary,
    expected_scalars,
    expected_summary_from_csv,
    family_rows,
    load_accumulator,
    load_scalars,
    tb_dir,
)
from tests.sinks.test_tensorboard_layout import loss_rows, probe_rows
from trainmon.cli import main
from trainmon.cli.csv2tb import CONVERTED_NAME
from trainmon.output.layout import parse_step_times
from trainmon.sinks import SinkOptions, create_sink
from trainmon.stats.rows import StepRows

pytest.importorskip("tensorboard")

STAMPS = {step: 1_700_000_000.5 + 13.125 * step for step in range(5)}


def write_run(run: Path, formats=("csv", "tensorboard"), config: dict | None = None) -> list:
    if config is not None:
        run.mkdir(parents=True, exist_ok=True)
        (run.parent / "config.json").write_text(json.dumps(config))
        (run / "run.json").write_text(json.dumps({"run_id": run.name, "world_size": 1,
                                                  "config_file": str(run.parent / "config.json")}))
    sink = create_sink(list(formats), SinkOptions(rank_dir=run / "rank0", step_count_per_record=2))
    written = []
    for step, stamp in STAMPS.items():
        rows = family_rows(step) + probe_rows(step) + loss_rows(step, range(2))
        sink.write(StepRows.of(rows, wall_time=stamp), step)
        written.extend(rows)
    sink.close()
    return written


def events(acc) -> dict:
    """Every scalar and histogram event by tag: (step, wall time, value)."""
    out = {}
    for tag in acc.Tags()["scalars"]:
        out[tag] = sorted((e.step, e.wall_time, e.value) for e in acc.Scalars(tag))
    for tag in acc.Tags()["histograms"]:
        out[tag] = sorted((e.step, e.wall_time, str(e.histogram_value)) for e in acc.Histograms(tag))
    return out


def same_events(a: dict, b: dict) -> bool:
    def norm(v):
        return "nan" if isinstance(v, float) and math.isnan(v) else v
    return {t: [tuple(map(norm, e)) for e in s] for t, s in a.items()} == \
        {t: [tuple(map(norm, e)) for e in s] for t, s in b.items()}


def test_converted_events_equal_the_native_ones_with_the_runs_wall_times(tmp_path):
    from tensorboard.plugins.custom_scalar import layout_pb2

    run = tmp_path / "out" / "run1"
    write_run(run, config={"ops": ["norm"], "wg_distribution": True})
    assert main(["csv2tb", str(run), "-o", str(tmp_path / "conv"), "--no-progress"]) == 0
    native, converted = load_accumulator(tb_dir(run)), load_accumulator(tmp_path / "conv" / "run1" / "rank0")
    native_events, converted_events = events(native), events(converted)
    assert same_events(converted_events, native_events)
    # every event at the time the run recorded its step, not the conversion's
    walls = {(step, wall) for series in converted_events.values() for step, wall, _ in series}
    assert walls == set(STAMPS.items())
    assert parse_step_times((run / "rank0" / "step_times.tsv").read_text()) == STAMPS
    # the same custom-scalars layout and HParams record
    for acc_a, acc_b in ((native, converted),):
        la, lb = (layout_pb2.Layout.FromString(a.Tensors("custom_scalars__config__")[-1].tensor_proto.string_val[0])
                  for a in (acc_a, acc_b))
        assert la == lb and la.category
        assert acc_a.PluginTagToContent("hparams") == acc_b.PluginTagToContent("hparams")
    assert_same_summary(load_scalars(tmp_path / "conv" / "run1" / "rank0"), expected_summary_from_csv(run / "rank0"))


def test_a_run_without_step_times_converts_with_the_conversion_time(tmp_path):
    run = tmp_path / "run1"
    written = write_run(run, formats=("csv",))
    (run / "rank0" / "step_times.tsv").unlink()                 # as a run written before step times
    before = time.time()
    assert main(["csv2tb", str(run), "--tags", "per_tensor", "--no-progress"]) == 0
    after = time.time()
    acc = load_accumulator(tb_dir(run))
    walls = {e.wall_time for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    assert len(walls) == 1 and before <= walls.pop() <= after
    assert_same_scalars({t: v for t, v in load_scalars(tb_dir(run)).items() if t != "loss.loss/step"},
                        expected_scalars(written))


def test_a_parquet_run_records_its_step_times_too(tmp_path):
    pytest.importorskip("pyarrow")
    run = tmp_path / "run1"
    write_run(run, formats=("parquet",))
    assert not list((run / "rank0").glob("*.csv"))
    assert parse_step_times((run / "rank0" / "step_times.tsv").read_text()) == STAMPS
    assert main(["csv2tb", str(run), "--no-progress"]) == 0
    acc = load_accumulator(tb_dir(run))
    assert {(e.step, e.wall_time) for e in acc.Scalars("grad_reduced.norm/global")} == set(STAMPS.items())


def test_names_and_no_histograms(tmp_path):
    run = tmp_path / "run1"
    written = write_run(run, formats=("csv",))
    assert main(["csv2tb", str(run), "--names", "layers.2.*", "--names", "nothing", "--no-histograms",
                 "--no-progress"]) == 0
    acc = load_accumulator(tb_dir(run))
    assert acc.Tags()["histograms"] == []
    got = load_scalars(tb_dir(run))
    per_tensor = {t: v for t, v in got.items() if "/vp" in t and not t.startswith("loss.")}
    assert_same_scalars(per_tensor, expected_scalars(r for r in written if r.name.startswith("layers.2.")))
    assert [p.name for p in tb_dir(run).iterdir()] == [CONVERTED_NAME]


def test_bad_tag_layout_is_exit_2_naming_the_choices(tmp_path, capsys):
    run = tmp_path / "run1"
    write_run(run, formats=("csv",))
    with pytest.raises(SystemExit) as exit_:
        main(["csv2tb", str(run), "--tags", "per-tensor"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "invalid choice: 'per-tensor' (choose from 'summary', 'per_tensor')" in err
    assert not (run / "tensorboard").exists()
