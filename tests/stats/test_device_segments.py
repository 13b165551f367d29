"""Small separate tensors on the device path (through the seam): one write's small tensors are
reduced as segments of one flat buffer per dtype, a constant number of aten ops and Python frames
whatever their number, the rows written as blocks (no view per row); values against float64 truth."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainmon.stats import device_rows
from trainmon.stats.device_rows import DeviceRows
from trainmon.testing.op_counter import OpCounter

COLUMNS = ["count", "sum", "sumsq", "min", "max", "nans", "infs", "zeros", "m2"]
SHIPPED = ["count", "sum", "sumsq", "min", "max", "nans"]  # norm, mean, min, max, nans
EPS = 1e-8


@pytest.fixture(autouse=True)
def seam(monkeypatch):
    monkeypatch.setenv("TRAINMON_DEVICE_PATH", "1")


def _tiny(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 4, generator=g) if k % 2 == 0 else torch.randn(4, generator=g) for k in range(n)]


def _truth(t: torch.Tensor) -> list[float]:
    """The partials row of ``t`` in float64 (merge identities when empty)."""
    x = t.detach().double().reshape(-1)
    if x.numel() == 0:
        return [0.0, 0.0, 0.0, math.inf, -math.inf, 0.0, 0.0, 0.0, 0.0]
    return [
        float(x.numel()),
        x.sum().item(),
        (x * x).sum().item(),
        x.min().item(),
        x.max().item(),
        float(x.isnan().sum()),
        float(x.isinf().sum()),
        float((x.abs() < EPS).sum()),
        ((x - x.mean()) ** 2).sum().item(),
    ]


def _rows(tensors, columns=COLUMNS, pad=0):
    rows = DeviceRows(torch.device("cpu"), columns, EPS)
    if pad:
        rows.write([torch.ones(2) for _ in range(pad)])  # the batch's rows run into the next buffer chunk
    handles = rows.write(tensors)
    return rows.snapshot().rows(columns)[[r for _, r in handles]]


def _assert_rows(got: np.ndarray, tensors, rtol: float) -> None:
    for t, row in zip(tensors, got):
        for c, g, w in zip(COLUMNS, row, _truth(t)):
            if math.isnan(w):
                assert math.isnan(g), (c, g)
            elif c in ("count", "nans", "infs", "zeros") or math.isinf(w):
                assert g == w, (c, t.dtype, g, w)
            else:
                assert g == pytest.approx(w, rel=rtol, abs=1e-6 * math.sqrt(_truth(t)[2] or 1.0)), (c, t.dtype, g, w)


def test_segments_equal_float64_truth_for_every_dtype_nan_inf_empty_and_layout():
    g = torch.Generator().manual_seed(3)
    tensors = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = torch.randn(37, 11, generator=g) * 3 + 0.5
        t[t.abs() < 0.3] = 0.0
        tensors += [t.to(dtype), t.to(dtype).t(), t.to(dtype)[::2, 1::3], torch.empty(0, dtype=dtype)]
    tensors += [
        torch.tensor([1.0, math.nan, math.inf, 0.0]),
        torch.tensor([-math.inf, 2.0]),
        torch.full((3,), math.nan),
        torch.rand(4096, generator=g) + 1.0,  # a segment of the largest size: blocked accumulation
        torch.zeros(5),
    ]
    got = _rows(tensors, pad=505)  # 510 + 2 pad rows: the batch straddles two buffer chunks
    _assert_rows(got, tensors, rtol=2e-6)


@pytest.mark.parametrize("value", [1e20, 3e38, -3e38])
def test_a_sum_of_squares_beyond_float32_keeps_a_finite_norm(value):
    tensors = [torch.full((3,), value), torch.tensor([value, 1.0])] + _tiny(4)
    got = _rows(tensors)
    for t, row in zip(tensors, got):
        norm = t.double().norm().item()
        want = norm if norm < 3.4e38 else math.inf  # beyond float32 itself: inf in the float32 row
        assert math.sqrt(row[2]) == pytest.approx(want, rel=1e-6)
        assert row[3] == t.double().min().item() and row[4] == t.double().max().item()


@pytest.mark.parametrize("value", [1e-30, 1e-40, 1e-45, 0.0])
def test_squares_below_float32_do_not_vanish_from_the_norm(value):
    """Tensors whose largest |x| is tiny or subnormal (their squares underflow float32) keep a
    norm equal to the float64 one (as the float32 row holds it: a subnormal norm has fewer
    digits): the scale is the float's own exponent field."""
    tensors = [torch.full((3,), value), torch.tensor([value, -value / 2])] + _tiny(4)
    got = _rows(tensors)
    for t, row in zip(tensors, got):
        norm = torch.tensor(t.double().norm().item(), dtype=torch.float32).item()
        assert math.sqrt(row[2]) == pytest.approx(norm, rel=1e-6, abs=0.0)
        assert row[3] == t.double().min().item() and row[4] == t.double().max().item()


