"""Helpers shared by the multi-rank tests: a tiny model, its data, and row checks against tensors."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
import torch.nn as nn

from tests._support.runs import read_family, reference_stats

OPS = ["norm", "mean", "min", "max"]
RTOL = 1e-5
MB = 2        # rows per micro-batch per rank


def grads(model, x, y, scale):
    model.zero_grad(set_to_none=True)
    (torch.nn.functional.mse_loss(model(x), y) * scale).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def micro(x, y, world, acc, rank, k):
    lo = (k * world + rank) * MB
    return x[lo:lo + MB], y[lo:lo + MB]


def expected_step(ref, step, world, acc, rank, no_sync):
    """(grad_unreduced of this rank, the full-batch grad) from a single-process reference."""
    x, y = batch(step, world * acc * MB)
    per = [[grads(ref, *micro(x, y, world, acc, r, k), 1.0 / acc) for k in range(acc)]
           for r in range(world)]
    names = list(per[0][0])
    local = {n: sum(per[rank][k][n] for k in range(acc)) for n in names}
    if not no_sync:
        # DDP all-reduces every micro-batch: the last one's hook sees the mean of the earlier
        # micro-batches plus this rank's own last micro-batch (documented in docs/distributed.md).
        local = {n: sum(sum(per[r][k][n] for r in range(world)) / world for k in range(acc - 1))
                 + per[rank][acc - 1][n] for n in names}
    full = grads(ref, x, y, 1.0)    # one process, the whole global batch
    return local, full


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def batch(step: int, rows: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return torch.randn(rows, 6, generator=g), torch.randn(rows, 3, generator=g)


def write_config(path: Path, **cfg) -> Path:
    """Every rank writes the same file: by rename, so no rank ever reads a half-written one."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cfg))
    os.replace(tmp, path)
    return path


def rank_dir(run_id: str, rank: int) -> Path:
    return Path(os.environ["MONITOR_OUTPUT_DIR"]) / run_id / f"rank{rank}"


def check_family(rank_dir_: Path, family: str, step: int, expected: dict[str, torch.Tensor],
                 ops=OPS, rtol: float = RTOL) -> int:
    """Every expected tensor has exactly one row at ``step`` whose stats match the tensor's."""
    df = read_family(rank_dir_, family)
    assert not df.empty, f"no {family} rows in {rank_dir_}"
    at = df[df["step"] == step]
    assert sorted(at["name"]) == sorted(expected), (family, step, sorted(at["name"]), sorted(expected))
    for name, tensor in expected.items():
        row = at[at["name"] == name].iloc[0]
        ref = reference_stats(tensor)
        for op in ops:
            atol = ref["_mean_atol"] if op == "mean" else 1e-12
            assert math.isclose(row[op], ref[op], rel_tol=rtol, abs_tol=atol), \
                (family, step, name, op, row[op], ref[op])
        assert row["shape"] == str(list(tensor.shape)), (family, name, row["shape"], tensor.shape)
    return len(at)


def reference_state(ref: nn.Module, ref_opt, names=None) -> tuple[dict, dict]:
    """(params after the step, {exp_avg, exp_avg_sq}) of the single-process reference, by name
    (``names``: the names to use, in ``ref.parameters()`` order; default its own)."""
    named = list(zip(names, ref.parameters())) if names is not None else list(ref.named_parameters())
    moments = {k: {n: ref_opt.state[p][k].clone() for n, p in named} for k in ("exp_avg", "exp_avg_sq")}
    return {n: p.detach().clone() for n, p in named}, moments


def check_param_families(out: Path, step: int, origin: dict, updated: dict, moments: dict) -> None:
    """param_origin, param_updated and the Adam moments of one step against the reference."""
    check_family(out, "param_origin", step, origin)
    check_family(out, "param_updated", step, updated)
    for k, tensors in moments.items():
        check_family(out, k, step, tensors)


def filtered_all_reduce(t: torch.Tensor) -> None:
    """A comm call made from this file (the cc_codeline test selects calls by file name)."""
    import torch.distributed as dist

    dist.all_reduce(t)
