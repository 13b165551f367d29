"""Weight families batched on the device path, through the seam: tensors that are views of one
contiguous buffer (Megatron/DDP grad buckets, DeepSpeed flat partitions, flattened params) cost a
constant number of aten ops per group, not 3 per tensor; values against float64 truth."""
from __future__ import annotations

import math

import pytest
import torch

from tests._support.runs import only_run_dir, read_family, reference_stats
from tests.test_monitor import assert_matches
from trainmon import TrainerMon
from trainmon.stats.engine import StatsEngine, Tracked
from trainmon.testing.op_counter import OpCounter
from trainmon.testing.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches

DEFAULT = ["norm", "mean", "min", "max"]


@pytest.fixture(autouse=True)
def seam(monkeypatch):
    monkeypatch.setenv("TRAINMON_DEVICE_PATH", "1")


def _views(sizes, dtype=torch.float32, gap=0, seed=0, reverse=False):
    """Views of one buffer with ``sizes`` elements each, ``gap`` unused elements between them."""
    g = torch.Generator().manual_seed(seed)
    buf = (torch.randn(sum(sizes) + gap * len(sizes), generator=g) * 3 + 0.25).to(dtype)
    out, pos = [], 0
    for n in sizes:
        out.append(buf[pos:pos + n].view(-1, 256) if n % 256 == 0 else buf[pos:pos + n])
        pos += n + gap
    return out[::-1] if reverse else out


def _chunks(views, width=256):
    """The 256-element chunks spanned by ``views`` (of one buffer), gaps between them included."""
    starts = [v.storage_offset() for v in views]
    return (max(s + v.numel() for s, v in zip(starts, views)) - min(starts)) // width


def _counted(engine, tensors):
    engine.partials(tensors)        # the first sight of a layout builds it (two small index tensors)
    with OpCounter() as c:
        engine.partials(tensors)
    return c


def _assert_close(got, t):
    want = reference_stats(t)
    for op in DEFAULT:
        atol = want["_mean_atol"] if op == "mean" else 1e-30
        assert got[op] == pytest.approx(want[op], rel=1e-5, abs=atol), (op, got[op], want[op])


@pytest.mark.parametrize("n", [8, 40])
def test_a_buffer_of_views_costs_the_same_few_ops_whatever_its_number_of_tensors(n):
    tensors = _views([256 * (1 + k % 5) for k in range(n)], gap=512, reverse=True)
    c = _counted(StatsEngine(DEFAULT), tensors)
    # sum, norm, aminmax over [chunks, width]; square, 4 segment reductions, root, stack, gather, copy
    assert c.ops == 12, c.names
    assert c.syncs == 0 and c.copies == 0
    # one float32 per 256-element chunk; else the [segments, partials] results (n tensors, n gaps)
    assert c.largest <= max(4 * _chunks(tensors), 4 * 4 * 2 * n)


def test_tensors_not_of_one_aligned_buffer_cost_two_ops_each_plus_four_in_fp32_three_else(monkeypatch):
    from trainmon.stats import device_rows

    monkeypatch.setattr(device_rows, "_SMALL", 0)  # the per-tensor paths of tensors too large for segments
    separate = [torch.randn(256, 4) for _ in range(6)]
    misaligned = _views([300, 500, 700, 900, 1100, 1300])      # no common chunk of 256 elements
    assert _counted(StatsEngine(DEFAULT), separate).ops == 2 * 6 + 4      # _foreach_norm/_max
    assert _counted(StatsEngine(DEFAULT), misaligned).ops == 2 * 6 + 4
    assert _counted(StatsEngine(DEFAULT), [t.to(torch.bfloat16) for t in separate]).ops == 3 * 6


@pytest.mark.parametrize("ops", [DEFAULT, ["norm", "max"], DEFAULT + ["nans", "infs", "zeros"]])
def test_separate_fp32_tensors_through_foreach_equal_float64_truth(ops):
    g = torch.Generator().manual_seed(9)
    tensors = [torch.randn(64, 33, generator=g) * 3 + 0.5 for _ in range(6)] + [torch.randn(30, 20, generator=g).t()]
    tensors[1][3, 4] = math.nan
    tensors[2][0, 0] = math.inf
    tensors[3][5, 5] = -math.inf
    engine = StatsEngine(ops)
    engine.capture("pad", [Tracked(f"p{i}", torch.ones(2)) for i in range(508)])   # rows run into a new chunk
    engine.capture("x", [Tracked(f"t{i}", t) for i, t in enumerate(tensors)])
    rows = [r for r in engine.finish_step(0) if r.family == "x"]
    for t, r in zip(tensors, rows):
        want = reference_stats(t)
        for op in ops:
            if op in ("nans", "infs"):
                assert r.stats[op] == want[op], (r.name, op)
            elif math.isnan(want[op]):
                assert math.isnan(r.stats[op]), (r.name, op)
            else:
                atol = want["_mean_atol"] if op == "mean" else 1e-30
                assert r.stats[op] == pytest.approx(want[op], rel=1e-5, abs=atol), (r.name, op)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_batched_rows_equal_float64_truth_in_caller_order_with_gaps_and_strangers(dtype):
    flat = _views([256 * k for k in (1, 7, 2, 40, 3, 5)], dtype, gap=256, reverse=True)
    flat[2].view(-1)[17] = math.inf                      # inf propagates into norm/max/mean
    strangers = [torch.randn(33).to(dtype), torch.randn(256, 2).to(dtype).t()]
    tensors = [strangers[0], *flat[:3], strangers[1], *flat[3:]]
    engine = StatsEngine(DEFAULT)
    engine.capture("x", [Tracked(f"t{i}", t) for i, t in enumerate(tensors)])
    rows = engine.finish_step(0)
    assert [r.name for r in rows] == [f"t{i}" for i in range(len(tensors))]
    for t, r in zip(tensors, rows):
        _assert_close(r.stats, t)


