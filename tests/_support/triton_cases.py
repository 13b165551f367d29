"""The Triton kernel's cases, run in a process of their own by tests/stats/test_device_triton.py:
Triton's interpreter (``TRAINMON_TRITON_INTERPRET=1``) is process-wide once triton is imported,
so it must not reach the other tests.  Prints one JSON object: per case, the rows of the Triton
path, of the eager device path and the float64 truth; launch and op counts; run.json's path.

    TRAINMON_DEVICE_PATH=1 TRAINMON_TRITON_INTERPRET=1 python -m tests._support.triton_cases CONFIG
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch
from torch.utils._python_dispatch import _disable_current_modes

from tests._support.host_budget import frames
from tests._support.runs import reference_stats
from trainmon import TrainerMon
from trainmon.stats import device_triton
from trainmon.stats.engine import StatsEngine, Tracked
from trainmon.testing.op_counter import OpCounter

OPS = ["norm", "mean", "min", "max", "nans", "infs", "zeros"]
device_triton.CHUNK_MIN = 512  # many chunks from small tensors (the interpreter runs programs in Python)
launches: list[str] = []
_real_launch = device_triton._launch


def _counted_launch(kernel, grid, *args, **meta):
    """Counts launches; the interpreter's own aten ops (copying arguments) are not the monitor's."""
    launches.append(kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel))
    with _disable_current_modes():
        _real_launch(kernel, grid, *args, **meta)


device_triton._launch = _counted_launch


def truth(t: torch.Tensor) -> dict[str, float]:
    """``reference_stats`` (float64), with what an empty tensor records."""
    if t.numel():
        return reference_stats(t)
    return {"norm": 0.0, "mean": math.nan, "min": math.nan, "max": math.nan, "nans": 0, "infs": 0,
            "zeros": math.nan, "_mean_atol": 0.0}  # fmt: skip


def tensors(dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {
        "many_chunks": torch.randn(3000, generator=g) * 3 + 0.5,
        "nan": torch.randn(700, generator=g),
        "pm_inf": torch.randn(40, 30, generator=g),
        "zeros": torch.randn(1000, generator=g),
        "small": torch.randn(17, generator=g) - 2,
        "huge": torch.randn(2000, generator=g) * (1e20 if dtype != torch.float16 else 1e2),
        "top": torch.randn(50, generator=g) * (1e37 if dtype != torch.float16 else 1e3),  # norm near float32's max
        # squares below float32's normal range: the kernel's scaled second pass
        "tiny": torch.randn(300, generator=g) * (1e-25 if dtype != torch.float16 else 1e-3),
        "peak": torch.randn(100, generator=g),  # one element near float32's max (set below)
        "transposed": torch.randn(64, 48, generator=g).t(),  # dense in another order: read as its span
        "permuted": torch.randn(5, 1, 7, 9, generator=g).permute(3, 1, 0, 2),
        "strided": torch.randn(900, generator=g)[::3],  # not one span: eager
        "expanded": torch.randn(30, 1, generator=g).expand(30, 4),  # elements seen twice: eager
        "empty": torch.empty(0),
    }
    out["nan"][[5, 600]] = math.nan
    out["pm_inf"][3, 4], out["pm_inf"][30, 0] = math.inf, -math.inf
    out["zeros"][::4] = 0.0
    out["peak"][7] = 3e38 if dtype != torch.float16 else 6e4
    out = {k: v.to(dtype) for k, v in out.items()}
    out["ints"] = torch.arange(-5, 20)  # eager (converted to fp32)
    return out


def rows(engine: StatsEngine, named: dict[str, torch.Tensor], pad: int = 0) -> list[dict]:
    if pad:
        pads = [torch.ones(3, dtype=torch.int32) for _ in range(pad)]  # ints: eager, quick in the interpreter
        engine.capture("pad", [Tracked(f"p{i}", t) for i, t in enumerate(pads)])
    engine.capture("x", [Tracked(k, t) for k, t in named.items()])
    return [{"name": r.name, **{op: r.stats[op] for op in OPS}} for r in engine.finish_step(0) if r.family == "x"]


def eager(named: dict[str, torch.Tensor], **kw) -> list[dict]:
    os.environ[device_triton.TRITON_ENV] = "0"
    try:
        return rows(StatsEngine(OPS), named, **kw)
    finally:
        del os.environ[device_triton.TRITON_ENV]


def value_cases() -> list[dict]:
    out = []
    for seed, dtype in enumerate((torch.float32, torch.bfloat16, torch.float16)):
        named = tensors(dtype, seed)
        pair = dict(list(named.items())[:2])  # two tensors: a launch pair each, no table
        for case, ts, pad in (("group", named, 0), ("pair", pair, 0), ("across_row_chunks", named, 509)):
            engine = StatsEngine(OPS)
            got = rows(engine, ts, pad)
            out.append({"case": case, "dtype": str(dtype), "path": engine.stats_paths, "triton": got,
                        "eager": eager(ts, pad=pad), "truth": {k: truth(t) for k, t in ts.items()}})  # fmt: skip
    return out


def negative_offsets() -> dict:
    """Views of one buffer, the first at the highest address: every other offset is negative."""
    buf = torch.randn(8000, generator=torch.Generator().manual_seed(9)).bfloat16()
    named = {
        f"v{k}": buf[o : o + n] for k, (o, n) in enumerate(((7000, 999), (5000, 1500), (20, 3), (0, 17), (900, 4000)))
    }
    return {"triton": rows(StatsEngine(OPS), named), "truth": {k: truth(t) for k, t in named.items()}}


def counts() -> dict:
    g = torch.Generator().manual_seed(7)
    group = [torch.randn(n, generator=g) for n in (300, 2000, 256, 5000, 77, 1024)]
    engine = StatsEngine(OPS)
    result = {}
    for sight in ("first", "later"):
        launches.clear()
        with OpCounter() as c:
            engine.partials(group)
        result[sight] = {"launches": list(launches), "ops": c.ops, "syncs": c.syncs, "copies": c.copies}
    launches.clear()
    with OpCounter() as c:
        engine.partials(group[:2])
    result["pair"] = {"launches": list(launches), "ops": c.ops, "syncs": c.syncs, "copies": c.copies}
    for name, view in (("transposed", torch.randn(64, 48).t()), ("strided", torch.randn(900)[::3])):
        launches.clear()
        engine.partials([view])
        result[name] = len(launches)
    return result


def _block_tensors(n_fp32: int, seed: int) -> dict[str, torch.Tensor]:
    """A family as a collector keeps it: fp32 tensors, then bf16 ones (two dtype groups).  A large
    family's tensors are smaller (the interpreter runs each chunk's program in Python)."""
    g = torch.Generator().manual_seed(seed)
    step = 211 if n_fp32 < 20 else 13
    named = {f"w{i}": torch.randn(17 + step * (i % 9), generator=g) * (i + 1) for i in range(n_fp32)}
    named.update({f"b{i}": (torch.randn(9 + 97 * i, generator=g) - 1).bfloat16() for i in range(5)})
    named["w1"][5] = math.nan
    named["w2"][::3] = 0.0
    named["b1"][4] = -math.inf
    return named


def _python_calls(fn) -> int:
    """``host_budget.frames`` of ``fn`` with its launches stubbed (the interpreter's own frames are
    not the monitor's host cost)."""
    real, device_triton._launch = device_triton._launch, lambda kernel, grid, *a, **m: None
    try:
        return frames(fn)
    finally:
        device_triton._launch = real


def planned_blocks() -> dict:
    """A family kept as a ``FamilyBlock`` on the Triton route: planned at its first capture,
    replayed at later ones with new addresses (grads after ``zero_grad``); the rows against the
    eager device path and float64 truth, the launches, and the Python frames of a replayed
    capture for 12 and 45 tensors; views of one buffer (Megatron's grads) likewise, at fixed
    addresses.  Then one tensor turns non-contiguous: the general path."""
    out: dict = {}
    buf = torch.randn(9000, generator=torch.Generator().manual_seed(3)).bfloat16()
    spans = ((7000, 999), (5000, 1500), (20, 3), (0, 17), (900, 4000), (8100, 700))
    views = {f"v{k}": buf[o : o + n] for k, (o, n) in enumerate(spans)}  # one buffer, as Megatron's grads
    for n_fp32 in (7, 40, 0):
        named = _block_tensors(n_fp32, seed=n_fp32) if n_fp32 else views
        engine = StatsEngine(OPS)
        items = [(k, 0, tuple(t.shape), t.dtype) for k, t in named.items()]
        block = engine.block(items, [t.dtype for t in named.values()], [t.numel() for t in named.values()])
        sights = []
        for _ in range(2):
            # new addresses, as grads after zero_grad; views of one buffer stay where they are
            tensors = [t.clone() for t in named.values()] if n_fp32 else list(named.values())
            launches.clear()
            engine.capture_block("x", block, tensors)
            got = [{"name": r.name, **{op: r.stats[op] for op in OPS}} for r in engine.finish_step(0)]
            sights.append({"rows": got, "launches": list(launches), "planned": block.plan is not None})
        tensors = [t.clone() for t in named.values()]
        calls = _python_calls(lambda: engine.capture_block("x", block, tensors))
        engine.finish_step(0)
        odd = [t.clone() for t in named.values()]
        odd[0] = torch.stack([odd[0], odd[0]], 1)[:, 0]  # same elements, no longer contiguous
        launches.clear()
        engine.capture_block("x", block, odd)
        general = [{"name": r.name, **{op: r.stats[op] for op in OPS}} for r in engine.finish_step(0)]
        out[str(len(named)) if n_fp32 else "views"] = {
            "sights": sights,
            "calls": calls,
            "general": general,
            "general_planned": block.plan is not None,
            "eager": eager(named),
            "truth": {k: truth(t) for k, t in named.items()},
        }
    return out


def fallback() -> dict:
    """A launch that raises (as a GPU Triton cannot compile for): eager from then on, same values."""

    def failing(kernel, grid, *args, **meta):
        raise RuntimeError("no kernel for this GPU")

    device_triton._launch = failing
    try:
        named = tensors(torch.float32, 11)
        engine = StatsEngine(OPS)
        got = rows(engine, named)
        return {"path": engine.stats_paths, "rows": got, "truth": {k: truth(t) for k, t in named.items()}}
    finally:
        device_triton._launch = _counted_launch


def step_frames() -> dict:
    """Per weight config: a whole monitored training step of ``host_budget.chain(64)`` on the
    Triton route (``host_budget.step_cost``), launches stubbed: its Python frames (the host
    bookkeeping of a GPU step) and the weight rows it records."""
    import tempfile
    from pathlib import Path

    import pytest

    from tests._support.host_budget import WEIGHT_CONFIGS, step_cost

    real, device_triton._launch = device_triton._launch, lambda kernel, grid, *a, **m: None
    out = {}
    try:
        with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
            for name, (settings, _rows) in WEIGHT_CONFIGS.items():
                cost = step_cost(Path(tmp) / name, settings, 64, mp)
                out[name] = {"frames": cost.frames, "weight_rows": cost.weight_rows}
    finally:
        device_triton._launch = real
    return out


def monitored_run(config: str) -> None:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(config)
    mon.set_monitor(model, optimizer=opt)
    for _ in range(2):
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    mon.close()


def main() -> None:
    assert os.environ.get("TRAINMON_DEVICE_PATH") == "1" and os.environ.get(device_triton.INTERPRET_ENV) == "1"
    result = {
        "values": value_cases(),
        "negative_offsets": negative_offsets(),
        "counts": counts(),
        "fallback": fallback(),
        "planned": planned_blocks(),
        "step_frames": step_frames(),
    }
    monitored_run(sys.argv[1])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
