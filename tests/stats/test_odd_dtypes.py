"""Tensors the reductions cannot take as they are (issue 34, items 4, 5, 6, 19 and the per-tensor
floor): sparse layouts are recorded as the dense tensors they represent, float8 and other dtypes
without kernels through an fp32 upcast, tensors without data are skipped alone with one warning,
and a missing C compiler is one WARNING on stderr.  Every value is checked against the float64
statistics of the (densified) tensor, on every CPU path: the fused kernel on, off, and the
device path (its CPU seam)."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests._support.runs import reference_stats
from trainmon.stats import odd_tensors
from trainmon.stats.engine import StatsEngine, Tracked
from trainmon.stats.table import DEFAULT_OPS, STAT_NAMES

ALL = tuple(STAT_NAMES)
EPS = 1e-8


@pytest.fixture(autouse=True, params=["fused", "eager", "device"])
def stats_path(request, monkeypatch):
    """Every test here runs on the fused CPU kernel's engine, the eager one and the device path."""
    monkeypatch.setenv("TRAINMON_FUSED_CPU", "0" if request.param == "eager" else "1")
    if request.param == "device":
        monkeypatch.setenv("TRAINMON_DEVICE_PATH", "1")
    else:
        monkeypatch.delenv("TRAINMON_DEVICE_PATH", raising=False)
    monkeypatch.setattr(odd_tensors, "_WARNED", set())
    return request.param


def _stats(tensors, ops, via="capture"):
    """Rows of ``tensors`` through one of the engine's capture routes (weights, hooks, one tensor)."""
    engine = StatsEngine(ops, EPS)
    names = [f"t{i}" for i in range(len(tensors))]
    if via == "capture":
        engine.capture("x", [Tracked(n, t) for n, t in zip(names, tensors)])
    elif via == "hooks":
        engine.capture_tensors("x", 0, names, tensors, engine.partials(tensors), micro_step=0)
    else:
        for n, t in zip(names, tensors):
            engine.capture_tensors("x", 0, [n], [t], [engine.partial(t)], micro_step=0)
    return {r.name: r.stats for r in engine.finish_step(0)}


def _check(got: dict, truth: dict, ops, rel: float = 1e-6) -> None:
    for op in ops:
        want, have = truth[op], got[op]
        if isinstance(want, float) and math.isnan(want):
            assert math.isnan(have), (op, have)
        else:
            tol = max(truth["_mean_atol"], 1e-12) if op == "mean" else 1e-12
            assert have == pytest.approx(want, rel=rel, abs=tol), (op, have, want)


def _coo(indices, values, size):
    return torch.sparse_coo_tensor(torch.tensor(indices), torch.tensor(values), size)


def _sparse_cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    dense = torch.randn(6, 5, generator=g)
    dense[dense.abs() < 0.6] = 0.0
    full = torch.randn(4, 3, generator=g) + 5.0  # every element stored: no implicit zero
    return {
        # an embedding grad: rows repeat (uncoalesced, duplicates add up), one explicit zero
        "coo_duplicates": _coo(
            [[1, 3, 3, 7, 1]], [[0.5, -1.0], [2.0, 0.0], [-3.0, 1.5], [0.0, 0.0], [0.25, 4.0]], (9, 2)
        ),
        "coo_scalars": _coo([[0, 4, 4, 2], [1, 0, 0, 3]], [1.5, -2.0, 0.5, 3.0], (5, 4)),
        "coo_nonfinite": _coo([[0, 2, 5]], [float("nan"), float("inf"), -1.0], (8,)),
        "coo_all_implicit": torch.sparse_coo_tensor(torch.zeros((2, 0), dtype=torch.long), torch.zeros(0), (3, 4)),
        "coo_fully_dense": full.to_sparse(),
        "coo_hybrid": dense.to_sparse(1),
        "coo_bf16": _coo([[0, 3, 3]], [1.25, -2.5, 0.75], (6,)).to(torch.bfloat16),
        "csr": dense.to_sparse_csr(),
        "csc": dense.to_sparse_csc(),
        "csr_fully_dense": full.to_sparse_csr(),
        "bsr": torch.cat([dense, torch.zeros(6, 1)], 1).to_sparse_bsr((2, 2)),
    }


