"""The accelerator statistics path, through the seam (TRAINMON_DEVICE_PATH=1: CPU tensors take the
CUDA/NPU code path), counted by a TorchDispatchMode: ops per tensor, host syncs, host->device
copies, temporaries; values against float64 truth; the CUDA-graph guard; the fp16 loss scale."""
from __future__ import annotations

import logging
import math

import pytest
import torch

from tests._support.runs import reference_stats
from trainmon.stats import device_rows as device_rows_mod
from trainmon.stats import engine as engine_mod
from trainmon.stats.engine import StatsEngine, Tracked
from trainmon.stats.table import STAT_NAMES
from trainmon.testing.op_counter import OpCounter

ALL = list(STAT_NAMES)
DEFAULT = ["norm", "mean", "min", "max"]


@pytest.fixture(autouse=True)
def seam(monkeypatch):
    monkeypatch.setenv("TRAINMON_DEVICE_PATH", "1")


def _stats(tensors, ops=ALL, eps=1e-8, **capture):
    engine = StatsEngine(ops, eps)
    engine.capture("x", [Tracked(f"t{i}", t) for i, t in enumerate(tensors)], **capture)
    return [r.stats for r in engine.finish_step(0)]


def _counted(engine, tensors):
    engine.partials(tensors)  # buffers are allocated once per step and layouts at first sight: not counted
    with OpCounter() as c:
        engine.partials(tensors)
    return c


def _truth(t):
    if t.numel():
        return reference_stats(t)
    return {"norm": 0.0, "mean": math.nan, "min": math.nan, "max": math.nan, "std": math.nan, "zeros": math.nan,
            "nans": 0, "infs": 0, "_mean_atol": 0.0}


def _assert_close(got, want, rtol):
    for op, w in want.items():
        if op.startswith("_"):
            continue
        g = got[op]
        if isinstance(w, float) and math.isnan(w):
            assert math.isnan(g), (op, g)
        elif op in ("nans", "infs"):
            assert g == w and type(g) is int, op
        else:
            assert g == pytest.approx(w, rel=rtol, abs=want["_mean_atol"] if op == "mean" else 1e-30), (op, g, w)


def test_the_seam_routes_cpu_tensors_down_the_device_path_and_says_so():
    engine = StatsEngine(DEFAULT)
    assert engine.seam
    engine.capture("x", [Tracked("w", torch.ones(4))])
    assert engine.stats_paths == {"cpu": "device"}
    assert engine._host.count == 0 and engine._devices  # no host row: a device row buffer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [4, 6])
def test_default_ops_cost_three_reading_ops_per_tensor_and_no_sync_copy_or_temporary(dtype, n):
    tensors = [torch.randn(300, 70).to(dtype) for _ in range(n)]
    c = _counted(StatsEngine(DEFAULT), tensors)
    if dtype == torch.float32 and n >= 5:   # sum, amin per tensor; _foreach_norm, _foreach_max, 2 stacks
        assert c.ops == 2 * n + 4, c.names
        assert set(c.names) == {"sum", "amin", "_foreach_norm", "_foreach_max", "stack"}
    else:
        assert c.ops == 3 * n, c.names                  # sum, linalg_vector_norm, aminmax (out=)
        assert set(c.names) == {"sum", "linalg_vector_norm", "aminmax"}
    assert c.syncs == 0 and c.copies == 0
    assert c.largest <= 1024                             # no full-size temporary


def test_nans_and_infs_are_counted_on_the_device_without_a_sync_in_six_ops_per_tensor():
    tensors = [torch.randn(1000) for _ in range(4)]
    tensors[1][3] = math.nan
    c5 = _counted(StatsEngine(DEFAULT + ["nans"]), tensors)
    c6 = _counted(StatsEngine(DEFAULT + ["nans", "infs"]), tensors)
    # one mask per count written into a reused scratch, then ONE sum for all counts of the row
    assert (c5.ops, c6.ops) == (5 * 4, 6 * 4), c6.names
    assert c6.names["sum"] == 2 * 4 and c6.names["isnan"] == c6.names["isinf"] == 4
    assert c5.syncs == c6.syncs == 0 and c5.copies == c6.copies == 0
    assert c6.largest == 0                               # the masks live in the scratch


