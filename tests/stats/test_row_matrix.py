"""Rows as a float64 matrix (issue #31, build 2 and 4): the engine hands each block's statistics as
``RowBlock.matrix`` and builds the per-row ``values`` lists only when a sink reads them (the CSV
sink formats the matrix itself).  Checked: the lazy values against numpy/torch float64 truth and
the old per-row conversion, the CSV bytes of a matrix block against those of its values, the
layout lists reused step after step, hook items reused while a shape holds, and the young
garbage of building a step (deterministic counts)."""

from __future__ import annotations

import dataclasses
import gc
import math

import numpy as np
import pytest
import torch

from trainmon.sinks import csv as csv_mod
from trainmon.sinks.base import SinkOptions
from trainmon.sinks.csv import CsvSink
from trainmon.stats import engine as engine_mod
from trainmon.stats import rows as rows_mod
from trainmon.stats.engine import StatsEngine
from trainmon.stats.rows import RowBlock, StepRows

OPS = ("norm", "mean", "min", "max", "nans")


def _old_values(matrix: np.ndarray, ints: tuple[int, ...]) -> list[list]:
    """What the engine built before the matrix: ``tolist`` and ``int`` of each count."""
    out = matrix.tolist()
    for row in out:
        for j in ints:
            row[j] = int(row[j]) if row[j] == row[j] else row[j]
    return out


def _block(matrix: np.ndarray, ints=(4,), stats=OPS, step=3) -> RowBlock:
    n = len(matrix)
    return RowBlock(
        "grad_reduced",
        step,
        None,
        None,
        stats,
        [f"w{i}" for i in range(n)],
        [0] * n,
        [(4, 4)] * n,
        ["torch.float32"] * n,
        matrix=matrix,
        integer_columns=ints,
    )


def test_values_are_built_from_the_matrix_as_before_and_only_when_read(monkeypatch):
    rng = np.random.default_rng(0)
    matrix = rng.standard_normal((300, 5))
    matrix[:, 4] = rng.integers(0, 1000, 300)
    calls = []
    real = rows_mod.values_of
    monkeypatch.setattr(rows_mod, "values_of", lambda *a: calls.append(1) or real(*a))
    block = _block(matrix)
    assert calls == []
    got = block.values
    assert block.values is got and calls == [1]  # built once, then a plain slot
    assert got == _old_values(matrix, (4,))
    assert all(type(r[4]) is int and type(r[0]) is float for r in got)
    assert [s.stats for s in block.rows()][7] == dict(zip(OPS, matrix[7, :4].tolist() + [int(matrix[7, 4])]))


def test_a_nan_or_infinite_count_stays_a_float():
    matrix = np.array([[1.0, 2.0, 3.0], [4.0, math.nan, 6.0], [7.0, math.inf, -math.inf], [0.0, 5.0, 2.0**70]])
    values = _block(matrix, ints=(1, 2), stats=("a", "b", "c")).values
    assert values[0] == [1.0, 2, 3] and type(values[0][1]) is int
    assert math.isnan(values[1][1]) and type(values[1][1]) is float and values[1][2] == 6
    assert values[2][1] == math.inf and values[2][2] == -math.inf
    assert values[3][2] == 2**70 and type(values[3][2]) is int  # beyond int64: exact, as int() is


def test_a_block_needs_values_or_a_matrix_and_compares_by_values():
    with pytest.raises(ValueError, match="values or a matrix"):
        RowBlock("f", 0, None, None, ("a",), ["x"], [0], [()], ["torch.float32"])
    matrix = np.array([[1.0, 2.0]])
    a = _block(matrix, ints=(1,), stats=("a", "n"))
    b = dataclasses.replace(a, matrix=None, values=[[1.0, 2]])
    assert a == b and dataclasses.replace(a, names=["y"]).values == [[1.0, 2]]


def _csv_bytes(tmp_path, name: str, blocks: list[RowBlock]) -> dict[str, bytes]:
    out = tmp_path / name
    sink = CsvSink(SinkOptions(rank_dir=out, step_count_per_record=10))
    sink.write(StepRows(lambda: blocks, wall_time=1.0), blocks[0].step)
    sink.close()
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.csv"))}


@pytest.mark.parametrize("formatter", ["as installed", "without orjson"])
def test_csv_of_a_matrix_block_is_the_csv_of_its_values_and_reads_no_values(tmp_path, monkeypatch, formatter):
    """Awkward doubles, counts, a NaN count in a values family, and a block longer than the sink's
    piece size: the same bytes as the per-row values; the values never built where not needed,
    with orjson's one-call formatter or without it (the %-template fed the matrix's floats)."""
    if formatter == "without orjson":
        monkeypatch.setattr(csv_mod, "matrix_cells", lambda *a: None)
    rng = np.random.default_rng(1)
    n = 2100  # > the CSV sink's 2,048-row pieces
    matrix = rng.standard_normal((n, 5)) * 10.0 ** rng.integers(-12, 12, (n, 5))
    matrix[:, 4] = rng.integers(0, 50, n)
    nan_count = np.array([[1.5, math.nan], [2.5, 3.0]])
    built = []
    real = rows_mod.values_of
    monkeypatch.setattr(rows_mod, "values_of", lambda *a: built.append(1) or real(*a))
    fast = _csv_bytes(tmp_path, "matrix", [_block(matrix), _block(nan_count, ints=(1,), stats=("x", "flag"))])
    assert len(built) == 1  # only the NaN-count block (the formatter leaves it to the values)
    plain = [
        dataclasses.replace(_block(matrix), matrix=None, values=_old_values(matrix, (4,))),
        dataclasses.replace(
            _block(nan_count, ints=(1,), stats=("x", "flag")), matrix=None, values=_old_values(nan_count, (1,))
        ),
    ]
    assert fast == _csv_bytes(tmp_path, "values", plain) and len(fast) == 2


