"""The shared rules (trainmon.analysis.rules) against hand-computed cases: the offline array
functions and the online tracker give the same answers."""

from __future__ import annotations

import math

import numpy as np

from trainmon.analysis.rules import (
    SpikeRule,
    SpikeTracker,
    nonfinite_op,
    over_threshold,
    spike_baselines,
    spike_hits,
)

RULE = SpikeRule(factor=10.0, floor=0.0, warmup=2, window=3)


def test_spike_baselines_are_the_median_of_the_previous_window_by_hand():
    # Series 0: 1, 3, 2, 8, 100; series 1 interleaved: 5, 5.  Warm-up 2, window 3.
    keys = np.array([0, 1, 0, 0, 1, 0, 0])
    values = np.array([1.0, 5.0, 3.0, 2.0, 5.0, 8.0, 100.0])
    base = spike_baselines(keys, values, RULE)
    # series 0: -, -, median(1,3)=2, median(1,3,2)=2, median(3,2,8)=3; series 1: -, -
    want = np.array([np.nan, np.nan, np.nan, 2.0, np.nan, 2.0, 3.0])
    np.testing.assert_array_equal(base, want)


def test_spike_hits_up_and_down_by_hand():
    values = np.array([30.0, 29.0, 0.1, 0.5, 7.0])
    base = np.array([3.0, 3.0, 1.0, 1.0, np.nan])
    # ratios 10, 9.67, 0.1, 0.5, warm-up
    assert spike_hits(values, base, RULE, down=False).tolist() == [True, False, False, False, False]
    assert spike_hits(values, base, RULE, down=True).tolist() == [True, False, True, False, False]


def test_zero_baseline_with_no_floor_fires_on_any_nonzero_value():
    hit = spike_hits(np.array([1e-30, 0.0]), np.array([0.0, 0.0]), RULE, down=True)
    assert hit.tolist() == [True, False]
    assert RULE.fires(1e-30, 0.0) and not RULE.fires(0.0, 0.0)


def test_offline_arrays_and_online_tracker_agree_on_a_random_series():
    rng = np.random.default_rng(0)
    rule = SpikeRule(factor=3.0, floor=1e-6, warmup=4, window=7)
    values = np.exp(rng.normal(size=300) * 1.5)
    tracker = SpikeTracker(rule)
    online = [tracker.observe("s", float(v)) is not None for v in values]
    base = spike_baselines(np.zeros(len(values), dtype=int), values, rule)
    offline = spike_hits(values, base, rule, down=True)
    assert any(online) and offline.tolist() == online


def test_the_threshold_skips_non_finite_values_by_hand_for_arrays_and_floats_alike():
    values = [1.0, -5.0, 5.0, math.inf, -math.inf, math.nan, 4.0]
    want = [False, True, True, False, False, False, False]
    assert over_threshold(np.array(values), 4.0).tolist() == want
    assert [bool(over_threshold(v, 4.0)) for v in values] == want  # the alert sink's floats
    assert all(type(over_threshold(v, 4.0)) is bool for v in values)  # no numpy on that path


def test_the_spike_test_on_floats_is_the_one_on_arrays():
    values = [30.0, 29.0, 0.1, 0.5, 1e-30, 0.0, 3.0]
    bases = [3.0, 3.0, 1.0, 1.0, 0.0, 0.0, 0.3]
    for down in (False, True):
        with np.errstate(invalid="ignore", divide="ignore"):
            arrays = RULE.fires(np.array(values), np.array(bases), down=down).tolist()
        floats = [RULE.fires(v, b, down=down) for v, b in zip(values, bases)]
        assert floats == arrays and all(type(f) is bool for f in floats)
    # ratios 10, 9.67, 0.1, 0.5, inf (zero baseline, no floor), 0/0, 10: by hand
    assert floats == [True, False, True, False, True, False, True]


def test_nonfinite_op_prefers_counts_then_stats():
    assert nonfinite_op({"norm": 1.0, "nans": 0, "infs": 0}) is None
    assert nonfinite_op({"norm": math.inf, "nans": 0, "infs": 2}) == "infs"
    assert nonfinite_op({"norm": 1.0, "max": math.nan}) == "max"
