"""Numbers to CSV text a block at a time (``trainmon.sinks.csv_text``) and the CSV sink built on it:
every cell byte for byte what ``repr``/``str`` writes, checked against ``repr`` itself."""

from __future__ import annotations

import math
import sys
from collections import Counter

import numpy as np
import pytest

from trainmon.sinks import csv_text
from trainmon.sinks.base import SinkOptions
from trainmon.sinks.csv import CsvSink
from trainmon.stats.rows import RowBlock, StepRows


def _awkward_doubles(n: int, seed: int = 0) -> list[float]:
    """Doubles that stress shortest round-trip printing: uniform bit patterns, float32 values seen as
    float64 (what reductions of fp32 tensors give), powers of two and their neighbours, decades
    around repr's layout switches (1e-4/1e-5 and 1e16), integers, and named extremes."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**64, n, dtype=np.uint64, endpoint=False).view(np.float64)
    with np.errstate(invalid="ignore"):  # signalling NaN bit patterns
        f32 = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32).astype(np.float64)
    p2 = np.ldexp(1.0, rng.integers(-1074, 1024, n)) * rng.choice([1.0, -1.0], n)
    decades = rng.standard_normal(n) * 10.0 ** rng.integers(-8, 20, n)
    ints = rng.integers(-(10**6), 10**6, n).astype(np.float64) * 10.0 ** rng.integers(-6, 18, n)
    named = [
        0.0,
        -0.0,
        1e-4,
        9.999999999999999e-05,
        1e-5,
        1.5e-5,
        1e15,
        9999999999999998.0,
        1e16,
        1e22,
        5e-324,
        2.2250738585072014e-308,
        1.7976931348623157e308,
        0.1,
        1 / 3,
        10.00001234,
        100.00000001,
    ]
    pool = np.concatenate([bits, f32, p2, np.nextafter(p2, np.inf), np.nextafter(p2, -np.inf), decades, ints, named])
    return pool[np.isfinite(pool)].tolist()


def _rows(values: list, width: int) -> list[list]:
    return [values[i : i + width] for i in range(0, len(values) - width + 1, width)]


needs_fast = pytest.mark.skipif(not csv_text.fast_available(), reason="orjson (the block formatter) not installed")


@needs_fast
def test_row_cells_equal_repr_on_awkward_doubles_and_ints():
    values = _awkward_doubles(20_000)
    rows = _rows(values, 5)
    rows += [[3, -7, 0, 2**62, 1.5], [12345678901234567, 0.5, -1, 0, 1]]  # counts: Python ints
    got = csv_text.row_cells(rows)
    assert got == [",".join(map(repr, row)).encode() for row in rows]


@pytest.mark.parametrize(
    "rows",
    [
        [[1.0, math.nan]],
        [[math.inf, 2.0]],
        [[-math.inf]],
        [[True, 1.0]],
        [[np.float64(1.5)]],
        [[2**70]],
        [],
        [[]],
    ],
    ids=["nan", "inf", "-inf", "bool", "numpy-scalar", "huge-int", "no-rows", "no-columns"],
)
def test_row_cells_leaves_what_it_cannot_vouch_for_to_the_exact_path(rows):
    assert csv_text.row_cells(rows) is None


def _blocks(values: list[float]) -> list[RowBlock]:
    rows = _rows(values, 4)
    names = [f"layer.{i}.weight" for i in range(len(rows))]
    names[:3] = ['odd,"name"', "100%_done", "nul\x00name"]  # quoting, a % and the template's marker
    n = len(rows)
    return [
        RowBlock(
            "grad_reduced",
            12,
            None,
            None,
            ("norm", "mean", "min", "nans"),
            names,
            [0] * n,
            [(4, 4)] * n,
            ["torch.float32"] * n,
            [[a, b, c, int(abs(d)) % 9] for a, b, c, d in rows],
        ),
        RowBlock(
            "actv",
            12,
            3,
            None,
            ("norm", "max"),
            names[3:9],
            [1] * 6,
            [(2,)] * 6,
            ["torch.bfloat16"] * 6,
            [[math.nan, 1.0], [math.inf, -math.inf]] + [r[:2] for r in rows[:4]],
        ),
        RowBlock(
            "comm",
            12,
            None,
            {"op": "all_reduce", "when": "50%"},
            ("norm",),
            ["x", "y"],
            [0, 0],
            [(4,), ()],
            ["torch.float32", "%s"],
            [[0.1 + 0.2], [1e-5]],
        ),
    ]


@needs_fast
@pytest.mark.parametrize("ndigits", [None, 4])
def test_sink_bytes_identical_with_and_without_the_block_formatter(tmp_path, monkeypatch, ndigits):
    """The same steps written with the one-call formatter and with the per-value path (orjson
    hidden) give the same files, byte for byte, on every file the sink writes."""
    values = _awkward_doubles(300, seed=1)
    files = {}
    for how in ("fast", "per-value"):
        if how == "per-value":
            monkeypatch.setattr(csv_text, "_dumps", None)
        out = tmp_path / how
        sink = CsvSink(SinkOptions(rank_dir=out, ndigits=ndigits, step_count_per_record=10))
        for step in (10, 11):  # the second step reuses the cached templates
            blocks = [b.__class__(**{**_fields(b), "step": step}) for b in _blocks(values)]
            sink.write(StepRows(lambda blocks=blocks: blocks, wall_time=1.0), step)
        sink.close()
        files[how] = {p.name: p.read_bytes() for p in sorted(out.glob("*.csv"))}
    assert files["fast"] == files["per-value"] and len(files["fast"]) == 3


def _fields(b: RowBlock) -> dict:
    return {f: getattr(b, f) for f in b.__dataclass_fields__}


@needs_fast
def test_sink_cells_read_back_are_repr_of_each_value(tmp_path):
    """Independent of the sink's own fallback: each data line equals the text built here from repr."""
    values = _awkward_doubles(200, seed=2)
    rows = _rows(values, 3)
    n = len(rows)
    block = RowBlock(
        "param_origin",
        5,
        None,
        None,
        ("norm", "mean", "max"),
        [f"p{i}" for i in range(n)],
        [0] * n,
        [(3,)] * n,
        ["torch.float32"] * n,
        rows,
    )
    sink = CsvSink(SinkOptions(rank_dir=tmp_path))
    sink.write(StepRows(lambda: [block], wall_time=1.0), 5)
    sink.close()
    lines = (tmp_path / "param_origin_5-5.csv").read_text().splitlines()
    assert lines[0] == "vpp_stage,name,step,norm,mean,max,shape,dtype"
    assert lines[1:] == [f"0,p{i},5,{','.join(map(repr, row))},[3],torch.float32" for i, row in enumerate(rows)]


