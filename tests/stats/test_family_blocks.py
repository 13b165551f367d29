"""A weight family captured as one block (``StatsEngine.capture_block``): on the CPU one call of
the fused kernel over a cached pointer table, through the accelerator path's seam one cached
route (``DeviceRows.plan``).  Every row is checked against the tensor read in float64 at capture
time, the two paths against the general one (``capture_items``), and the caches against the
tensors moving, changing their strides or turning odd (a meta tensor)."""

from __future__ import annotations

import gc
import logging

import numpy as np
import pytest
import torch

from trainmon.stats import engine as engine_mod
from trainmon.stats.engine import StatsEngine

OPS = ("norm", "mean", "min", "max", "nans", "zeros")


def _truth(t: torch.Tensor) -> list[float]:
    x = t.detach().to(torch.float64).reshape(-1)
    return [
        float(torch.linalg.vector_norm(x)),
        float(x.mean()),
        float(x.min()),
        float(x.max()),
        int(torch.isnan(x).sum()),
        float((x.abs() < 1e-8).sum()) / x.numel(),  # "zeros" is the fraction
    ]


def _block_rows(engine: StatsEngine, family: str, tensors: list[torch.Tensor], block=None, step: int = 0):
    """Rows of one step in which ``tensors`` are captured as a block (a new one unless given)."""
    if block is None:
        block = _new_block(engine, tensors)
    engine.capture_block(family, block, tensors)
    (b,) = engine.finish_step(step).blocks()
    return b, block


def _new_block(engine: StatsEngine, tensors: list[torch.Tensor]):
    items = [(f"t{k}", 0, tuple(t.shape), t.dtype) for k, t in enumerate(tensors)]
    return engine.block(items, [t.dtype for t in tensors], [t.numel() for t in tensors])


def _assert_true_rows(block, tensors, rtol):
    assert block.names == [f"t{k}" for k in range(len(tensors))]
    for vals, t in zip(block.values, tensors):
        want = _truth(t)
        np.testing.assert_allclose(vals[:4], want[:4], rtol=rtol, atol=1e-6)
        assert vals[4] == want[4] and type(vals[4]) is int
        assert vals[5] == pytest.approx(want[5], abs=0)


def _tensors(seed: int = 0, fp64: bool = False) -> list[torch.Tensor]:
    """Small and large, fp32 / bf16 / fp16 (and fp64: the fused kernel's general path), one NaN
    and exact zeros: every route of a write."""
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randn(4, 4, generator=g) for _ in range(6)]
    ts += [torch.randn(5000, generator=g), torch.randn(64, generator=g).to(torch.bfloat16)]
    ts += [torch.randn(33, generator=g).half()]
    ts += [torch.randn(9, dtype=torch.float64, generator=g)] if fp64 else []
    ts[1][0, 0] = float("nan")
    ts[2][1] = 0.0
    return ts


@pytest.mark.parametrize("fp64", [False, True], ids=["", "fp64"])
@pytest.mark.parametrize("path", ["cpu", "cpu-eager", "seam"])
def test_a_block_has_every_tensors_statistics(monkeypatch, path, fp64):
    if path == "seam":
        monkeypatch.setenv(engine_mod.SEAM_ENV, "1")
    if path == "cpu-eager":
        monkeypatch.setenv("TRAINMON_FUSED_CPU", "0")
    tensors = _tensors(fp64=fp64)
    engine = StatsEngine(OPS)
    engine.capture_block("grad_reduced", block := _new_block(engine, tensors), tensors)
    (pending,) = engine._pending
    # the block's own path (kernel over its pointer table, or the device route), not capture_items
    if path == "seam":
        assert pending.owner is not None and block.plan is not None
    else:
        assert bool(block.ptrs) == (path == "cpu" and not fp64)
    (b,) = engine.finish_step(0).blocks()
    _assert_true_rows(b, tensors, rtol=1e-5)
    b, _ = _block_rows(engine, "grad_reduced", tensors, block, step=1)  # the layout's second step
    _assert_true_rows(b, tensors, rtol=1e-5)
    assert engine.stats_paths["cpu"] == {"cpu": "cpu-fused", "cpu-eager": "cpu-eager", "seam": "device"}[path]


@pytest.mark.parametrize("seam", [False, True], ids=["cpu", "seam"])
def test_a_block_gives_the_general_paths_values_bit_for_bit(monkeypatch, seam):
    if seam:
        monkeypatch.setenv(engine_mod.SEAM_ENV, "1")
    tensors = _tensors(1, fp64=True)
    block_rows, _ = _block_rows(StatsEngine(OPS), "f", tensors)
    general = StatsEngine(OPS)
    general.capture_items("f", _new_block(general, tensors).items, tensors)
    (want,) = general.finish_step(0).blocks()
    np.testing.assert_array_equal(np.array(block_rows.values), np.array(want.values))  # NaN == NaN here
    assert block_rows.dtypes == want.dtypes and block_rows.shapes == want.shapes