@pytest.mark.parametrize("ops", [ALL, DEFAULT_OPS], ids=["all-ops", "default-ops"])
@pytest.mark.parametrize("via", ["capture", "hooks", "one"])
def test_sparse_tensors_get_the_statistics_of_the_dense_tensor_they_represent(ops, via, caplog):
    cases = _sparse_cases()
    names = list(cases)
    dense_before = {n: t.to_dense().clone() for n, t in cases.items()}
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        got = _stats(list(cases.values()), ops, via)
    assert sorted(got) == sorted(f"t{i}" for i in range(len(names))), "every sparse tensor has its row"
    for i, name in enumerate(names):
        truth = reference_stats(dense_before[name].double(), EPS)
        _check(got[f"t{i}"], truth, ops, rel=1e-6)
        after = cases[name].to_dense()
        assert torch.allclose(after, dense_before[name], rtol=0, atol=0, equal_nan=True), "left as it was"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    # the cases cover what the statistics must count: implicit + explicit zeros, none at all
    assert not cases["coo_duplicates"].is_coalesced(), "the caller's COO tensor is not coalesced in place"
    assert cases["coo_all_implicit"]._nnz() == 0 and cases["coo_fully_dense"]._nnz() == 12
    assert got[f"t{names.index('coo_all_implicit')}"]["norm"] == 0.0


def test_an_uncoalesced_coo_tensor_is_summed_before_its_extremes_are_taken():
    # stored 2.0 and -3.0 at one index: the dense element is -1.0, not min -3.0 / max 2.0
    t = _coo([[1, 1]], [2.0, -3.0], (3,))
    (got,) = _stats([t], ALL).values()
    assert (got["min"], got["max"], got["mean"]) == (-1.0, 0.0, pytest.approx(-1 / 3))
    assert got["zeros"] == pytest.approx(2 / 3)