def test_batched_rows_that_run_into_the_next_row_chunk_keep_their_values():
    engine = StatsEngine(DEFAULT)
    engine.capture("pad", [Tracked(f"p{i}", torch.full((2,), float(i))) for i in range(509)])  # 512 rows a chunk
    flat = _views([256 * k for k in range(1, 9)])
    engine.capture("x", [Tracked(f"t{i}", t) for i, t in enumerate(flat)])
    rows = [r for r in engine.finish_step(0) if r.family == "x"]
    for t, r in zip(flat, rows):
        _assert_close(r.stats, t)


@pytest.mark.slow
def test_params_and_grads_as_views_of_flat_buffers_record_truth_through_the_monitor(output_root, make_config):
    """Like Megatron: every param and grad a view of one flat buffer, starts padded to 256."""
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=256, seq=8, dim=256, heads=2, layers=1))
    params = list(model.parameters())
    sizes = [-(-p.numel() // 256) * 256 for p in params]
    pbuf, gbuf = torch.zeros(sum(sizes)), torch.zeros(sum(sizes))
    pos = 0
    for p, n in zip(params, sizes):
        p.data = pbuf[pos:pos + p.numel()].view_as(p).copy_(p.data)
        p.grad = gbuf[pos:pos + p.numel()].view_as(p)
        pos += n
    opt = torch.optim.SGD(params, lr=0.1)
    names = {p: n for n, p in model.named_parameters()}
    monitor = TrainerMon(make_config(wg_distribution=True, param_distribution=True, ops=DEFAULT))
    monitor.set_monitor(model, optimizer=opt)
    data = synthetic_batches(model.cfg, 2, 2, seed=1)
    truth = {}
    for step in range(2):
        model.loss(next(data)).backward()
        assert all(p.grad.untyped_storage().data_ptr() == gbuf.untyped_storage().data_ptr() for p in params)
        for p, n in names.items():
            truth.setdefault(("grad_reduced", step), {})[n] = reference_stats(p.grad)
            truth.setdefault(("param_origin", step), {})[n] = reference_stats(p)
        with OpCounter() as c:
            opt.step()
        for p, n in names.items():
            truth.setdefault(("param_updated", step), {})[n] = reference_stats(p)
        opt.zero_grad(set_to_none=False)
    monitor.close()
    rank0 = only_run_dir(output_root) / "rank0"
    for family in ("grad_reduced", "param_origin", "param_updated"):
        assert_matches(read_family(rank0, family), truth, family, range(2), DEFAULT)
    # three families of len(params) tensors, each batched: a constant number of ops, not 3 per tensor
    assert c.names["segment_reduce"] == 3 * 4 and c.names["aminmax"] == 3


COUNTS = DEFAULT + ["nans", "infs", "zeros"]


@pytest.mark.parametrize("n", [8, 40])
def test_a_buffer_of_views_with_nans_and_infs_costs_a_constant_number_of_ops(n):
    tensors = _views([256 * (1 + k % 5) for k in range(n)], gap=256, reverse=True)
    c = _counted(StatsEngine(DEFAULT + ["nans", "infs"]), tensors)
    # the 12 above, plus per count: a mask into the scratch, a per-chunk float32 sum, a segment
    # sum; and one copy into the count rows (the stack and the gather are shared with the values)
    assert c.ops == 12 + 2 * 3 + 1, c.names
    assert c.syncs == 0 and c.copies == 0
    assert c.largest <= max(4 * _chunks(tensors), 4 * 6 * 2 * n)    # counts too: a float32 per chunk


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_batched_counts_are_exact_and_nan_propagates_into_min_and_max(dtype):
    flat = _views([256 * k for k in (3, 1, 9, 2, 4, 6)], dtype, gap=256, reverse=True)
    flat[0].view(-1)[[5, 700]] = math.nan
    flat[2].view(-1)[::7] = math.inf
    flat[2].view(-1)[3::11] = -math.inf
    flat[3].view(-1)[:] = math.nan                       # all NaN
    flat[4].view(-1)[::2] = 0.0
    engine = StatsEngine(COUNTS)
    engine.capture("x", [Tracked(f"t{i}", t) for i, t in enumerate(flat)])
    for t, r in zip(flat, engine.finish_step(0)):
        x = t.double()
        assert (r.stats["nans"], r.stats["infs"]) == (int(x.isnan().sum()), int(x.isinf().sum())), r.name
        assert r.stats["zeros"] == pytest.approx(float((x.abs() < 1e-8).sum()) / x.numel())
        want = reference_stats(t)
        for op in DEFAULT:
            if math.isnan(want[op]):
                assert math.isnan(r.stats[op]), (r.name, op)
            else:
                atol = want["_mean_atol"] if op == "mean" else 1e-30
                assert r.stats[op] == pytest.approx(want[op], rel=1e-5, abs=atol), (r.name, op)


def test_a_buffer_larger_than_the_mask_scratch_is_counted_tensor_by_tensor(monkeypatch):
    from trainmon.stats import device_rows

    monkeypatch.setattr(device_rows, "_SCRATCH_MAX", 1024)
    monkeypatch.setattr(device_rows, "_SMALL", 0)
    tensors = _views([256 * 2] * 6)
    # each tensor: sum, amin, two masks, one count sum; the group: _foreach_norm/_max + 2 stacks
    assert _counted(StatsEngine(DEFAULT + ["nans", "infs"]), tensors).ops == 5 * 6 + 4


def test_counts_of_a_tensor_beyond_float32_exactness_are_not_batched_and_stay_exact(monkeypatch):
    from trainmon.stats import device_rows

    monkeypatch.setattr(device_rows, "_COUNT_EXACT", 1024)     # as a tensor of more than 2^24 elements
    monkeypatch.setattr(device_rows, "_SMALL", 0)
    tensors = _views([256 * 2] * 5 + [256 * 5])
    tensors[5].view(-1)[::3] = math.nan
    engine = StatsEngine(DEFAULT + ["nans"])
    assert "segment_reduce" not in _counted(engine, tensors).names
    engine.capture("x", [Tracked(f"t{i}", t) for i, t in enumerate(tensors)])
    assert [r.stats["nans"] for r in engine.finish_step(0)] == [0] * 5 + [427]


def test_without_foreach_max_or_mask_out_variants_the_values_stay_exact(monkeypatch):
    """Older torch (>= 2.1 is supported): no ``_foreach_max``, no ``isnan.out``."""
    from trainmon.stats import device_rows

    monkeypatch.setattr(device_rows, "_FOREACH_MAX", None)
    monkeypatch.setattr(device_rows, "_MASKS_OUT", False)
    tensors = [torch.randn(50, 7) for _ in range(5)] + _views([512] * 5)
    tensors[0][1, 1] = math.nan
    engine = StatsEngine(DEFAULT + ["nans"])
    engine.capture("x", [Tracked(f"t{i}", t) for i, t in enumerate(tensors)])
    for t, r in zip(tensors, engine.finish_step(0)):
        want = reference_stats(t)
        assert r.stats["nans"] == want["nans"]
        for op in DEFAULT:
            if math.isnan(want[op]):
                assert math.isnan(r.stats[op])
            else:
                atol = want["_mean_atol"] if op == "mean" else 1e-30
                assert r.stats[op] == pytest.approx(want[op], rel=1e-5, abs=atol), (r.name, op)


def test_large_tensors_of_a_buffer_are_reduced_alone_so_partials_stay_within_a_kib_per_row():
    # Megatron-like: big matrices (2,000 chunks of 256 each) between small norm weights and biases;
    # one batch over the whole span would make 4 B x 6,000 chunks = 24 KB of partials (1.5 KB a row)
    sizes = [256 * k for k in (2000, 1, 2, 1, 2000, 1, 1, 3, 1, 2, 2000, 1, 1, 1, 1, 2)]
    tensors = _views(sizes, gap=256)
    assert 4 * _chunks(tensors) > 1024 * len(tensors)
    engine = StatsEngine(DEFAULT)
    c = _counted(engine, tensors)
    assert c.largest <= 1024 * len(tensors), c.largest  # at most 1 KiB of partials per row
    assert c.ops <= 3 * len(tensors), c.names            # the small ones still batched
    assert c.syncs == 0 and c.copies == 0
    engine = StatsEngine(DEFAULT)
    engine.capture("x", [Tracked(f"t{i}", t) for i, t in enumerate(tensors)])
    for t, r in zip(tensors, engine.finish_step(0)):
        _assert_close(r.stats, t)
