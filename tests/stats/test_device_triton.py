"""The optional Triton kernel of the device path, on CPU tensors in Triton's interpreter, in a
process of its own (tests/_support/triton_cases.py; the interpreter is process-wide): values
against float64 truth and the eager device path for fp32/bf16/fp16, NaN/+-Inf, transposed and
permuted views (read as their span), strided, expanded, empty and integer tensors (eager), norms
beyond float32's sum of squares; two launches per group and no aten op of the monitor's own; the
eager fallback when a launch fails; run.json; the kernels compiling for CUDA and ROCm GPUs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tests._support.runs import REPO, only_run_dir

pytest.importorskip("triton")
OPS = ["norm", "mean", "min", "max", "nans", "infs", "zeros"]
OVERFLOWING = ("huge", "top")  # fp32/bf16 tensors whose sum of squares float32 cannot hold


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("triton")
    config = tmp / "config.json"
    config.write_text(json.dumps({"wg_distribution": True, "ops": ["norm"]}))
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO),
        OMP_NUM_THREADS="1",
        MONITOR_OUTPUT_DIR=str(tmp / "out"),
        TRAINMON_DEVICE_PATH="1",
        TRAINMON_TRITON_INTERPRET="1",
        TRITON_INTERPRET="1",
    )
    env.pop("TRAINMON_RUN_ID", None)
    env.pop("TRAINMON_TRITON", None)
    done = subprocess.run(
        [sys.executable, "-m", "tests._support.triton_cases", str(config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    result["run_json"] = json.loads((only_run_dir(tmp / "out") / "run.json").read_text())
    return result


def _assert_equal_truth(row, want):
    for op in OPS:
        got, w = row[op], want[op]
        if op in ("nans", "infs"):
            assert got == w, (row["name"], op, got, w)
        elif math.isnan(w):
            assert math.isnan(got), (row["name"], op, got)
        else:
            atol = want["_mean_atol"] if op == "mean" else 1e-30
            assert got == pytest.approx(w, rel=1e-5, abs=atol), (row["name"], op, got, w)


@pytest.mark.slow  # one interpreted process for all the cases (~8 s)
def test_triton_rows_equal_float64_truth_and_the_eager_path_on_every_dtype(cases):
    assert len(cases["values"]) == 9
    for case in cases["values"]:
        assert case["path"] == {"cpu": "device-triton"}, case["case"]
        assert [r["name"] for r in case["triton"]] == list(case["truth"]), case["case"]
        for row, eager in zip(case["triton"], case["eager"]):
            _assert_equal_truth(row, case["truth"][row["name"]])
            if row["name"] not in OVERFLOWING or case["dtype"] == "torch.float16":
                _assert_equal_truth(eager, case["truth"][row["name"]])


@pytest.mark.slow
def test_offsets_below_the_first_tensor_of_a_group_are_read_right(cases):
    case = cases["negative_offsets"]
    assert len(case["triton"]) == 5
    for row in case["triton"]:
        _assert_equal_truth(row, case["truth"][row["name"]])


@pytest.mark.slow
def test_norms_beyond_float32_sums_of_squares_are_finite_and_exact_only_on_the_triton_path(cases):
    for case in cases["values"]:
        if case["dtype"] == "torch.float16" or case["case"] == "pair":
            continue  # fp16 cannot overflow a float32 sum of squares; the pair has no huge tensor
        for name in OVERFLOWING:
            row = next(r for r in case["triton"] if r["name"] == name)
            eager = next(r for r in case["eager"] if r["name"] == name)
            want = case["truth"][name]["norm"]
            assert 1e21 < want < 3.4e38 and row["norm"] == pytest.approx(want, rel=1e-5), name
            # the eager path: finite for tensors small enough for its segment batches (scaled
            # per tensor), inf above them (the documented limit of linalg_vector_norm in float32)
            assert eager["norm"] == math.inf or eager["norm"] == pytest.approx(want, rel=1e-5), name


@pytest.mark.slow
def test_a_group_costs_two_launches_and_no_op_sync_or_copy_of_the_monitor(cases):
    counts = cases["counts"]
    for sight in ("first", "later"):
        assert counts[sight]["launches"] == ["chunk_partials", "tensor_rows"], sight
    assert counts["later"]["ops"] == counts["later"]["syncs"] == counts["later"]["copies"] == 0
    assert counts["first"]["copies"] <= 1  # the group's descriptor table, at its first sight only
    assert counts["pair"] == {"launches": ["chunk_partials", "tensor_rows"] * 2, "ops": 0, "syncs": 0, "copies": 0}
    assert (counts["transposed"], counts["strided"]) == (2, 0)  # a dense view is one span; a strided one eager


@pytest.mark.slow
def test_a_family_block_is_planned_once_on_the_triton_route_with_the_same_rows(cases):
    """A weight family kept as a block takes the Triton kernel through a plan made at its first
    capture: the same rows as the eager device path and float64 truth at every capture (new
    addresses each time), two launches per dtype group, and a replayed capture's Python frames
    do not grow with the number of tensors; views of one buffer (Megatron's grads) likewise.  A
    tensor that stops being contiguous takes the general path, with the same values."""
    planned = cases["planned"]
    for n, case in planned.items():
        for sight in case["sights"]:
            assert sight["planned"], n
            groups = 1 if n == "views" else 2  # views of one bf16 buffer; fp32 and bf16 tensors
            assert sight["launches"] == ["chunk_partials", "tensor_rows"] * groups, n
            assert [r["name"] for r in sight["rows"]] == list(case["truth"]), n
            for row, eager_row in zip(sight["rows"], case["eager"]):
                _assert_equal_truth(row, case["truth"][row["name"]])
                for op in ("nans", "infs", "min", "max"):
                    assert row[op] == eager_row[op] or (math.isnan(row[op]) and math.isnan(eager_row[op]))
        assert not case["general_planned"]
        for row in case["general"][1:]:  # the first tensor is the non-contiguous copy of itself
            _assert_equal_truth(row, case["truth"][row["name"]])
        _assert_equal_truth(case["general"][0], case["truth"][next(iter(case["truth"]))])
    small, large = planned["12"]["calls"], planned["45"]["calls"]
    # 23: the capture's own 3, and per dtype group its two launches, three frames around them
    # and the table rebuilt for the new addresses (3)
    assert small == large <= 24, (small, large)


@pytest.mark.slow
def test_a_monitored_step_costs_at_most_half_a_python_frame_per_weight_row_on_the_triton_route(cases):
    """The host budget of tests/test_host_budget.py on the route a CUDA GPU with Triton takes: a
    whole training step of 64 tensors (launches stubbed: what the host runs, not the kernels)."""
    from tests._support.host_budget import WEIGHT_CONFIGS, WEIGHT_FRAMES_PER_ROW

    for name, (_settings, rows_per_param) in WEIGHT_CONFIGS.items():
        cost = cases["step_frames"][name]
        assert cost["weight_rows"] == rows_per_param * 64, (name, cost)
        assert cost["frames"] / cost["weight_rows"] <= WEIGHT_FRAMES_PER_ROW, (name, cost)


@pytest.mark.slow
def test_a_failing_launch_falls_back_to_the_eager_path_with_the_same_values(cases):
    fallback = cases["fallback"]
    assert fallback["path"] == {"cpu": "device"}
    for row in fallback["rows"]:
        if row["name"] in OVERFLOWING:  # small tensors (segments) scale: finite; larger ones: inf
            want = fallback["truth"][row["name"]]["norm"]
            assert row["norm"] == math.inf or row["norm"] == pytest.approx(want, rel=1e-5)
        else:
            _assert_equal_truth(row, fallback["truth"][row["name"]])


@pytest.mark.slow
def test_run_json_says_device_triton(cases):
    assert cases["run_json"]["stats_path"] == {"cpu": "device-triton"}


def test_the_cpu_paths_do_not_import_triton():
    code = (
        "import sys, torch\n"
        "from trainmon.stats.engine import StatsEngine, Tracked\n"
        "for seam in ('0', '1'):\n"
        "    import os; os.environ['TRAINMON_DEVICE_PATH'] = seam\n"
        "    e = StatsEngine(['norm', 'nans'])\n"
        "    e.capture('x', [Tracked('w', torch.ones(8))])\n"
        "    e.finish_step(0)\n"
        "print('triton' in sys.modules)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("TRAINMON_TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False"]


@pytest.mark.slow  # ~5 s: every variant the launcher asks for, compiled for two GPUs
def test_the_kernels_compile_for_cuda_and_rocm_gpus_without_one():
    """The interpreter runs the kernels' Python; this runs Triton's real compiler (to PTX/cubin and
    to AMDGPU code, with the compilers the triton wheel bundles) on the argument types and
    constexprs the launcher passes, so type errors a GPU would raise show here."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from trainmon.stats import device_triton, triton_kernels
    from trainmon.stats.device_rows import DeviceRows
    from trainmon.stats.partials import device_columns
    from trainmon.stats.table import partials_for

    backends = {"cuda": "nvidia", "hip": "amd"}  # target names -> the wheel's backend names
    targets = [
        t
        for t in (GPUTarget("cuda", 90, 32), GPUTarget("hip", "gfx942", 64))
        if backends[t.backend] in triton.backends.backends
    ]
    if not targets:
        pytest.skip("this triton has no CUDA or ROCm backend")
    built = []
    for ops, dtypes in ((OPS, ("*fp32", "*bf16", "*fp16")), (["norm", "mean", "min", "max"], ("*bf16",))):
        meta = device_triton.TritonRows(DeviceRows(torch.device("cpu"), device_columns(partials_for(ops)), 1e-8))
        counts = "*i64" if meta.rows.counts else "*fp32"
        for target in targets:
            for dtype in dtypes:
                for table in (True, False):
                    built.append(
                        _compile(
                            triton,
                            ASTSource,
                            target,
                            triton_kernels.chunk_partials,
                            {
                                "x_ptr": dtype,
                                "desc_ptr": "*i64" if table else dtype,
                                "part_ptr": "*fp32",
                                "numel": "i32",
                                "eps": "fp32",
                            },
                            dict(TABLE=table, CHUNK=4096, BLOCK=1024, **meta.meta),
                        )
                    )
            for table in (True, False):
                built.append(
                    _compile(
                        triton,
                        ASTSource,
                        target,
                        triton_kernels.tensor_rows,
                        {
                            "part_ptr": "*fp32",
                            "first_ptr": "*i64" if table else "*fp32",
                            "n_chunks": "i32",
                            "first_tensor": "i32",
                            "values_ptr": "*fp32",
                            "values_stride": "i32",
                            "counts_ptr": counts,
                            "counts_stride": "i32",
                        },
                        dict(TABLE=table, BLOCK=256, **meta.row_meta),
                    )
                )
    # per target: 3 dtypes x 2 tables + 2 row variants (all ops), 1 x 2 + 2 (default ops)
    assert len(built) == 12 * len(targets) and all(kernel.asm for kernel in built)


def _compile(triton, ast_source, target, kernel, signature, constexprs):
    names = kernel.arg_names
    signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    source = ast_source(
        fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()}
    )
    compiled = triton.compile(source, target=target)
    assert compiled.asm, (kernel, target)
    return compiled
