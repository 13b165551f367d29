"""The anomaly rules: spike semantics, online == offline, nonfinite, JSON numbers."""
from __future__ import annotations

import json
import math
import random
import statistics

import pytest

from tests._support.simulate import row, write_run
from trainmon.analysis.rules import Anomaly, Rules, SpikeRule, SpikeTracker, json_number, nonfinite_op
from trainmon.diagnosis.engine_buckets import load_table
from trainmon.diagnosis.scan import scan


def _fired(values, rule=SpikeRule()):
    tracker = SpikeTracker(rule)
    return [i for i, v in enumerate(values) if tracker.observe("s", v) is not None]


def test_spike_needs_warmup_and_fires_both_directions():
    flat = [1.0, 1.1, 0.9, 1.0, 1.05]
    assert _fired([1.0, 1.0, 1.0, 1.0, 50.0]) == []          # only 4 earlier values: warm-up
    assert _fired(flat + [50.0]) == [5]                      # up
    assert _fired(flat + [0.05]) == [5]                      # down (collapse)
    assert _fired(flat + [9.0, 0.12]) == []                  # below 10x either way
    # One spike does not move the median baseline: the next normal value is not an alert.
    assert _fired(flat + [1e4, 1.0, 1.02]) == [5]


def test_floor_keeps_near_zero_series_quiet():
    tiny = [1e-9, -2e-9, 3e-9, 1e-9, -1e-9, 5e-8, -4e-8]   # means of a symmetric tensor
    assert _fired(tiny) == []
    assert _fired(tiny, SpikeRule(floor=0.0)) == [5, 6]      # without a floor they would fire
    # A real jump out of the near-zero band still fires.
    assert _fired(tiny + [1e-3]) == [7]


def test_window_is_of_finite_values_and_nonfinite_is_skipped():
    rule = SpikeRule(warmup=3, window=3)
    tracker = SpikeTracker(rule)
    for v in (1.0, math.nan, 2.0, math.inf, 3.0):
        assert tracker.observe("s", v) is None
    # baseline = median(1, 2, 3) = 2: 25 is 12.5x above it
    assert tracker.observe("s", 25.0) == 2.0
    with pytest.raises(ValueError, match="factor must be a finite number > 1"):
        SpikeRule(factor=1.0)


def _random_run(tmp_path, seed=3):
    """Five tensors x 60 steps of noisy norms with spikes, NaNs and missing steps, two ranks."""
    rnd = random.Random(seed)
    rows, truth = [], []
    for rank in (0, 1):
        for step in range(60):
            for t in range(5):
                if rnd.random() < 0.05:
                    continue                                     # a step this tensor missed
                v = 10 ** (t - 2) * math.exp(rnd.gauss(0, 0.3))
                if rnd.random() < 0.04:
                    v *= rnd.choice([30.0, 1 / 30.0])
                if rnd.random() < 0.02:
                    v = math.nan
                rows.append(row(rank, "grad_reduced", f"t{t}", step, stats={"norm": v, "mean": 0.0}))
                truth.append((rank, f"t{t}", step, v))
    return write_run(tmp_path / "run", rows), truth


def test_offline_scan_equals_the_online_tracker(tmp_path):
    run, truth = _random_run(tmp_path)
    rule = SpikeRule()
    online = {}
    trackers = {0: SpikeTracker(rule), 1: SpikeTracker(rule)}
    for rank, name, step, v in truth:
        base = trackers[rank].observe(name, v, down=False)   # grads are signed: judged upward only
        if base is not None:
            online[(rank, name, step)] = base
    offline = {(a.rank, a.name, a.step): a.baseline
               for a in scan(load_table(run), Rules(nonfinite=False)) if a.rule == "spike"}
    assert len(online) >= 8                                   # the injected spikes are there
    assert offline.keys() == online.keys()
    for key, base in online.items():
        assert offline[key] == pytest.approx(base, rel=1e-12)
    # and by an independent definition: median of the previous <=16 finite values
    for (rank, name, step), base in online.items():
        past = [v for r, n, s, v in truth if r == rank and n == name and s < step and math.isfinite(v)]
        assert base == statistics.median(past[-16:])


def test_nonfinite_prefers_counts_then_stats():
    assert nonfinite_op({"norm": math.nan, "nans": 3, "infs": 0}) == "nans"
    assert nonfinite_op({"norm": math.inf, "nans": 0, "infs": 2}) == "infs"
    assert nonfinite_op({"norm": 1.0, "max": math.inf}) == "max"
    assert nonfinite_op({"norm": 1.0, "nans": 0}) is None


def test_scan_nonfinite_and_threshold_rows(tmp_path):
    rows = [row(0, "grad_reduced", "a", 0, stats={"norm": 1.0, "nans": 0}),
            row(0, "grad_reduced", "b", 0, stats={"norm": math.nan, "nans": 7}),
            row(0, "grad_reduced", "c", 0, stats={"norm": 50.0, "nans": 0}),
            row(0, "update_ratio", "a", 0, stats={"update_ratio": math.inf}),       # 0 denominator
            row(0, "actv", "x.input", 0, stats={"norm": math.nan, "nans": math.nan},
                micro_step=0, dtype="", shape=[])]                                  # not a tensor
    found = scan(load_table(write_run(tmp_path / "run", rows)), Rules(threshold=10.0))
    assert [(a.name, a.rule, a.op, a.value) for a in found] == [("b", "nonfinite", "nans", 7.0),
                                                               ("c", "threshold", "norm", 50.0)]


def test_json_numbers_are_strict_json():
    a = Anomaly(step=1, kind="grad_reduced", name="w", rank=0, op="norm", value=math.nan,
                rule="nonfinite", baseline=-math.inf)
    text = json.dumps(a.to_json(), allow_nan=False)
    back = Anomaly.from_json(json.loads(text))
    assert json.loads(text)["value"] == "nan" and json.loads(text)["baseline"] == "-inf"
    assert math.isnan(back.value) and back.baseline == -math.inf
    assert json_number(2.5) == 2.5 and json_number(math.inf) == "inf"
    counted = Anomaly(step=1, kind="grad_reduced", name="w", rank=0, op="nans", value=16.0, rule="nonfinite")
    assert counted.to_json()["value"] == 16 and isinstance(counted.to_json()["value"], int)


def test_comm_calls_are_series_by_name_and_call_order(tmp_path):
    rows = []
    for step in range(8):
        for call, norm in enumerate((1.0, 100.0)):       # two all_reduce calls of different sizes
            norm = norm * (50 if (step, call) == (7, 0) else 1)
            rows.append(row(0, "comm", "all_reduce", step, stats={"norm": norm},
                            extra={"op": "all_reduce", "call": call}))
    found = scan(load_table(write_run(tmp_path / "run", rows)))
    assert [(a.step, a.kind, a.phase, a.occurrence, a.value) for a in found] == [(7, "comm", "comm", 0, 50.0)]