def _grad_block(n: int) -> RowBlock:
    rng = np.random.default_rng(3)
    mat = np.abs(rng.standard_normal((n, 4))).astype(np.float32).astype(np.float64) * [1.0, 1e-5, 1e-3, 10.0]
    return RowBlock(
        "grad_reduced",
        1,
        None,
        None,
        ("norm", "mean", "min", "max", "nans"),
        [f"w{i}" for i in range(n)],
        [0] * n,
        [(4, 4)] * n,
        ["torch.float32"] * n,
        [[*r, 0] for r in mat.tolist()],
    )


def _calls(fn) -> Counter:
    """Every Python frame and every C call ``fn`` makes, by name (exact, unlike a timing)."""
    seen: Counter = Counter()

    def profile(frame, event, arg):
        if event == "call":
            seen[frame.f_code.co_name] += 1
        elif event == "c_call":
            seen[arg.__name__] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


@needs_fast
def test_a_block_is_formatted_in_one_orjson_call_whatever_its_row_count(tmp_path, monkeypatch):
    """The point of the block path, counted exactly (its CPU per row is in
    ``benchmarks/host_cost.py``): one ``orjson`` call for all of a block's values and no Python
    call per row or per value, so 1,024 rows cost the same calls as 64."""
    dumps = []
    real = csv_text._dumps
    monkeypatch.setattr(csv_text, "_dumps", lambda *a, **k: dumps.append(1) or real(*a, **k))
    sink = CsvSink(SinkOptions(rank_dir=tmp_path))
    counts = []
    for n in (64, 1024):
        block = _grad_block(n)
        sink._block_text(block)  # the layout's template is built once, then reused
        dumps.clear()
        counts.append(_calls(lambda b=block: sink._block_text(b)))
        assert len(dumps) == 1
    assert counts[0] == counts[1], counts
    assert "repr" not in counts[1] and sum(counts[1].values()) < 40, counts[1]


def _matrix_block_type():
    """RowBlock with the engine's float64 matrix beside (or instead of) the value lists."""
    if "matrix" in RowBlock.__dataclass_fields__:
        return RowBlock
    from dataclasses import dataclass

    @dataclass(frozen=True, slots=True)
    class MatrixBlock(RowBlock):
        matrix: np.ndarray | None = None
        integer_columns: tuple[int, ...] = ()

    return MatrixBlock