def test_the_largest_segment_is_summed_in_blocks_as_accurately_as_torch_sum():
    g = torch.Generator().manual_seed(11)
    tensors = [torch.rand(device_rows._SMALL, generator=g) + 0.5 for _ in range(6)]
    got = _rows(tensors)
    for t, row in zip(tensors, got):
        truth = t.double().sum().item()
        assert abs(row[1] - truth) / truth < 1e-6  # sequential float32 over 4096 elements: ~5e-6
        assert abs(row[1] - truth) <= 4 * abs(t.sum().item() - truth) + 1e-3 * abs(truth) * 1e-4


def test_batches_split_by_the_element_budget_give_the_same_rows(monkeypatch):
    tensors = _tiny(40, seed=5)
    whole = _rows(tensors)
    monkeypatch.setattr(device_rows, "_SEG_BUDGET", 50)  # about three tensors a batch
    split = _rows(tensors)
    np.testing.assert_array_equal(whole, split)
    _assert_rows(split, tensors, rtol=1e-6)


class _AllOps(TorchDispatchMode):
    """Every aten op, views included (OpCounter leaves views out)."""

    def __init__(self):
        super().__init__()
        self.names: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.names[name] = self.names.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _write_counted(n: int, columns):
    tensors = _tiny(n)
    rows = DeviceRows(torch.device("cpu"), columns, EPS)
    rows.write(tensors)  # first sight: the layout's index tensors and the row buffer
    rows.clear()
    with OpCounter() as ops, _AllOps() as every:
        rows.write(tensors)
    calls = 0

    def profile(_frame, event, _arg):
        nonlocal calls
        calls += event == "call"

    rows.clear()
    sys.setprofile(profile)
    try:
        rows.write(tensors)
    finally:
        sys.setprofile(None)
    return ops, every.names, calls


@pytest.mark.parametrize("columns", [SHIPPED, COLUMNS])
def test_aten_ops_and_python_frames_of_a_write_do_not_grow_with_the_tensor_count(columns):
    ops64, every64, calls64 = _write_counted(64, columns)
    ops512, every512, calls512 = _write_counted(512, columns)
    # the shipped ops: 21 (25 while the extremes went through the blocks); all ops with m2: 33
    assert ops64.ops == ops512.ops <= (21 if columns == SHIPPED else 33), ops512.names
    assert ops512.syncs == 0 and ops512.copies == 0
    # rows are addressed as blocks: no view per row (a select per reduced column, a slice per
    # buffer chunk and column block)
    assert every64.get("select", 0) == every512.get("select", 0) <= 8
    assert every512.get("slice", 0) <= 8
    assert calls64 == calls512 <= 20


def test_a_write_with_fp32_and_bf16_tensors_takes_one_batch_per_dtype():
    tensors = _tiny(8) + [t.bfloat16() for t in _tiny(8, seed=1)]
    rows = DeviceRows(torch.device("cpu"), SHIPPED, EPS)
    rows.write(tensors)
    rows.clear()
    with OpCounter() as c:
        rows.write(tensors)
    assert c.names["cat"] == 2
    _assert_rows(_rows(tensors), tensors, rtol=1e-6)