@pytest.mark.parametrize("scratch_max", [1 << 26, 7])  # 7: larger tensors counted in slices (or transient masks)
def test_counts_from_the_shared_scratch_are_exact_for_every_dtype_and_shape(monkeypatch, scratch_max):
    monkeypatch.setattr(device_rows_mod, "_SCRATCH_MAX", scratch_max)
    g = torch.Generator().manual_seed(5)
    tensors = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = torch.randn(37, 11, generator=g)
        t[t.abs() < 0.3] = 0.0
        t.view(-1)[::9] = math.nan
        t.view(-1)[4::13] = math.inf
        t.view(-1)[5::17] = -math.inf
        tensors += [t.to(dtype), t.to(dtype).t(), t.to(dtype)[::2, 1::3], torch.full((3,), math.nan, dtype=dtype)]
    got = _stats(tensors, DEFAULT + ["nans", "infs", "zeros"])
    for t, row in zip(tensors, got):
        x = t.double()
        assert row["nans"] == int(x.isnan().sum()) and row["infs"] == int(x.isinf().sum())
        assert row["zeros"] == pytest.approx(float((x.abs() < 1e-8).sum()) / x.numel())


def test_a_tensor_larger_than_the_scratch_is_counted_in_slices_with_no_full_size_mask(monkeypatch):
    monkeypatch.setattr(device_rows_mod, "_SCRATCH_MAX", 256)
    t = torch.randn(100, 37)
    t.view(-1)[::11] = math.nan
    t.view(-1)[3::29] = -math.inf
    engine = StatsEngine(DEFAULT + ["nans", "infs"])
    engine.partials([torch.randn(256)])  # the step's buffers and the 256-element scratch
    views = [t, t.t(), t[:, ::2]]  # contiguous, dense in another order (its span), strided
    with OpCounter() as c:
        for v in views:
            engine.partials([v])
    assert c.syncs == 0
    engine.discard()
    for v in views:
        engine.capture("x", [Tracked("t", v)])
        row = engine.finish_step(0)[0].stats
        x = v.double()
        assert (row["nans"], row["infs"]) == (int(x.isnan().sum()), int(x.isinf().sum()))
    # the two spans in 15 slices each: nothing larger than the [2 counts, 256] scratch (a full
    # mask would be 3,700 bytes); only the strided view makes full-size masks
    with OpCounter() as dense_only:
        engine.partials(views[:2])
    engine.discard()
    assert dense_only.largest <= 2 * 256 < t.numel()
    assert dense_only.names["isnan"] == 2 * 15


def test_the_mask_scratch_is_dropped_at_the_step_end_and_grows_for_larger_tensors():
    engine = StatsEngine(DEFAULT + ["nans", "infs"])
    engine.capture("x", [Tracked("a", torch.randn(10))])
    rows = next(iter(engine._devices.values()))
    small = rows._scratch[None].shape
    engine.capture("x", [Tracked("b", torch.randn(10_000))])
    assert small == (2, 4096) and rows._scratch[None].shape == (2, 16384)
    engine.finish_step(0)
    assert rows._scratch == {}


def test_every_op_combination_is_sync_and_copy_free_also_for_empty_int_and_strided_tensors():
    tensors = [torch.randn(50, 40).t(), torch.empty(0), torch.arange(10), torch.ones(3, dtype=torch.bool),
               torch.randn(8, dtype=torch.bfloat16)]
    for ops in (ALL, ["std"], ["zeros", "nans"], ["min"], ["max", "infs"]):
        c = _counted(StatsEngine(ops), tensors)
        assert c.syncs == 0 and c.copies == 0, (ops, c.names)


