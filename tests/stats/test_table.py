"""The one statistics table: every partial declares its merge, every statistic its derive, and
adding a statistic is one row (no other module lists statistics)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests._support.runs import reference_stats
from trainmon.stats import table
from trainmon.stats.engine import StatsEngine, Tracked
from trainmon.stats.partials import compute_partials, device_columns
from trainmon.stats.table import PARTIAL, STATS, Stat, combine, merge_partials, partials_for


def test_every_partial_declares_a_known_merge_identity_and_scale_power():
    for p in PARTIAL.values():
        assert p.merge in ("sum", "min", "max", "m2") and p.doc
        assert p.power in (0, 1, 2)
    assert [PARTIAL[c].identity for c in ("min", "max")] == [math.inf, -math.inf]


def test_every_statistic_needs_only_declared_partials_and_derives_one_column():
    cols = tuple(table.PARTIALS)
    mat = np.array([[3, 6, 14, 1, 3, 0, 0, 0, 2], [0, 0, 0, math.inf, -math.inf, 0, 0, 0, 0]], dtype=float)
    for s in STATS.values():
        assert set(s.needs) <= set(PARTIAL) and s.doc
        out = table.derive_columns([s.name], cols, mat)
        assert out.shape == (2, 1)
        assert s.derive(dict(zip(cols, mat[0]))) == (int(out[0, 0]) if s.integer else out[0, 0])


@pytest.mark.parametrize("pieces", [2, 5])
def test_combine_of_pieces_equals_the_partials_of_the_whole_for_every_partial(pieces):
    t = torch.randn(777, dtype=torch.float64) * 2 - 1
    t[5] = 0.0
    cols = device_columns(table.PARTIALS)
    parts = torch.stack([compute_partials([p], cols, 1e-8)[0] for p in torch.tensor_split(t, pieces)] +
                        [compute_partials([t[:0]], cols, 1e-8)[0]])
    whole = compute_partials([t], cols, 1e-8)[0].numpy()
    merged = combine(parts.numpy()[:, None, :], cols)[0]
    assert np.allclose(merged, whole, rtol=1e-12, atol=1e-12)
    assert merge_partials([dict(zip(cols, r.tolist())) for r in parts]) == pytest.approx(dict(zip(cols, merged)))


def test_nan_in_one_piece_makes_the_merged_extremes_nan():
    cols = ("count", "min", "max")
    merged = combine(np.array([[[2, 1, 2]], [[3, math.nan, math.nan]]], dtype=float), cols)[0]
    assert merged[0] == 5 and math.isnan(merged[1]) and math.isnan(merged[2])


@pytest.mark.parametrize("seam", ["0", "1"])
@pytest.mark.parametrize("fused", ["0", "1"])
def test_a_new_statistic_is_one_row_in_the_table(monkeypatch, seam, fused):
    monkeypatch.setenv("TRAINMON_DEVICE_PATH", seam)
    monkeypatch.setenv("TRAINMON_FUSED_CPU", fused)
    rms = Stat("rms", ("count", "sumsq"), lambda p: np.sqrt(table._ratio(p["sumsq"], p["count"])), "root mean square")
    monkeypatch.setitem(STATS, "rms", rms)
    assert partials_for(["rms"]) == ("count", "sumsq")
    t = torch.randn(5000) * 3
    engine = StatsEngine(["rms", "norm"])
    engine.capture("x", [Tracked("t", t)])
    row = engine.finish_step(0)[0]
    assert row.stats["rms"] == pytest.approx(t.double().square().mean().sqrt().item(), rel=1e-6)
    assert row.stats["norm"] == pytest.approx(reference_stats(t)["norm"], rel=1e-6)