@needs_fast
@pytest.mark.parametrize("counts", [(), (4,), (1, 2), (0, 4)], ids=["none", "last", "middle", "ends"])
def test_matrix_blocks_give_repr_text_per_cell(tmp_path, counts):
    """A block handed as a float64 matrix (count columns as ints) is written exactly as the values
    Python would print: repr of each float, str(int(x)) of each count."""
    rng = np.random.default_rng(4)
    values = np.array(_awkward_doubles(100, seed=4)[:600]).reshape(-1, 5)
    for j in counts:
        values[:, j] = rng.integers(0, 1000, len(values))
    values[3, list(counts) or [0]] = 0.0
    n = len(values)
    block = _matrix_block_type()(
        "exp_avg",
        9,
        None,
        None,
        ("a", "b", "c", "d", "e"),
        [f"w{i}" for i in range(n)],
        [0] * n,
        [(2,)] * n,
        ["torch.float32"] * n,
        None,
        matrix=values,
        integer_columns=counts,
    )
    sink = CsvSink(SinkOptions(rank_dir=tmp_path))
    sink.write(StepRows(lambda: [block], wall_time=1.0), 9)
    sink.close()

    def cell(j, x):
        return str(int(x)) if j in counts else repr(x)

    want = [
        f"0,w{i},9,{','.join(cell(j, x) for j, x in enumerate(row))},[2],torch.float32"
        for i, row in enumerate(values.tolist())
    ]
    assert (tmp_path / "exp_avg_9-9.csv").read_text().splitlines()[1:] == want


@needs_fast
def test_matrix_cells_refuses_nan_counts_and_nonfinite_values():
    m = np.array([[1.0, 2.0], [3.0, np.nan]])
    assert csv_text.matrix_cells(m, (1,)) is None  # a NaN count: only the values path knows
    assert csv_text.matrix_cells(m) is None  # NaN: orjson would write null
    assert csv_text.matrix_cells(np.array([[1.0, np.inf]])) is None
    assert csv_text.matrix_cells(np.array([[1.5, 2.0]]), (1,)) == [[b"1.5"], [b"2"]]
    # float32 prints its own shortest digits ("0.1"), not the float64 value's repr
    assert csv_text.matrix_cells(np.array([[0.1]], dtype=np.float32)) is None


@pytest.mark.parametrize("formatter", ["orjson", "repr-template"])
def test_block_text_equals_the_per_line_path_nan_and_infinities_included(monkeypatch, tmp_path, formatter):
    """Every block path against the sink's line-at-a-time ``repr`` path (the reference), on blocks
    with NaN, +-inf, counts, odd names and extra cells; without orjson the block is one ``%r``
    template filled in C."""
    if formatter == "orjson" and not csv_text.fast_available():
        pytest.skip("orjson not installed")
    if formatter == "repr-template":
        monkeypatch.setattr(csv_text, "_dumps", None)
    sink = CsvSink(SinkOptions(rank_dir=tmp_path))
    for block in _blocks(_awkward_doubles(200, seed=5)):
        for _ in range(2):  # built, then from the cache
            assert sink._block_text(block) == "".join(sink._block_lines(block)).encode()


@pytest.mark.parametrize("with_matrix", [False, True])
def test_a_block_larger_than_one_piece_is_written_whole_and_in_order(tmp_path, with_matrix):
    """Blocks above 2,048 rows are formatted in pieces (the GIL offered between them); the file is
    the same as the per-line path's."""
    from trainmon.sinks.csv import _PIECE_ROWS

    n = 2 * _PIECE_ROWS + 17
    values = np.array(_awkward_doubles(n, seed=6)[: n * 3]).reshape(n, 3)
    values[:, 2] = np.arange(n) % 5  # a count column
    rows = [[a, b, int(c)] for a, b, c in values.tolist()]
    kw = {"matrix": values, "integer_columns": (2,)} if with_matrix else {}
    block_type = _matrix_block_type() if with_matrix else RowBlock
    block = block_type(
        "grad_reduced",
        3,
        None,
        None,
        ("norm", "mean", "nans"),
        [f"w{i}" for i in range(n)],
        [0] * n,
        [(2,)] * n,
        ["torch.float32"] * n,
        rows,
        **kw,
    )
    sink = CsvSink(SinkOptions(rank_dir=tmp_path))
    sink.write(StepRows(lambda: [block], wall_time=1.0), 3)
    sink.close()
    want = "".join(sink._block_lines(block))
    assert (tmp_path / "grad_reduced_3-3.csv").read_text() == "vpp_stage,name,step,norm,mean,nans,shape,dtype\n" + want