def _float8_cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    base = torch.randn(257, generator=g) * 3
    base[:9] = torch.tensor([0.0, -0.0, 1e-3, -1e-3, 448.0, -448.0, 0.015625, 2.0, -0.5])
    out = {}
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):
        out[str(dtype)] = base.to(dtype)
    out["float8_e8m0fnu"] = base.abs().clamp_min(2.0**-20).to(torch.float8_e8m0fnu)
    out["e4m3fn_nan"] = torch.tensor([1.0, float("nan"), -2.0]).to(torch.float8_e4m3fn)
    out["e5m2_inf"] = torch.tensor([1.0, float("inf"), -2.0, float("-inf")]).to(torch.float8_e5m2)
    out["e4m3fn_2d_transposed"] = base[:256].reshape(16, 16).to(torch.float8_e4m3fn).t()
    out["e4m3fn_empty"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    out["uint16"] = torch.arange(7).to(torch.uint16)
    out["uint32"] = (torch.arange(7) * 1000).to(torch.uint32)
    return out


@pytest.mark.parametrize("ops", [ALL, DEFAULT_OPS], ids=["all-ops", "default-ops"])
@pytest.mark.parametrize("via", ["capture", "hooks", "one"])
def test_float8_and_other_dtypes_without_kernels_are_reduced_exactly_through_an_fp32_upcast(ops, via):
    cases = _float8_cases()
    got = _stats(list(cases.values()), ops, via)
    for i, (name, t) in enumerate(cases.items()):
        x = t.to(torch.float64)
        if x.numel() == 0:
            assert got[f"t{i}"]["norm"] == 0.0 and math.isnan(got[f"t{i}"]["mean"]), name
            continue
        _check(got[f"t{i}"], reference_stats(x, EPS), ops, rel=1e-6)


def test_a_float8_tensor_keeps_its_dtype_in_the_row():
    engine = StatsEngine(DEFAULT_OPS, EPS)
    t = torch.ones(3).to(torch.float8_e4m3fn)
    engine.capture("x", [Tracked("w", t)])
    (row,) = engine.finish_step(0)
    assert row.dtype == "torch.float8_e4m3fn" and row.stats["norm"] == pytest.approx(math.sqrt(3))


def _unreadable() -> dict[str, torch.Tensor]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    return {
        "meta": torch.empty(4, 3, device="meta"),
        "float4": torch.zeros(8, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
        "fake": FakeTensorMode().from_tensor(torch.randn(5)),
    }


@pytest.mark.parametrize("ops", [ALL, DEFAULT_OPS], ids=["all-ops", "default-ops"])
@pytest.mark.parametrize("via", ["capture", "hooks", "one"])
def test_a_tensor_that_cannot_be_read_is_skipped_alone_with_one_warning(ops, via, caplog):
    g = torch.Generator().manual_seed(1)
    good = [torch.randn(n, generator=g) for n in (3, 70, 5, 9, 11, 13)]
    bad = _unreadable()
    tensors = [good[0], bad["meta"], good[1], bad["float4"], good[2], bad["fake"], *good[3:]]
    good_names = {"t0": good[0], "t2": good[1], "t4": good[2], "t6": good[3], "t7": good[4], "t8": good[5]}
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        for _step in range(2):  # said once, not once a step
            got = _stats(tensors, ops, via)
            assert sorted(got) == sorted(good_names), "every other tensor keeps its row"
            for name, t in good_names.items():
                _check(got[name], reference_stats(t.double(), EPS), ops, rel=1e-6)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    for name, why in (("t1", "meta device"), ("t3", "cannot be computed"), ("t5", "cannot be computed")):
        said = [w for w in warnings if f"'{name}' is not recorded" in w]
        assert len(said) == 1 and why in said[0] and said[0].startswith("trainmon: "), warnings
    assert len(warnings) == 3, warnings


def test_computed_values_on_a_meta_device_are_skipped_alone(caplog):
    from trainmon.stats.engine import Meta

    engine = StatsEngine(DEFAULT_OPS, EPS)
    metas = [Meta("update_ratio", n, 0, (3,), "torch.float32") for n in ("a", "m", "b")]
    values = [torch.tensor(0.5), torch.tensor(0.1, device="meta"), torch.tensor(0.25)]
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        engine.capture_values("update_ratio", metas, values, ("update_ratio",))
        rows = {r.name: r.stats["update_ratio"] for r in engine.finish_step(0)}
    assert rows == {"a": 0.5, "b": 0.25}
    assert "'m' is not recorded" in caplog.text and "meta device" in caplog.text


@pytest.mark.slow
@pytest.mark.parametrize("how", ["CC names no program", "no compiler on PATH"])
def test_a_missing_c_compiler_is_one_warning_on_stderr_under_default_logging(how, tmp_path, stats_path):
    if stats_path != "fused":
        pytest.skip("one subprocess per case is enough")
    script = textwrap.dedent("""
        import torch
        from trainmon.stats.engine import StatsEngine, Tracked
        t = torch.arange(-5.0, 12.0) / 3
        for step in range(3):  # three engines, three steps: still one warning
            engine = StatsEngine(["norm", "mean", "min", "max"])
            engine.capture("x", [Tracked("t", t), Tracked("u", t * 2)])
            rows = {r.name: r.stats for r in engine.finish_step(step)}
        print(engine.stats_paths["cpu"], repr(rows["t"]))
    """)
    cache = tmp_path / "empty-cache"
    cache.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "TRAINMON_FUSED_CPU", "TRAINMON_DEVICE_PATH")}
    env.update(TRAINMON_CACHE_DIR=str(cache), OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd())
    if how == "CC names no program":
        env["CC"] = str(tmp_path / "nonexistent-cc")
    else:
        env["PATH"] = str(tmp_path)  # no cc, gcc or clang; python is started by its full path
    proc = subprocess.run(
        [os.path.realpath(sys.executable), "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "fused CPU stats kernel is unavailable" in ln]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("trainmon: ") and "slower" in lines[0] and "C compiler" in lines[0]
    path, stats = proc.stdout.strip().split(" ", 1)
    x = (torch.arange(-5.0, 12.0) / 3).double()
    got = eval(stats)  # a dict of floats printed with repr
    assert path == "cpu-eager"
    assert got["norm"] == pytest.approx(x.norm().item(), rel=1e-6)
    assert (got["min"], got["max"]) == (pytest.approx(x.min().item()), pytest.approx(x.max().item()))
    assert got["mean"] == pytest.approx(x.mean().item(), rel=1e-6)
    assert not list(cache.glob("*.so")), "nothing was built"


@pytest.mark.slow
def test_a_device_kind_without_pinned_memory_is_probed_read_and_copied_synchronously_after_one_warning(stats_path):
    """torch's lazy (TorchScript) backend: a device kind trainmon does not know, readable by the
    host, with no pinned memory on a CPU-only build; meta tensors beside it are skipped alone."""
    if stats_path != "fused":
        pytest.skip("one subprocess is enough")
    script = textwrap.dedent("""
        import torch, torch._lazy.ts_backend
        torch._lazy.ts_backend.init()
        from trainmon.stats.engine import StatsEngine, Tracked
        ops = ["norm", "mean", "min", "max", "zeros", "std"]
        engine = StatsEngine(ops)
        for step in range(3):
            lazy = torch.arange(-2.0, 7.0, device="lazy") * (step + 1)
            engine.capture("x", [Tracked("lz", lazy), Tracked("m", torch.empty(2, device="meta")),
                                 Tracked("c", torch.ones(3))])
            rows = {r.name: r.stats for r in engine.finish_step(step)}
            print(sorted(rows), repr(rows["lz"]))
    """)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd())
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode != 0 and "ts_backend" in proc.stderr:
        pytest.skip(f"torch's lazy backend is not usable here: {proc.stderr[-200:]}")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 3
    for step, line in enumerate(lines):
        names, stats = line.split("] ", 1)
        assert names == "['c', 'lz'"
        truth = reference_stats(torch.arange(-2.0, 7.0, dtype=torch.float64) * (step + 1))
        _check(eval(stats), truth, ("norm", "mean", "min", "max", "zeros", "std"), rel=1e-6)
    assert proc.stderr.count("no pinned host memory for lazy tensors") == 1, proc.stderr
    assert proc.stderr.count("'m' is not recorded") == 1, proc.stderr