def test_moved_tensors_are_read_at_their_new_addresses():
    """``zero_grad(set_to_none=True)`` gives new grads each step: the pointer table follows."""
    engine = StatsEngine(OPS)
    first = _tensors(2)
    _, block = _block_rows(engine, "f", first)
    moved = [t.clone() * 3 for t in first]  # same layout, other memory, other values
    del first
    b, _ = _block_rows(engine, "f", moved, block, step=1)
    _assert_true_rows(b, moved, rtol=1e-5)


def test_in_place_changes_between_steps_are_seen():
    engine = StatsEngine(OPS)
    tensors = _tensors(3)
    _, block = _block_rows(engine, "f", tensors)
    for t in tensors:
        t.mul_(-2)
    b, _ = _block_rows(engine, "f", tensors, block, step=1)
    _assert_true_rows(b, tensors, rtol=1e-5)


@pytest.mark.parametrize("seam", [False, True], ids=["cpu", "seam"])
def test_a_tensor_that_turns_non_contiguous_is_still_read_right(monkeypatch, seam):
    if seam:
        monkeypatch.setenv(engine_mod.SEAM_ENV, "1")
    engine = StatsEngine(OPS)
    tensors = _tensors(4)
    _, block = _block_rows(engine, "f", tensors)
    tensors[0] = torch.randn(4, 4).t()  # same dtype and size, transposed
    b, _ = _block_rows(engine, "f", tensors, block, step=1)
    _assert_true_rows(b, tensors, rtol=1e-5)


def test_a_tensor_the_kernel_cannot_read_is_skipped_alone(caplog):
    """A meta tensor in a block (the kernel refuses it): the general path records the others and
    warns once, naming it."""
    engine = StatsEngine(OPS)
    tensors = _tensors(5)
    _, block = _block_rows(engine, "f", tensors)
    odd = list(tensors)
    odd[3] = torch.empty(4, 4, device="meta")
    with caplog.at_level(logging.WARNING):
        engine.capture_block("f", block, odd)
        (b,) = engine.finish_step(1).blocks()
    assert "t3" not in b.names and len(b.names) == len(tensors) - 1
    assert any("t3" in r.getMessage() for r in caplog.records)
    kept = [t for k, t in enumerate(tensors) if k != 3]
    for vals, t in zip(b.values, kept):
        np.testing.assert_allclose(vals[:4], _truth(t)[:4], rtol=1e-5, atol=1e-6)


def test_the_seam_route_is_kept_while_the_layout_holds_and_redone_when_a_device_changes(monkeypatch):
    monkeypatch.setenv(engine_mod.SEAM_ENV, "1")
    engine = StatsEngine(OPS)
    tensors = _tensors(6)
    _, block = _block_rows(engine, "f", tensors)
    plan = block.plan
    assert plan is not None
    b, _ = _block_rows(engine, "f", [t + 1 for t in tensors], block, step=1)
    assert block.plan is plan  # same types, layouts and device: the route is reused
    _assert_true_rows(b, [t + 1 for t in tensors], rtol=1e-5)
    meta = [torch.empty_like(t, device="meta") for t in tensors]
    engine.capture_block("f", block, meta)  # another device: no route kept for it, nothing raised
    engine.discard()


@pytest.mark.parametrize("seam", [False, True], ids=["cpu", "seam"])
def test_a_step_of_a_block_makes_no_python_object_per_row(monkeypatch, seam):
    """The training thread's side of a step (capture and finish_step) allocates the same number
    of tracked objects for 64 and for 2048 tensors: the rows are one matrix, not objects."""
    if seam:
        monkeypatch.setenv(engine_mod.SEAM_ENV, "1")

    def objects_made(n: int) -> int:
        engine = StatsEngine(OPS)
        tensors = [torch.randn(4) for _ in range(n)]
        block = _new_block(engine, tensors)
        for step in range(2):  # warm: kernel loaded, pointer table built
            engine.capture_block("f", block, tensors)
            engine.finish_step(step)
        gc.collect()
        gc.disable()
        try:
            before = len(gc.get_objects())
            engine.capture_block("f", block, tensors)
            rows = engine.finish_step(2)
            made = len(gc.get_objects()) - before
        finally:
            gc.enable()
        assert len(rows) == n  # built here, after counting
        return made

    # the device path's row buffer grows by 512-row chunks: a few views per chunk, not per row
    allowed = 2 + (2 * 2048 // 512 if seam else 0)
    assert objects_made(2048) <= objects_made(64) + allowed