def _new_block(engine: StatsEngine, tensors: list[torch.Tensor]):
    items = [(f"t{k}", 0, tuple(t.shape), t.dtype) for k, t in enumerate(tensors)]
    return engine.block(items, [t.dtype for t in tensors], [t.numel() for t in tensors])


@pytest.mark.parametrize("seam", [False, True], ids=["cpu", "seam"])
def test_engine_blocks_hold_a_matrix_of_true_statistics_and_reuse_their_layout_lists(monkeypatch, seam):
    if seam:
        monkeypatch.setenv(engine_mod.SEAM_ENV, "1")
    engine = StatsEngine(OPS)
    g = torch.Generator().manual_seed(2)
    tensors = [torch.randn(3, 5, generator=g) for _ in range(6)]
    tensors[2][0, 1] = float("nan")
    fam = _new_block(engine, tensors)
    got = []
    for step in range(2):
        engine.capture_block("grad_reduced", fam, tensors)
        (b,) = engine.finish_step(step).blocks()
        got.append(b)
    b = got[1]
    assert b.matrix.dtype == np.float64 and b.matrix.flags.c_contiguous and b.matrix.shape == (6, 5)
    assert b.integer_columns == (4,)
    for row, t in zip(b.values, tensors):
        x = t.double().reshape(-1)
        finite = x[~torch.isnan(x)]
        assert row[4] == int(torch.isnan(x).sum()) and type(row[4]) is int
        if row[4] == 0:
            want = [float(torch.linalg.vector_norm(x)), float(x.mean()), float(x.min()), float(x.max())]
            np.testing.assert_allclose(row[:4], want, rtol=1e-6)
        else:
            assert math.isnan(row[0]) and math.isnan(row[1]) and finite.numel() == x.numel() - 1
    # one layout: the very same lists each step (no per-row objects to build, and the CSV sink's
    # template check compares them by identity)
    for a, c in zip(
        (got[0].names, got[0].vpp_stages, got[0].shapes, got[0].dtypes), (b.names, b.vpp_stages, b.shapes, b.dtypes)
    ):
        assert a is c
    assert b.shapes[0] == (3, 5) and type(b.shapes[0]) is tuple and b.dtypes[0] == "torch.float32"


def test_building_a_step_makes_no_python_object_per_row():
    """The writer's side (``StepRows.blocks``) allocates the same tracked objects for 64 and for
    2,048 tensors: one matrix per block, the layout's lists reused."""

    def objects_made(n: int) -> int:
        engine = StatsEngine(OPS)
        tensors = [torch.randn(4) for _ in range(n)]
        fam = _new_block(engine, tensors)
        for step in range(2):  # warm: the layout's lists cached
            engine.capture_block("f", fam, tensors)
            engine.finish_step(step).blocks()
        engine.capture_block("f", fam, tensors)
        rows = engine.finish_step(2)
        gc.collect()
        gc.disable()
        try:
            before = len(gc.get_objects())
            blocks = rows.blocks()
            made = len(gc.get_objects()) - before
        finally:
            gc.enable()
        assert len(blocks[0].names) == n
        return made

    assert objects_made(2048) <= objects_made(64) + 2


def test_hook_items_are_reused_while_a_shape_holds_and_values_stay_exact():
    """Activation-style captures (``capture_tensors``): the same item tuple every step while a
    name's shape and dtype hold, a new one when either changes; every row still true."""
    engine = StatsEngine(OPS)

    def step(tensors, k):
        rows = engine.partials(tensors)
        engine.capture_tensors("actv", 0, ["a.output", "b.output"], tensors, rows, micro_step=0)
        pending = engine._pending[-1].items
        (b,) = engine.finish_step(k).blocks()
        return pending, b

    g = torch.Generator().manual_seed(3)
    first, _ = step([torch.randn(2, 3, generator=g), torch.randn(4, generator=g)], 0)
    ts = [torch.randn(2, 3, generator=g), torch.randn(4, generator=g)]
    second, b = step(ts, 1)
    assert all(x is y for x, y in zip(first, second))
    for row, t in zip(b.values, ts):
        x = t.double()
        np.testing.assert_allclose(row[:4], [x.norm(), x.mean(), x.min(), x.max()], rtol=1e-6)
    third, b = step([torch.randn(5, 3, generator=g), torch.randn(4, generator=g).half()], 2)
    assert third[0] is not second[0] and third[0][2] == (5, 3) and b.shapes == [(5, 3), (4,)]
    assert third[1] is not second[1] and b.dtypes == ["torch.float32", "torch.float16"]