def test_a_tensor_passed_twice_in_one_call_is_reduced_once():
    g = torch.randn(500)
    engine = StatsEngine(DEFAULT)
    c = _counted(engine, [g, g])
    assert c.ops == 3
    rows = engine.partials([g, g])
    assert rows[0] == rows[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_values_equal_float64_truth_on_every_dtype_and_odd_tensor(dtype):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(64, 33, generator=g) * 3 + 0.5
    special = torch.randn(200, generator=g)
    special[[3, 50]] = math.nan
    special[7], special[9] = math.inf, -math.inf
    posinf = torch.randn(40, generator=g)
    posinf[0] = math.inf
    tensors = [base.to(dtype), base.to(dtype).t(), base.to(dtype)[::3, 1::2], special.to(dtype), posinf.to(dtype),
               torch.zeros(10, dtype=dtype), torch.empty(0, dtype=dtype), torch.full((1,), 2.5, dtype=dtype)]
    for t, got in zip(tensors, _stats(tensors)):
        _assert_close(got, _truth(t), rtol=1e-5)


def test_integer_and_bool_tensors_match_truth():
    tensors = [torch.arange(-5, 7), torch.tensor([True, False, True])]
    for t, got in zip(tensors, _stats(tensors)):
        _assert_close(got, reference_stats(t), rtol=1e-6)


def test_device_rows_equal_the_cpu_path_rows(monkeypatch):
    g = torch.Generator().manual_seed(2)
    tensors = [torch.randn(n, generator=g) * s for n, s in ((1, 1.0), (999, 0.01), (70_000, 40.0))]
    tensors += [t.to(torch.bfloat16) for t in tensors]
    device = _stats(tensors)
    monkeypatch.setenv("TRAINMON_DEVICE_PATH", "0")
    cpu = _stats(tensors)
    for d, c in zip(device, cpu):
        for op in ALL:
            assert d[op] == pytest.approx(c[op], rel=1e-5, abs=1e-6 * abs(c["norm"]), nan_ok=True), op


def test_rows_past_one_chunk_keep_their_order_and_values():
    tensors = [torch.full((3,), float(i)) for i in range(1300)]  # 3 chunks of 512 rows
    got = _stats(tensors, ["mean", "max"])
    assert [r["mean"] for r in got] == [float(i) for i in range(1300)]


def test_one_device_copy_per_device_per_step(monkeypatch):
    calls = []
    real = device_rows_mod._copy_to_host
    monkeypatch.setattr(device_rows_mod, "_copy_to_host", lambda flat: calls.append(flat.numel()) or real(flat))
    engine = StatsEngine(ALL)
    for k in range(5):
        engine.capture("a", [Tracked(f"t{k}", torch.randn(100)), Tracked("b", torch.randn(7, dtype=torch.bfloat16))])
    engine.capture_values("ratio", [engine_mod.Meta("ratio", "w", 0, (3,), "torch.float32")],
                          [torch.tensor([0.25])], ("update_ratio",))
    rows = engine.finish_step(1)
    assert len(calls) == 1
    assert len(rows) == 11 and rows[-1].stats == {"update_ratio": 0.25}


def test_nothing_is_launched_or_recorded_while_a_cuda_graph_is_captured(monkeypatch, caplog):
    engine = StatsEngine(ALL)
    w, out = torch.randn(10), torch.ones(2)
    family = [torch.randn(16) for _ in range(6)]  # a weight family kept as a block: planned before the capture
    block = engine.block([(f"p{i}", 0, (16,), torch.float32) for i in range(6)], [torch.float32] * 6, [16] * 6)
    engine.capture_block("grads", block, family)
    assert block.plan is not None and len(engine.finish_step(0)) == 6
    monkeypatch.setattr(engine_mod, "stream_capturing", lambda device: True)
    with caplog.at_level(logging.WARNING, "trainmon"), OpCounter() as c:
        for _ in range(3):
            engine.capture_block("grads", block, family)
            engine.capture("x", [Tracked("w", w)])
            engine.capture_tensors("actv", 0, ["m.output"], [out], engine.partials([out]))
            engine.capture_values("ratio", [engine_mod.Meta("ratio", "w", 0, (3,), "torch.float32")],
                                  [w[:1]], ("update_ratio",))
    assert c.ops == 0
    assert len([r for r in caplog.records if "CUDA graph" in r.getMessage()]) == 1
    assert not engine.has_pending() and engine.finish_step(0) == []


@pytest.mark.parametrize("ops", [DEFAULT + ["std", "nans"], ALL])
def test_fp16_loss_scale_divides_the_partials_not_the_grads(ops):
    g = torch.Generator().manual_seed(4)
    scale = torch.tensor([1024.0])
    grads = [(torch.randn(300, generator=g) * 0.01 * 1024).to(torch.float16), torch.randn(40, generator=g) * 512]
    truth = [reference_stats(t.double() / 1024.0) for t in grads]
    for got, want in zip(_stats(grads, ops, scale=scale), truth):
        _assert_close(got, {k: v for k, v in want.items() if k in ops or k == "_mean_atol"}, rtol=1e-5)
    engine = StatsEngine(DEFAULT)   # (std of fp16 and zeros with a scale need an fp32/scaled copy)
    engine.partials([grads[0][:1]])
    with OpCounter() as c:
        engine.capture("x", [Tracked("a", grads[0]), Tracked("b", grads[1])], scale=scale)
    assert c.ops == 6 and c.largest <= 1024 and c.syncs == 0


def test_fp16_loss_scale_on_the_cpu_path_too(monkeypatch):
    monkeypatch.setenv("TRAINMON_DEVICE_PATH", "0")
    t = torch.randn(100) * 64
    got = _stats([t], DEFAULT + ["std"], scale=torch.tensor([64.0]))[0]
    _assert_close(got, {k: v for k, v in reference_stats(t / 64).items() if k in DEFAULT + ["std", "_mean_atol"]}, 1e-6)
