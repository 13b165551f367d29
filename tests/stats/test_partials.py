"""Partials and derived stats against values computed straight from the tensors."""
from __future__ import annotations

import math

import pytest
import torch

from tests._support.runs import reference_stats
from trainmon.stats import partials as partials_mod
from trainmon.stats.engine import StatsEngine, Tracked
from trainmon.stats.table import STAT_NAMES, derive, merge_partials

ALL = list(STAT_NAMES)


@pytest.fixture(autouse=True, params=["fused", "eager"])
def cpu_path(request, monkeypatch):
    """Every test here runs on both CPU paths: the fused kernel (the default) and the eager one."""
    monkeypatch.setenv("TRAINMON_FUSED_CPU", "1" if request.param == "fused" else "0")
    return request.param


def engine_stats(tensors, ops=ALL, eps=1e-8):
    engine = StatsEngine(ops, eps)
    engine.capture("x", [Tracked(f"t{i}", t) for i, t in enumerate(tensors)])
    return [r.stats for r in engine.finish_step(0)]


def assert_close(got, want, rtol=1e-5):
    for op, w in want.items():
        if op.startswith("_"):
            continue
        g = got[op]
        if isinstance(w, float) and math.isnan(w):
            assert math.isnan(g), op
        else:
            assert g == pytest.approx(w, rel=rtol, abs=want["_mean_atol"] if op == "mean" else 1e-12), op


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_every_stat_matches_the_tensor(dtype):
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=g).to(dtype) * s + o
               for n, s, o in [(1, 1, 0), (7, 3, 1), (1000, 0.01, 0.5), (33, 1e3, -2)]]
    tensors.append(torch.zeros(10, dtype=dtype))
    for got, t in zip(engine_stats(tensors), tensors):
        assert_close(got, reference_stats(t))


def test_large_cpu_tensor_norm_is_accurate():
    # fp32 vector_norm drifts on tens of millions of elements; the blocked path must not.
    t = torch.full((3 * (1 << 20) + 5,), 0.1)
    (got,) = engine_stats([t], ["norm", "mean"])
    assert got["norm"] == pytest.approx(t.double().norm().item(), rel=2e-6)


def test_bf16_chunked_upcast_matches(monkeypatch):
    monkeypatch.setattr(partials_mod, "_CHUNK", 1000)
    t = (torch.randn(4321) * 2 + 0.3).to(torch.bfloat16)
    (got,) = engine_stats([t])
    assert_close(got, reference_stats(t))


def test_nonfinite_counts_only_where_present():
    t = torch.tensor([1.0, float("nan"), float("inf"), float("-inf"), 2.0])
    clean = torch.tensor([1.0, 2.0])
    bad, ok = engine_stats([t, clean], ["nans", "infs", "norm"])
    assert (bad["nans"], bad["infs"]) == (1, 2) and math.isnan(bad["norm"])
    assert (ok["nans"], ok["infs"]) == (0, 0)


def test_integer_and_bool_tensors_do_not_crash():
    ints = torch.tensor([[1, 2], [3, 4]])
    mask = torch.tensor([True, False, True])
    got_i, got_b = engine_stats([ints, mask], ["norm", "mean", "min", "max"])
    assert got_i == pytest.approx({"norm": math.sqrt(30), "mean": 2.5, "min": 1, "max": 4})
    assert got_b["mean"] == pytest.approx(2 / 3)


def test_empty_tensor_gives_nan_extremes_and_zero_norm():
    (got,) = engine_stats([torch.empty(0)], ["norm", "mean", "min", "max"])
    assert got["norm"] == 0 and math.isnan(got["mean"]) and math.isnan(got["min"])


def test_zeros_uses_eps():
    t = torch.tensor([0.0, 1e-9, 1e-3, 5.0])
    (got,) = engine_stats([t], ["zeros"], eps=1e-6)
    assert got["zeros"] == 0.5


@pytest.mark.parametrize("pieces", [1, 2, 3, 7])
def test_merged_shard_partials_equal_the_whole(pieces):
    t = torch.randn(1001, dtype=torch.float64) * 3 + 1
    engine = StatsEngine(ALL)
    cols = engine.columns
    shards = list(torch.tensor_split(t, pieces)) + [t[:0]]   # an empty shard too
    rows = partials_mod.compute_partials(shards, cols, 1e-8)
    merged = merge_partials([dict(zip(cols, r.tolist())) for r in rows])
    assert_close(derive(ALL, merged), reference_stats(t), rtol=1e-9)


def test_rows_keep_capture_order_and_metadata():
    engine = StatsEngine(["norm"])
    engine.capture("a", [Tracked("w", torch.ones(2, 3), 1)])
    engine.capture("b", [Tracked("v", torch.ones(4), 0, shape=(8,))])
    rows = engine.finish_step(5)
    assert [(r.family, r.name, r.vpp_stage, r.step, r.shape, r.dtype) for r in rows] == [
        ("a", "w", 1, 5, (2, 3), "torch.float32"), ("b", "v", 0, 5, (8,), "torch.float32")]
    assert engine.finish_step(6) == []


@pytest.mark.parametrize("value", [1e18, 3e38])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_huge_finite_values_get_finite_exact_stats_on_both_cpu_paths(value, dtype):
    # fp32 accumulation overflows (squares above 3.4e38) though every element is finite
    value = min(value, torch.finfo(dtype).max / 2)
    g = torch.Generator().manual_seed(3)
    tensors = [torch.full((3000,), value, dtype=dtype), ((torch.rand(70_000, generator=g) * 2 - 1) * value).to(dtype)]
    for t, got in zip(tensors, engine_stats(tensors)):
        want = reference_stats(t)
        assert all(math.isfinite(got[op]) for op in ("norm", "mean", "std", "min", "max")), got
        assert got["nans"] == 0 and got["infs"] == 0
        assert_close(got, want, rtol=1e-5)
