"""The fused CPU kernel serves every column (nans, infs, zeros, m2 too) in one multi-tensor call:
values against float64 truth and against the eager path, Python frames per batch, and the
engine taking it for the shipped configs."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from trainmon.stats import _fused_cpu
from trainmon.stats import partials as partials_mod
from trainmon.stats.engine import StatsEngine, Tracked
from trainmon.stats.host_rows import HostRows

COLS = _fused_cpu.COLUMNS  # count, sum, sumsq, min, max, nans, infs, zeros, m2
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [0, 1, 15, 16, 17, 511, 512, 513, 100_003]
EPS = 1e-8


@pytest.fixture(autouse=True)
def fused(monkeypatch):
    monkeypatch.setenv(_fused_cpu.ENV, "1")
    if not _fused_cpu.enabled():
        pytest.skip(f"fused CPU kernel does not build here: {_fused_cpu._state.get('error')}")


def truth(t: torch.Tensor, eps: float = EPS) -> dict[str, float]:
    """Every partial from the tensor in float64 (``zeros``: abs(x) < eps with eps rounded to
    float32, the eager path's comparison; m2 NaN once an element is not finite, as torch.var)."""
    d = t.double().reshape(-1)
    if d.numel() == 0:
        return dict(zip(COLS, (0.0, 0.0, 0.0, math.inf, -math.inf, 0.0, 0.0, 0.0, 0.0)))
    eps32 = torch.tensor(eps, dtype=torch.float32).double()
    finite = bool(torch.isfinite(d).all())
    return {
        "count": float(d.numel()),
        "sum": d.sum().item(),
        "sumsq": (d * d).sum().item(),
        "min": d.amin().item(),
        "max": d.amax().item(),
        "nans": float(d.isnan().sum()),
        "infs": float(d.isinf().sum()),
        "zeros": float((d.abs() < eps32).sum()),
        "m2": ((d - d.mean()) ** 2).sum().item() if finite else math.nan,
    }


def fused_rows(tensors, cols=COLS, eps=EPS) -> list[dict[str, float]]:
    out = torch.full((len(tensors), len(cols)), -7.0, dtype=torch.float64)
    _fused_cpu.partials_into(tensors, out, 0, [COLS.index(c) for c in cols], eps)
    return [dict(zip(cols, row)) for row in out.tolist()]


def eager_row(t, cols=COLS, eps=EPS) -> dict[str, float]:
    return dict(zip(cols, partials_mod._cpu_values(t, cols, eps)))


def close(got: dict, want: dict, t: torch.Tensor, rel: float) -> list[str]:
    """The columns where ``got`` and ``want`` differ beyond ``rel`` (sums: relative to the sum of
    magnitudes, which bounds any summation order's error)."""
    scale = t.double().abs().sum().item() if t.numel() else 0.0
    bad = []
    for c, w in want.items():
        g = got[c]
        if math.isnan(w) or math.isnan(g):
            ok = math.isnan(w) and math.isnan(g)
        elif c in ("count", "min", "max", "nans", "infs", "zeros") or math.isinf(w):
            ok = g == w
        elif c == "sum":
            ok = abs(g - w) <= rel * scale + 1e-300
        else:
            ok = g == pytest.approx(w, rel=rel, abs=1e-300)
        if not ok:
            bad.append(f"{c}: {g!r} != {w!r}")
    return bad


def cases(dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for n in SIZES:
        t = torch.randn(n, generator=g) * 3 + 0.5
        t[: n // 7] = 0.0  # exact zeros
        t[n // 7 : n // 5] = 1e-9  # under eps in float32 (fp16 rounds them to 0)
        out.append((f"randn{n}", t.to(dtype)))
    big = 6e4 if dtype is torch.float16 else 1e20  # squares overflow the float lanes
    for n in (17, 513, 100_003):
        t = torch.full((n,), big)
        t[::3] *= -0.5
        out.append((f"huge{n}", t.to(dtype)))
    special = {
        "nan": [(5, math.nan)],
        "pinf": [(600, math.inf)],
        "ninf": [(9_999, -math.inf)],
        "both_inf": [(2, math.inf), (4_000, -math.inf)],
        "nan_and_inf": [(1, math.inf), (700, math.nan), (9_998, -math.inf)],
    }
    for name, where in special.items():
        for n in (513, 10_000):
            t = torch.randn(n, generator=g)
            for i, v in where:
                t[i % n] = v
            out.append((f"{name}{n}", t.to(dtype)))
    out.append(("all_nan", torch.full((1_000,), math.nan).to(dtype)))
    out.append(("all_inf", torch.full((600,), math.inf).to(dtype)))
    out.append(("tail_nan", torch.cat([torch.randn(512, generator=g), torch.tensor([math.nan])]).to(dtype)))
    out.append(("layernorm_like", (1000 + torch.randn(70_000, generator=g) * 1e-3).to(dtype)))
    out.append(("strided", torch.randn(64, 300, generator=g).to(dtype)[:, ::3]))
    out.append(("empty_2d", torch.empty(0, 5, dtype=dtype)))
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_column_matches_float64_truth_and_the_eager_path(dtype):
    named = cases(dtype)
    rows = fused_rows([t for _, t in named])  # one multi-tensor call
    for (name, t), got in zip(named, rows):
        assert not close(got, truth(t), t, 1e-6), (name, close(got, truth(t), t, 1e-6))
        # the eager path rounds its sums to float32: same values within float rounding
        assert not close(got, eager_row(t), t, 1e-5), (name, close(got, eager_row(t), t, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "cols",
    [
        ("count", "nans"),
        ("count", "zeros"),
        ("m2", "count", "sum"),
        ("count", "sum", "sumsq", "min", "max", "nans", "infs"),
    ],
)
def test_column_subsets_in_any_order_are_the_same_values(dtype, cols):
    named = cases(dtype)[:12]
    full = fused_rows([t for _, t in named])
    part = fused_rows([t for _, t in named], cols)
    for f, p in zip(full, part):
        assert all(p[c] == f[c] or (math.isnan(p[c]) and math.isnan(f[c])) for c in cols), (p, f)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("eps", [1e-3, 5.9604645e-08, 1e-8, 0.0])
def test_zeros_use_eps_as_the_eager_float32_comparison_does(dtype, eps):
    # values at and around eps: the boundary is where rounding eps differently would show
    eps32 = torch.tensor(eps, dtype=torch.float32)
    around = [0.0, -0.0, eps, -eps, eps32.item(), torch.nextafter(eps32, torch.tensor(0.0)).item(), 2 * eps, 1.0]
    t = torch.tensor(around * 70, dtype=torch.float32).to(dtype)
    got = fused_rows([t], ("count", "zeros"), eps)[0]
    assert got["zeros"] == truth(t, eps)["zeros"] == eager_row(t, ("count", "zeros"), eps)["zeros"]


def test_a_batch_with_a_sparse_tensor_records_every_other_row_and_the_sparse_one_right():
    dense = [torch.randn(100), torch.randn(7).bfloat16()]
    sparse = torch.tensor([[0.0, 2.0], [math.nan, 0.0]]).to_sparse()
    host = HostRows(len(COLS))
    fused = partials_mod.fused_columns(COLS)
    rows = partials_mod.write_cpu_rows([dense[0], sparse, dense[1]], COLS, EPS, host, fused)
    got = [dict(zip(COLS, r)) for r in host.rows(list(rows)).tolist()]
    for row, t in zip(got, [dense[0], sparse.to_dense(), dense[1]]):
        assert not close(row, truth(t), t, 1e-6), close(row, truth(t), t, 1e-6)


def _python_calls(fn) -> int:
    """Python frames entered while ``fn`` runs (sys.setprofile 'call' events: functions,
    comprehensions, generator resumptions; C calls are 'c_call' and not counted)."""
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        calls += event == "call"

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls - 1  # the call of fn itself


def test_a_batch_costs_a_constant_number_of_python_frames():
    columns = partials_mod.device_columns(("count", "sum", "sumsq", "min", "max", "nans", "zeros", "m2"))
    fused = partials_mod.fused_columns(columns)
    assert fused is not None
    counts = {}
    for n in (8, 512):
        tensors = [torch.nn.Parameter(torch.randn(16)) for _ in range(n)]
        tensors[3] = tensors[3].detach()[::2]  # one non-contiguous tensor: copied, still one call
        host = HostRows(len(columns))
        out = torch.empty((n, len(columns)), dtype=torch.float64)
        fill = _python_calls(lambda: _fused_cpu.fill_rows(tensors, out, 0, fused, EPS))  # noqa: B023
        write = _python_calls(lambda: partials_mod.write_cpu_rows(tensors, columns, EPS, host, fused))  # noqa: B023
        engine = StatsEngine(["norm", "mean", "min", "max", "nans", "zeros", "std"])
        engine.partials(tensors)  # decides the path (builds nothing new: the kernel is loaded)
        step = _python_calls(lambda: engine.partials(tensors))  # noqa: B023
        counts[n] = (fill, write, step)
        want = [truth(t) for t in tensors]
        for row, w, t in zip(out.tolist(), want, tensors):
            assert not close(dict(zip(columns, row)), {c: w[c] for c in columns}, t, 1e-6)
    assert counts[512] == counts[8], counts  # nothing per tensor
    fill, write, step = counts[512]
    assert fill <= 6 and write <= 10 and step <= 14, counts[512]


OPS = ["norm", "mean", "min", "max", "nans", "zeros", "std"]


def _engine_rows(tensors, monkeypatch, fused: str, eps: float):
    monkeypatch.setenv(_fused_cpu.ENV, fused)
    engine = StatsEngine(OPS, eps)
    engine.capture("w", [Tracked(f"t{i}", t) for i, t in enumerate(tensors)])
    for i, t in enumerate(tensors):  # the per-hook path of activations (StatsEngine.partial)
        engine.capture_tensors("a", 0, [f"a{i}"], [t], [engine.partial(t)])
    return engine.stats_paths, [r.stats for r in engine.finish_step(0)]


@pytest.mark.parametrize("eps", [1e-8, 0.05])
def test_the_engine_takes_the_fused_path_for_every_op_with_the_eager_values(monkeypatch, eps):
    g = torch.Generator().manual_seed(9)
    tensors = [torch.randn(n, generator=g).to(dt) for n in (1, 513, 40_000) for dt in DTYPES]
    tensors += [torch.tensor([0.0, math.nan, 1.0, 0.01]), torch.tensor([math.inf, 1.0, -2.0])]
    paths, fused = _engine_rows(tensors, monkeypatch, "1", eps)
    eager_paths, eager = _engine_rows(tensors, monkeypatch, "0", eps)
    assert paths == {"cpu": "cpu-fused"} and eager_paths == {"cpu": "cpu-eager"}
    assert len(fused) == len(eager) == 2 * len(tensors)
    for f, e, t in zip(fused, eager, tensors + tensors):
        assert f.keys() == e.keys() == set(OPS)
        for op in OPS:
            if isinstance(e[op], float) and math.isnan(e[op]):
                assert math.isnan(f[op]), op
            else:
                assert f[op] == pytest.approx(e[op], rel=1e-5, abs=1e-6), (op, t.dtype, t.numel())
        d = t.double()
        want_zeros = float((d.abs() < torch.tensor(eps, dtype=torch.float32).double()).double().mean())
        assert f["zeros"] == pytest.approx(want_zeros, rel=1e-12) and f["nans"] == int(d.isnan().sum())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_bit_pattern_of_the_16_bit_dtypes_is_read_as_torch_reads_it(dtype):
    # subnormals, ±0, ±Inf and NaN payloads included: one row per value, one call
    values = torch.arange(65_536, dtype=torch.int32).to(torch.int16).view(dtype)
    out = torch.empty((values.numel(), 2), dtype=torch.float64)
    _fused_cpu.partials_into(list(values.reshape(-1, 1).unbind(0)), out, 0, [COLS.index("min"), COLS.index("nans")])
    want = values.double()
    assert torch.equal(out[:, 1] == 1, want.isnan())
    finite = ~want.isnan()
    assert torch.equal(out[finite, 0], want[finite])
    assert torch.equal(torch.signbit(out[finite, 0]), torch.signbit(want[finite]))  # -0.0 stays -0.0
