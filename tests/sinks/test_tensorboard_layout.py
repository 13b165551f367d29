"""The TensorBoard sink's default "summary" layout, histograms, step loss, custom-scalars layout,
HParams record and wall times: real event files read back with TensorBoard's own
EventAccumulator, compared with values computed here from the rows (or the CSV) with numpy."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from tests.sinks.test_tensorboard import (
    PER_TENSOR,
    assert_same_scalars,
    assert_same_summary,
    expected_scalars,
    expected_summary_from_csv,
    f32,
    family_rows,
    load_accumulator,
    load_scalars,
    tb_dir,
    write_rows,
)
from trainmon.output.layout import parse_step_times, step_time_line
from trainmon.output.tb_tags import TensorBoardSettings
from trainmon.sinks import SinkOptions
from trainmon.sinks.async_writer import AsyncSink, FanoutSink
from trainmon.sinks.csv import CsvSink
from trainmon.sinks.tensorboard import TensorBoardSink
from trainmon.stats.rows import StatRow, StepRows

pytest.importorskip("tensorboard")

BOUNDS_LABELS = ("(-inf, -1]", "(-1, 0]", "(0, 1]", "(1, inf)", "=0")


def csv_and_tb(rank_dir: Path, settings: TensorBoardSettings | None = None, **kw):
    options = SinkOptions(rank_dir=rank_dir, **kw)
    return AsyncSink(FanoutSink([CsvSink(options), TensorBoardSink(options, settings)], options))


def probe_rows(step: int, n: int = 4) -> list[StatRow]:
    rng = np.random.default_rng(100 + step)
    rows = []
    for i in range(n):
        p = rng.dirichlet(np.ones(4))
        stats = dict(zip(BOUNDS_LABELS, [*p.tolist(), float(rng.uniform(0, 0.1))]))
        rows.append(StatRow("grad_probe", f"layers.{i}.w", step, stats, (8 + i, 16), "torch.float32"))
    return rows


def loss_rows(step: int, micro: range) -> list[StatRow]:
    return [StatRow("loss", "loss", step, {"loss": 2.0 / (1 + step) + 0.1 * m + 1e-9 * step}, (), "torch.float32",
                    micro_step=m) for m in micro]


# ---------------------------------------------------------------------------------------------
def test_default_layout_is_summary_series_equal_to_the_csv(tmp_path):
    run = tmp_path / "run"
    sink = csv_and_tb(run / "rank0", step_count_per_record=2)
    write_rows(sink, steps=5, n_params=6)
    sink.close()
    got = load_scalars(tb_dir(run))
    want = expected_summary_from_csv(run / "rank0")
    assert_same_summary(got, want)
    assert not [t for t in got if "/vp" in t]            # no per-tensor series unless asked for
    # the aggregates over the SPECIAL values: inf in a tensor is the max and counts as non-finite
    assert any(v == math.inf for tag, series in got.items() if tag.endswith("/max") for _, v in series)
    assert any(v > 0 for tag, series in got.items() if tag.endswith("/nonfinite") for _, v in series)


def test_tag_count_does_not_grow_with_the_model():
    """The per-tensor layout grows with the tensors; the summary layout only with families x ops."""
    def tags(n_params: int, settings) -> set[str]:
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            sink = TensorBoardSink(SinkOptions(rank_dir=Path(d) / "rank0"), settings)
            write_rows(sink, steps=1, n_params=n_params, micro_steps=2)
            sink.close()
            return set(load_accumulator(Path(d) / "tensorboard" / "rank0").Tags()["scalars"])

    small, large = tags(3, None), tags(60, None)
    # 10 families x 8 ops: 245 series whatever the model's size
    assert small == large and len(large) < 250
    assert len(tags(60, PER_TENSOR)) > 10 * len(large)


def test_histograms_hold_every_finite_value_of_the_family(tmp_path):
    run = tmp_path / "run"
    sink = TensorBoardSink(SinkOptions(rank_dir=run / "rank0"))
    rows = write_rows(sink, steps=3, n_params=7, micro_steps=2)
    sink.close()
    acc = load_accumulator(tb_dir(run))
    histograms = acc.Tags()["histograms"]
    assert "grad_reduced.norm/layers" in histograms and "actv.max/layers" in histograms
    assert not [t for t in histograms if t.split("/")[0].endswith((".nans", ".infs"))]   # counts: no histogram
    checked = 0
    for tag in histograms:
        family, op = tag.split("/")[0].split(".", 1)
        for event in acc.Histograms(tag):
            x = np.array([r.stats[op] for r in rows if r.family == family and r.step == event.step], np.float64)
            x = x[np.isfinite(x)]
            h = event.histogram_value
            assert h.num == x.size and h.min == x.min() and h.max == x.max(), tag
            assert h.sum == pytest.approx(math.fsum(x), rel=1e-12, abs=1e-300)
            limits = np.array(h.bucket_limit)
            assert limits[-1] == x.max() and len(limits) <= 30
            # bucket i holds (limit[i-1], limit[i]]: recount the values with numpy
            recount = np.bincount(np.searchsorted(limits, x, side="left"), minlength=len(limits))
            assert recount.tolist() == list(h.bucket), tag
            checked += 1
    assert checked >= 3 * 30


def test_grad_probe_intervals_histogram_counts_grad_elements(tmp_path):
    run = tmp_path / "run"
    sink = TensorBoardSink(SinkOptions(rank_dir=run / "rank0"))
    for step in range(2):
        sink.write(StepRows.of(probe_rows(step)), step)
    sink.close()
    acc = load_accumulator(tb_dir(run))
    events = acc.Histograms("grad_probe/intervals")
    assert [e.step for e in events] == [0, 1]
    for e in events:
        rows = probe_rows(e.step)
        want = [sum(r.stats[label] * r.shape[0] * r.shape[1] for r in rows) for label in BOUNDS_LABELS[:4]]
        h = e.histogram_value
        assert list(h.bucket) == pytest.approx(want, rel=1e-12)
        # the open ends get the width of the bounds' span: (-3, -1], (-1, 0], (0, 1], (1, 3]
        assert (h.min, *h.bucket_limit) == (-3.0, -1.0, 0.0, 1.0, 3.0)
        assert h.num == pytest.approx(sum(want), rel=1e-12)
    # and the interval columns are summarized like any statistic
    got = load_scalars(tb_dir(run))
    assert got["grad_probe.(0, 1]/max"][0] == (0, f32(max(r.stats["(0, 1]"] for r in probe_rows(0))))


def test_step_loss_is_the_mean_of_the_micro_batches_including_late_ones(tmp_path):
    run = tmp_path / "run"
    sink = csv_and_tb(run / "rank0")
    for step in range(4):
        # micro-batches 0-2 with the step's rows, micro-batch 3 recorded after the optimizer step
        sink.write(StepRows.of(family_rows(step) + loss_rows(step, range(3)), wall_time=100.0 + step), step)
        sink.write(StepRows.of(loss_rows(step, range(3, 4)), wall_time=100.5 + step), step)
    sink.close()
    acc = load_accumulator(tb_dir(run))
    step_loss = acc.Scalars("loss.loss/step")
    assert [e.step for e in step_loss] == [0, 1, 2, 3]                       # once per step
    for e in step_loss:
        losses = [r.stats["loss"] for r in loss_rows(e.step, range(4))]
        assert e.value == f32(np.mean(np.array(losses, np.float64)))
        assert e.wall_time == 100.0 + e.step                                  # when the step was recorded
    micro = {t for t in acc.Tags()["scalars"] if t.startswith("loss.loss/vp0")}
    assert micro == {f"loss.loss/vp0:loss:micro{m}" for m in range(4)}        # per micro-batch too


def test_names_select_per_tensor_series_besides_the_summary(tmp_path):
    run = tmp_path / "run"
    settings = TensorBoardSettings(names=["layers.1.*"])
    sink = TensorBoardSink(SinkOptions(rank_dir=run / "rank0"), settings)
    rows = write_rows(sink, steps=3, n_params=4)
    sink.close()
    got = load_scalars(tb_dir(run))
    per_tensor = {t: v for t, v in got.items() if "/vp" in t}
    want = expected_scalars(r for r in rows if r.name.startswith("layers.1."))
    assert_same_scalars(per_tensor, want)
    assert "grad_reduced.norm/global" in got


def test_custom_scalars_layout_charts_every_family_and_op(tmp_path):
    from tensorboard.plugins.custom_scalar import layout_pb2

    run = tmp_path / "run"
    sink = TensorBoardSink(SinkOptions(rank_dir=run / "rank0"))
    rows = write_rows(sink, steps=2)
    sink.write(StepRows.of(loss_rows(2, range(2))), 2)      # a family appearing later: the layout grows
    sink.close()
    acc = load_accumulator(tb_dir(run))
    assert acc.PluginTagToContent("custom_scalars")
    events = acc.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(events[-1].tensor_proto.string_val[0])
    categories = {c.title: [(ch.title, list(ch.multiline.tag)) for ch in c.chart] for c in layout.category}
    ops = {}
    for r in rows + loss_rows(2, range(2)):
        ops.setdefault(r.family, dict.fromkeys(r.stats))
    for family, family_ops in ops.items():
        assert [t for t, _ in categories[family]] == [f"{family}.{op}" for op in family_ops]
    before_after = [t for t, _ in categories["grad: before vs after the reduce"]]
    assert before_after[:4] == ["grad_unreduced.norm", "grad_reduced.norm", "grad_unreduced.mean", "grad_reduced.mean"]
    tags = acc.Tags()["scalars"]
    for charts in categories.values():                       # every chart shows what it names, nothing else
        for title, (regex,) in charts:
            matched = [t for t in tags if re.match(regex, t)]
            assert matched and all(t.split("/")[0] == title for t in matched), title


def test_hparams_record_the_runs_config(tmp_path):
    from tensorboard.plugins.hparams import plugin_data_pb2

    config = {"ops": ["norm", "max"], "wg_distribution": True, "ndigits": None,
              "grad_probe": {"grad_level": "L1", "bounds": [-1, 0, 1]}, "step_count_per_record": 10}
    (tmp_path / "config.json").write_text(json.dumps(config))
    run = tmp_path / "run_x"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"run_id": "run_x", "world_size": 2, "started": "2026-01-02T03:04:05+0000",
                                              "config_file": str(tmp_path / "config.json")}))
    sink = TensorBoardSink(SinkOptions(rank_dir=run / "rank1", rank=1))
    write_rows(sink, steps=2)
    sink.close()
    acc = load_accumulator(tb_dir(run, 1))
    content = acc.PluginTagToContent("hparams")
    data = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    info = data.session_start_info
    values = {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind")) for k, v in info.hparams.items()}
    assert values == {"ops": '["norm", "max"]', "wg_distribution": True, "ndigits": "null",
                      "grad_probe.grad_level": "L1", "grad_probe.bounds": "[-1, 0, 1]",
                      "step_count_per_record": 10.0, "run_id": "run_x", "world_size": 2.0}
    assert info.group_name == "run_x" and info.start_time_secs == 1767323045.0


def test_no_run_json_no_hparams(tmp_path):
    sink = TensorBoardSink(SinkOptions(rank_dir=tmp_path / "run" / "rank0"))
    write_rows(sink, steps=1)
    sink.close()
    assert load_accumulator(tb_dir(tmp_path / "run")).PluginTagToContent("custom_scalars")
    from tensorboard.backend.event_processing import event_accumulator as ea
    acc = load_accumulator(tb_dir(tmp_path / "run"))
    with pytest.raises(KeyError):
        acc.PluginTagToContent("hparams")
    assert ea  # the accumulator API used above


def test_events_and_step_times_carry_the_recorded_wall_time(tmp_path):
    run = tmp_path / "run"
    sink = csv_and_tb(run / "rank0")
    stamps = {step: 1_700_000_000.123456 + 7.25 * step for step in range(4)}
    for step, stamp in stamps.items():
        sink.write(StepRows.of(family_rows(step), wall_time=stamp), step)
    sink.close()
    assert parse_step_times((run / "rank0" / "step_times.tsv").read_text()) == stamps
    acc = load_accumulator(tb_dir(run))
    for tag in ("grad_reduced.norm/global", "actv.max/max"):
        assert {e.step: e.wall_time for e in acc.Scalars(tag)} == stamps
    assert {e.step: e.wall_time for e in acc.Histograms("exp_avg.mean/layers")} == stamps


def test_step_rows_are_stamped_when_made():
    import time

    before = time.time()
    rows = StepRows.of([])
    assert before <= rows.wall_time <= time.time()


def test_step_times_file_contract():
    text = step_time_line(3, 1.5) + step_time_line(4, 1700000000.000001) + step_time_line(3, 9.0) + "5\t17000"
    assert parse_step_times(text) == {3: 1.5, 4: 1700000000.000001}     # first time wins; a cut line is skipped
    assert parse_step_times("junk\n\n7\tx\n") == {}


@pytest.mark.parametrize("bad, message", [
    ({"tags": "per_tensr"}, "tensorboard.tags: 'per_tensr' is not a tag layout (did you mean 'per_tensor'? allowed"),
    ({"names": [""]}, "tensorboard.names"),
    ({"histograms": "yes"}, "tensorboard.histograms"),
])
def test_settings_are_checked(bad, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        TensorBoardSettings(**bad)


def test_ndigits_summary_is_of_the_rounded_csv_cells(tmp_path):
    run = tmp_path / "run"
    sink = csv_and_tb(run / "rank0", ndigits=3)
    write_rows(sink, steps=2, n_params=5)
    sink.close()
    assert_same_summary(load_scalars(tb_dir(run)), expected_summary_from_csv(run / "rank0"))


def test_a_failing_layout_record_is_one_warning_and_the_values_are_written(tmp_path, monkeypatch, caplog):
    import logging

    import trainmon.sinks.tensorboard as tb

    def broken(*args):
        raise RuntimeError("no custom scalars plugin here")

    monkeypatch.setattr(tb, "custom_scalars_value", broken)            # fault injection
    run = tmp_path / "run"
    sink = TensorBoardSink(SinkOptions(rank_dir=run / "rank0"))
    with caplog.at_level(logging.WARNING, logger="trainmon.sinks.tensorboard"):
        sink.write(StepRows.of(family_rows(0)), 0)
        sink.write(StepRows.of(family_rows(1) + loss_rows(1, range(1))), 1)   # grows: tried again, not logged again
        sink.close()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "the custom-scalars layout of" in warnings[0] and "no custom scalars" in warnings[0]
    assert [s for s, _ in load_scalars(tb_dir(run))["grad_reduced.norm/global"]] == [0, 1]


@pytest.mark.parametrize("n_params, at_most", [(30, 0.5), (400, 0.1)])
def test_event_files_are_smaller_than_the_csv_of_the_same_rows(tmp_path, n_params, at_most):
    """The default layout's events against the CSV family files of the same steps (the demo's size
    with every family and 8 ops; a 400-tensor run with 7 families and 4 ops)."""
    from tests.sinks.test_tensorboard_server import write_run

    run = tmp_path / "run"
    if n_params == 400:
        write_run(run, n_params, steps=3)
    else:
        sink = csv_and_tb(run / "rank0", step_count_per_record=100)
        write_rows(sink, steps=5, n_params=n_params)
        sink.close()
    csv_bytes = sum(p.stat().st_size for p in (run / "rank0").glob("*_*-*.csv"))
    event_bytes = sum(p.stat().st_size for p in tb_dir(run).iterdir())
    assert event_bytes <= at_most * csv_bytes, (event_bytes, csv_bytes)


@pytest.mark.slow  # a training run
@pytest.mark.parametrize("block, per_tensor_names, summary", [
    ({}, set(), True),
    ({"names": ["output.*"]}, {"output.weight"}, True),
    ({"tags": "per_tensor"}, None, False),
])
def test_the_tensorboard_config_block_reaches_the_sink(tmp_path, output_root, make_config, block, per_tensor_names,
                                                       summary):
    import torch

    from trainmon import TrainerMon, seed_all
    from trainmon.testing.tiny_gpt import GPTConfig, TinyGPT, train

    extra = {"tensorboard": block} if block else {}
    config = make_config(wg_distribution=True, format=["csv", "tensorboard"], **extra)
    seed_all(0)
    model = TinyGPT(GPTConfig(layers=1))
    optimizer = torch.optim.AdamW(model.parameters())
    with TrainerMon(config) as monitor:
        monitor.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)
        train(model, optimizer, steps=2, grad_acc_steps=1)
    tags = load_scalars(tb_dir(monitor.run_dir))
    names = {t.split(":", 1)[1] for t in tags if "/vp" in t}
    assert ("grad_reduced.norm/global" in tags) is summary
    if per_tensor_names is not None:
        assert names == per_tensor_names
    else:
        assert len(names) == sum(1 for _ in model.parameters())


def test_a_bad_tensorboard_block_is_a_config_error_naming_the_key(tmp_path, output_root, make_config):
    import torch

    from trainmon import ConfigError, TrainerMon

    config = make_config(wg_distribution=True, format=["tensorboard"], tensorboard={"tags": "per_tensr"})
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=re.escape("tensorboard.tags: 'per_tensr' is not a tag layout (did you "
                                                    "mean 'per_tensor'?")), TrainerMon(config) as monitor:
        monitor.set_monitor(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
