"""The fused CPU kernel against float64 truth and against the eager path."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainmon.stats import _fused_cpu
from trainmon.stats.partials import _chunked_partials, _cpu_row, compute_partials

REPO = Path(__file__).resolve().parents[2]
COLS = ("count", "sum", "sumsq", "min", "max")


@pytest.fixture(scope="module")
def fused(request):
    os.environ[_fused_cpu.ENV] = "1"
    request.addfinalizer(lambda: os.environ.pop(_fused_cpu.ENV, None))
    if not _fused_cpu.enabled():
        pytest.skip(f"fused CPU kernel does not build here: {_fused_cpu._state.get('error')}")
    return lambda tensors: _fused_cpu.partials_f32(tensors)[:, :5]  # count, sum, sumsq, min, max


def truth(t: torch.Tensor) -> list[float]:
    d = t.double().reshape(-1)
    if d.numel() == 0:
        return [0.0, 0.0, 0.0, math.inf, -math.inf]
    return [float(d.numel()), d.sum().item(), (d * d).sum().item(), d.amin().item(), d.amax().item()]


def eager(t: torch.Tensor) -> list[float]:
    row = _chunked_partials(t, COLS, 0.0) if t.dtype != torch.float32 else _cpu_row(t, COLS, 0.0)
    return row.tolist()


def same(a: list[float], b: list[float], rtol: float) -> bool:
    return all((math.isnan(x) and math.isnan(y)) or x == pytest.approx(y, rel=rtol, abs=1e-9) for x, y in zip(a, b))


SIZES = [0, 1, 7, 15, 16, 17, 511, 512, 513, 1000, 4099, 65537, 300_001]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_float64_truth_and_eager_on_many_shapes(fused, dtype):
    g = torch.Generator().manual_seed(1)
    tensors = [(torch.randn(n, generator=g) * 3 + 0.5).to(dtype) for n in SIZES]
    tensors += [torch.randn(3, 5, 7, generator=g).to(dtype), torch.randn(64, 256, generator=g).to(dtype)[:, ::3]]
    got = fused(tensors)
    assert got.shape == (len(tensors), 5) and got.dtype == torch.float64
    for row, t in zip(got.tolist(), tensors):
        want = truth(t)
        assert row[0] == want[0] and row[3:] == want[3:], t.shape  # count and extremes exact
        assert same(row, want, 1e-5), (t.shape, row, want)
        assert same(row, eager(t), 1e-5), (t.shape, row, eager(t))


@pytest.mark.parametrize("where", [0, 5, 600, 9999])
def test_nan_propagates_to_every_column_like_amin_amax(fused, where):
    t = torch.randn(10_000)
    t[where] = math.nan
    row = fused([t])[0].tolist()
    assert row[0] == 10_000 and all(math.isnan(v) for v in row[1:])
    assert math.isnan(t.amin().item()) and math.isnan(t.amax().item())


def test_infinities_give_the_same_values_as_eager(fused):
    pos = torch.ones(3000)
    pos[17] = math.inf
    both = torch.ones(3000)
    both[2] = math.inf
    both[2999] = -math.inf
    for t in (pos, both):
        assert same(fused([t])[0].tolist(), eager(t), 0.0), t[:3]
    assert fused([both])[0].tolist()[3:] == [-math.inf, math.inf]


@pytest.mark.parametrize("value", [1e18, 1e19, 3e38, -3.3e38])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_huge_finite_values_give_finite_exact_sums(fused, value, dtype):
    # float squares (and sums near 3.4e38) overflow in the float lanes: the block is redone in double
    t = torch.full((1000,), value, dtype=dtype)
    t[::7] *= -0.5
    truth = t.double()
    row = fused([t])[0].tolist()
    assert row[1] == pytest.approx(truth.sum().item(), rel=1e-6)
    assert row[2] == pytest.approx(truth.square().sum().item(), rel=1e-6)
    assert row[3:] == [truth.min().item(), truth.max().item()]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1e20])
@pytest.mark.parametrize("where", [0, 1500, 2050], ids=["first-block", "last-block", "tail"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_odd_value_late_in_a_tensor_is_counted_and_summed_as_float64_truth(value, where, dtype):
    """The kernel first sums a tensor's finite blocks in float64 lanes, and starts over block by
    block once a sum is not finite: one NaN, Inf or float-overflowing value in the first block,
    the last whole block or the tail gives the values and counts of float64 truth either way."""
    if not _fused_cpu.enabled():
        pytest.skip("fused CPU kernel does not build here")
    t = (torch.randn(2060, generator=torch.Generator().manual_seed(5)) + 0.25).to(dtype)
    t[where] = value
    t[7] = 0.0
    d = t.double()
    row = _fused_cpu.partials_f32([t], eps=1e-8)[0].tolist()
    count, total, sumsq, lo, hi, nans, infs, zeros = row[:8]
    assert (count, nans, infs, zeros) == (2060, float(math.isnan(value)), float(math.isinf(value)), 1.0)
    if math.isnan(value):
        assert all(math.isnan(v) for v in (total, sumsq, lo, hi))
        return
    assert total == pytest.approx(d.sum().item(), rel=1e-6)
    assert sumsq == pytest.approx(d.square().sum().item(), rel=1e-6)
    assert (lo, hi) == (d.min().item(), d.max().item())


def test_forty_million_equal_values_stay_accurate(fused):
    n, v = 40_000_000, torch.tensor(0.1).item()  # the float32 value of 0.1, exactly
    row = fused([torch.full((n,), 0.1)])[0].tolist()
    assert row[1] == pytest.approx(n * v, rel=1e-6)
    assert row[2] == pytest.approx(n * v * v, rel=1e-6)
    assert row[3] == row[4] == v


def test_compute_partials_uses_it_for_every_column_set(fused):
    g = torch.Generator().manual_seed(2)
    tensors = [torch.randn(n, generator=g) for n in (5, 70_000)] + [
        torch.randn(9, generator=g).bfloat16(),
        torch.arange(6),
        torch.empty(0),
    ]
    for cols in (COLS, ("count", "sumsq"), ("count", "min", "max")):
        rows = compute_partials(tensors, cols, 1e-8)
        for row, t in zip(rows, tensors):
            full = dict(zip(COLS, truth(t)))
            assert same(row.tolist(), [full[c] for c in cols], 1e-5), (cols, t.dtype)
    # nans/infs/zeros are fused too (tests/stats/test_fused_cpu_columns.py: every column)
    t = torch.tensor([0.0, math.nan, 1.0])
    row = compute_partials([t], ("count", "sumsq", "nans", "infs", "zeros"), 1e-8)[0].tolist()
    assert row[0] == 3 and math.isnan(row[1]) and row[2:] == [1.0, 0.0, 1.0]


@pytest.mark.slow  # child processes that compile the kernel
def test_build_failure_warns_once_and_falls_back(tmp_path):
    # A real failed build: no such compiler, in a fresh extensions dir.
    script = (
        "import torch, trainmon.stats.partials as p\n"
        "t = torch.randn(100)\n"
        "a = p.compute_partials([t], ('count','sum','sumsq','min','max'), 0.0)[0]\n"
        "b = p.compute_partials([t], ('count','sum','sumsq','min','max'), 0.0)[0]\n"
        "assert torch.equal(a, b) and a[0] == 100, a\n"
        "print('ok')\n"
    )
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO),
        TRAINMON_FUSED_CPU="1",
        CC=str(tmp_path / "no-such-compiler"),
        TRAINMON_CACHE_DIR=str(tmp_path / "cache"),
    )
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    assert proc.stderr.count("fused CPU stats kernel is unavailable") == 1, proc.stderr


def _enabled_in_subprocess(env_extra: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    script = (
        "import logging, torch; logging.basicConfig(level=logging.WARNING)\n"
        "from trainmon.stats import _fused_cpu as f\n"
        "print(f.enabled())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TRAINMON_FUSED_CPU", "CC")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **env_extra)
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # child processes that compile the kernel
def test_on_by_default_and_a_missing_compiler_is_one_warning(tmp_path):
    built = _enabled_in_subprocess({"TRAINMON_CACHE_DIR": str(tmp_path / "c1")}, tmp_path)
    if built.stdout.strip() != "True":
        pytest.skip(f"no working C compiler here: {built.stderr[-300:]}")
    assert list((tmp_path / "c1").glob("trainmon_fused_*.so")), "the library is cached"
    # A later process loads the cached library: no compiler needed any more.
    again = _enabled_in_subprocess(
        {"TRAINMON_CACHE_DIR": str(tmp_path / "c1"), "CC": str(tmp_path / "no-such-compiler")}, tmp_path
    )
    assert again.stdout.strip() == "True", again.stderr
    # Nothing cached and no compiler, not asked for explicitly: eager path and one warning (a
    # slower path nobody chose is said, issue 34 item 19); TRAINMON_FUSED_CPU=0 is the quiet choice.
    none = _enabled_in_subprocess(
        {"TRAINMON_CACHE_DIR": str(tmp_path / "c2"), "CC": str(tmp_path / "no-such-compiler")}, tmp_path
    )
    assert none.returncode == 0 and none.stdout.strip() == "False" and none.stderr.count("WARNING") == 1
    off = _enabled_in_subprocess({"TRAINMON_CACHE_DIR": str(tmp_path / "c3"), "TRAINMON_FUSED_CPU": "0"}, tmp_path)
    assert off.stdout.strip() == "False" and not (tmp_path / "c3").exists(), "off: nothing is built"
    assert "WARNING" not in off.stderr


@pytest.mark.slow  # child processes that compile the kernel
def test_unwritable_cache_uses_a_private_temp_folder_and_never_a_shared_one(tmp_path):
    unwritable = "/proc/trainmon-no-such-dir/cache"
    (tmp_path / "t1").mkdir()
    ok = _enabled_in_subprocess({"TRAINMON_CACHE_DIR": unwritable, "TMPDIR": str(tmp_path / "t1")}, tmp_path)
    if ok.stdout.strip() != "True":
        pytest.skip(f"no working C compiler here: {ok.stderr[-300:]}")
    private = tmp_path / "t1" / f"trainmon-cache-{os.getuid()}"
    assert list(private.glob("trainmon_fused_*.so")) and (private.stat().st_mode & 0o077) == 0
    # A folder of that name that others can write to (a shared /tmp) is refused: eager path.
    shared = tmp_path / "t2" / f"trainmon-cache-{os.getuid()}"
    shared.mkdir(parents=True)
    shared.chmod(0o777)
    refused = _enabled_in_subprocess({"TRAINMON_CACHE_DIR": unwritable, "TMPDIR": str(tmp_path / "t2")}, tmp_path)
    assert refused.returncode == 0 and refused.stdout.strip() == "False", refused.stderr
    assert not list(shared.iterdir())


def _segmented_batch() -> list[torch.Tensor]:
    """Tensors above ``SEGMENT_ELEMENTS`` (read as segments) with NaN, Inf and zeros in a middle
    segment, the tail or nowhere, between small ones; fp32, bf16 and fp16."""
    g = torch.Generator().manual_seed(11)
    seg = _fused_cpu.SEGMENT_ELEMENTS
    big = torch.randn(2 * seg + 777, generator=g) * 3 + 0.5
    nan_mid = big.clone()
    nan_mid[seg + 5] = math.nan
    inf_tail = big.clone()
    inf_tail[-3] = -math.inf
    zeros = big.clone()
    zeros[::5] = 0.0
    small = [torch.randn(n, generator=g) for n in (0, 17, 4099)]
    batch = [small[0], big, small[1], nan_mid, inf_tail, zeros, small[2], big.bfloat16(), (big * 1e-3).half()]
    return batch + [torch.randn(seg, generator=g), torch.randn(seg + 1, generator=g)]  # at and past the bound


def test_a_tensor_read_in_segments_gives_float64_truth_for_every_column(fused):
    """A tensor above ``SEGMENT_ELEMENTS`` is read segment by segment and the pieces combined in
    float64 (Chan's formula for m2): every column against float64 truth, NaN/Inf included."""
    batch = _segmented_batch()
    rows = _fused_cpu.partials_f32(batch, eps=1e-8).tolist()
    for t, row in zip(batch, rows):
        d = t.double()
        count, total, sumsq, lo, hi, nans, infs, zeros, m2 = row
        n_nan, n_inf = int(d.isnan().sum()), int(d.isinf().sum())
        assert (count, nans, infs) == (t.numel(), n_nan, n_inf), t.numel()
        assert zeros == int((d.float().abs() < 1e-8).sum())
        if t.numel() == 0:
            continue
        if n_nan:
            assert all(math.isnan(v) for v in (total, sumsq, lo, hi, m2))
            continue
        assert (lo, hi) == (d.min().item(), d.max().item())
        if n_inf:
            assert math.isnan(m2) and math.isinf(total)
            continue
        assert total == pytest.approx(d.sum().item(), rel=1e-6)
        assert sumsq == pytest.approx(d.square().sum().item(), rel=1e-6)
        want_m2 = ((d - d.mean()) ** 2).sum().item()
        assert m2 == pytest.approx(want_m2, rel=1e-6)


@pytest.mark.parametrize("threads", [2, 3])
def test_values_do_not_depend_on_the_number_of_threads(fused, threads):
    """The kernel reads a batch of 1 MiB or more with up to ``torch.get_num_threads()`` threads;
    each tensor (or segment) is read by one of them and the pieces combine in a fixed order, so
    every row is bitwise the same as one thread's."""
    batch = _segmented_batch()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _fused_cpu.partials_f32(batch, eps=1e-8)
        torch.set_num_threads(threads)
        many = [_fused_cpu.partials_f32(batch, eps=1e-8) for _ in range(3)]
    finally:
        torch.set_num_threads(before)
    assert _fused_cpu.worker_threads() >= threads - 1  # the calls did run on worker threads
    for got in many:
        assert got.numpy().tobytes() == one.numpy().tobytes()


def test_calls_from_two_threads_at_once_each_get_their_own_rows(fused):
    """One call at a time uses the worker threads; another thread's call meanwhile reads alone.
    Either way each caller gets its own batch's rows."""
    import threading

    batches = [_segmented_batch(), [t * 2 for t in _segmented_batch()]]
    want = [_fused_cpu.partials_f32(b, eps=1e-8).numpy().tobytes() for b in batches]
    got: list[list[bytes]] = [[], []]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:

        def run(k: int) -> None:
            for _ in range(4):
                got[k].append(_fused_cpu.partials_f32(batches[k], eps=1e-8).numpy().tobytes())

        threads = [threading.Thread(target=run, args=(k,)) for k in (0, 1)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
    finally:
        torch.set_num_threads(before)
    assert got == [[want[0]] * 4, [want[1]] * 4]


_FORK_CHILD = """
import os, sys, torch
from trainmon.stats import _fused_cpu
assert _fused_cpu.enabled()
torch.set_num_threads(2)
batch = [torch.randn(1 << 20) for _ in range(4)]
want = _fused_cpu.partials_f32(batch).numpy().tobytes()  # the parent's worker thread starts here
assert _fused_cpu.worker_threads() == 1
pid = os.fork()
if pid == 0:  # a child has none of its parent's threads: it counts none, then starts its own
    fresh = _fused_cpu.worker_threads() == 0
    ok = _fused_cpu.partials_f32(batch).numpy().tobytes() == want
    os._exit(0 if fresh and ok and _fused_cpu.worker_threads() == 1 else 3)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.slow  # a Python process of its own (~2 s)
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_reads_with_threads_of_its_own(fused):
    """DataLoader workers and ``multiprocessing`` fork the training process after the kernel's
    worker threads started: the child knows it has none of them (it never waits on a lock or a
    thread of its parent's) and starts its own at its first call, with the parent's values."""
    done = subprocess.run(
        [sys.executable, "-c", _FORK_CHILD],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]


def _pair_truth(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    a64, b64 = a.double(), b.double()
    return (a64**2).sum().item(), ((a64 - b64) ** 2).sum().item()


def _pairs(dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Snapshots and the values they became: empty, shorter than a block, block edges, a tail,
    and one tensor read in segments (above ``SEGMENT_ELEMENTS``)."""
    g = torch.Generator().manual_seed(7)
    sizes = (0, 1, 17, 511, 512, 513, 100_003, 3 * _fused_cpu.SEGMENT_ELEMENTS + 5)
    before = [(torch.randn(n, generator=g) * 3).to(dtype) for n in sizes]
    after = [(t.float() - 1e-3 * torch.randn(t.shape, generator=g)).to(dtype) for t in before]
    return before, after


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_update_ratio_sums_equal_float64_truth(fused, dtype):
    """``pair_sumsq``: sum(a^2) and sum((a-b)^2) of every pair as float64 computes them from the
    tensors' values.  bf16/fp16 differences are exact in float, so half precision is as exact as
    fp32 (torch's ops rounded a bf16 param's difference to bf16: 2% off)."""
    before, after = _pairs(dtype)
    got = _fused_cpu.pair_sumsq(before, after)
    assert got.shape == (len(before), 2) and got.dtype == torch.float64
    for a, b, row in zip(before, after, got.tolist()):
        want = _pair_truth(a, b)
        assert row == pytest.approx(want, rel=1e-6, abs=0.0), (dtype, a.numel())


def test_update_ratio_sums_keep_huge_values_and_propagate_nan_and_inf(fused):
    """Float lanes overflow above ~1.8e19 per element: such a pair is read again in double, so
    its sums stay finite and exact.  NaN and Inf give NaN and Inf, as torch's norm does."""
    big = torch.full((2050,), 1e20)
    square = 2050 * big[0].item() ** 2  # 1e20 as float32, squared in double
    got = _fused_cpu.pair_sumsq([big, big], [torch.zeros(2050), big.clone()]).tolist()
    assert got[0] == pytest.approx([square, square], rel=1e-12) and got[1] == pytest.approx([square, 0.0], rel=1e-12)
    nan, inf = torch.ones(1500), torch.ones(1500)
    nan[1400], inf[700] = math.nan, math.inf
    (n0, n1), (i0, i1) = _fused_cpu.pair_sumsq([nan, inf], [torch.ones(1500), torch.ones(1500)]).tolist()
    assert math.isnan(n0) and math.isnan(n1) and i0 == i1 == math.inf

@pytest.mark.parametrize("threads", [2, 3])
def test_update_ratio_sums_do_not_depend_on_the_number_of_threads(fused, threads):
    before, after = _pairs(torch.float32)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _fused_cpu.pair_sumsq(before, after)
        torch.set_num_threads(threads)
        many = [_fused_cpu.pair_sumsq(before, after) for _ in range(3)]
    finally:
        torch.set_num_threads(saved)
    assert _fused_cpu.worker_threads() >= threads - 1
    for got in many:
        assert got.numpy().tobytes() == one.numpy().tobytes()


def test_update_ratio_sums_refuse_pairs_they_cannot_read(fused):
    """A refusal is a ValueError (the caller takes torch's ops), never a read of the wrong bytes."""
    a = torch.randn(4, 6)
    for snapshots, values in (
        ([a], [a.t().contiguous().t()]),  # not contiguous
        ([a], [torch.randn(5, 6)]),  # another size
        ([a], [a.double()]),  # another dtype
        ([a.double()], [a.double()]),  # a dtype the kernel has no reader for
    ):
        with pytest.raises(ValueError):
            _fused_cpu.pair_sumsq(snapshots, values)
