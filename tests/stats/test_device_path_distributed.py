"""The accelerator path on real gloo ranks, through the seam: sharded rows merged in float64 on the
host equal the full tensor's stats; DDP's per-parameter capture inside backward makes no host sync
(today's eager path made one per parameter with ``nans``)."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests._support.dist_checks import MB, batch, micro, rank_dir, tiny_model, write_config
from tests._support.distributed import run_distributed
from tests._support.runs import reference_stats
from trainmon import TrainerMon
from trainmon.stats.engine import StatsEngine, Tracked
from trainmon.stats.table import STAT_NAMES
from trainmon.testing.op_counter import OpCounter

pytestmark = pytest.mark.slow   # real multi-process gloo jobs

OPS = ["norm", "mean", "min", "max", "nans"]


def _sharded_merge(rank, world):
    g = torch.Generator().manual_seed(7)
    fulls = [torch.randn(101, generator=g), (torch.randn(64, generator=g) * 5).to(torch.bfloat16),
             torch.randn(9, generator=g).to(torch.float16), torch.randn(30, generator=g)]
    fulls[3][[2, 20]] = math.nan
    fulls[3][5] = math.inf
    cuts = [[40], [64], [3], [10]]            # rank 1's shard of the bf16 tensor is empty
    engine = StatsEngine(list(STAT_NAMES))
    shards = [torch.tensor_split(f, c)[rank] for f, c in zip(fulls, cuts)]
    engine.partials([s.reshape(-1)[:1] for s in shards if s.numel()])  # buffers, outside the count
    engine.discard()
    with OpCounter() as c:
        engine.capture("w", [Tracked(f"t{i}", s, shape=tuple(f.shape)) for i, (s, f) in enumerate(zip(shards, fulls))],
                       group=dist.group.WORLD)
    assert c.syncs == 0 and c.copies == 0
    rows = engine.finish_step(0)
    for row, full in zip(rows, fulls):
        want = reference_stats(full)
        for op in STAT_NAMES:
            got, w = row.stats[op], want[op]
            assert (math.isnan(got) and math.isnan(w)) or got == pytest.approx(w, rel=1e-5, abs=1e-6), (row.name, op)


def _ddp_backward_syncs(rank, world, tmp, monitored):
    os.environ["TRAINMON_RUN_ID"] = f"seam-ddp-{monitored}"
    cfg = write_config(tmp / f"seam{monitored}.json", wg_distribution=True, ops=OPS)
    model = tiny_model()
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=0.05)
    mon = TrainerMon(cfg) if monitored else None
    if mon:
        mon.set_monitor(ddp, grad_acc_steps=2, optimizer=opt)
    syncs = 0
    for step in range(2):
        x, y = batch(step, world * 2 * MB)
        for k in range(2):
            xb, yb = micro(x, y, world, 2, rank, k)
            loss = torch.nn.functional.mse_loss(ddp(xb), yb) / 2
            with OpCounter() as c:
                loss.backward()
            syncs += c.syncs
        opt.step()
        opt.zero_grad()
    if mon:
        mon.close()
    return syncs


def _body(rank, world, tmp):
    os.environ["TRAINMON_DEVICE_PATH"] = "1"
    _sharded_merge(rank, world)
    base = _ddp_backward_syncs(rank, world, tmp, False)
    with_monitor = _ddp_backward_syncs(rank, world, tmp, True)
    out = rank_dir("seam-ddp-True", rank)
    meta = json.loads((out.parent / "run.json").read_text())
    return base, with_monitor, meta.get("stats_path"), len(list(out.glob("grad_unreduced_*.csv")))


def test_sharded_merge_and_ddp_per_param_capture_on_the_device_path(output_root, tmp_path):
    results = run_distributed(_body, world_size=2, timeout=180, args=(tmp_path,))
    for base, with_monitor, stats_path, files in results:
        assert with_monitor == base, (base, with_monitor)   # the monitor adds no sync inside backward
        assert files >= 1
    assert results[0][2] == {"cpu": "device"}


def _ddp_bucket_views(rank, world, tmp):
    """DDP with ``gradient_as_bucket_view``: grads are views of the bucket, grad_reduced is one batch."""
    from tests._support.runs import read_family

    os.environ["TRAINMON_DEVICE_PATH"] = "1"
    os.environ["TRAINMON_RUN_ID"] = "seam-bucket-views"
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(3)))
    ddp = DDP(model, gradient_as_bucket_view=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    mon = TrainerMon(write_config(tmp / "bucket.json", wg_distribution=True, ops=["norm", "mean", "min", "max"]))
    mon.set_monitor(ddp, optimizer=opt)
    names = {p: n for n, p in model.named_parameters()}
    truth, counts = [], []
    for step in range(2):
        x = torch.randn(8, 256, generator=torch.Generator().manual_seed(10 * step + rank))
        ddp(x).square().mean().backward()
        storages = {p.grad.untyped_storage().data_ptr() for p in names}
        truth.append({n: reference_stats(p.grad) for p, n in names.items()})
        with OpCounter() as c:
            opt.step()
        counts.append((len(storages), c.names["segment_reduce"], c.names["aminmax"]))
        opt.zero_grad(set_to_none=False)
    mon.close()
    df = read_family(rank_dir("seam-bucket-views", rank), "grad_reduced")
    for row in df.itertuples(index=False):
        want = truth[row.step][row.name]
        for op in ("norm", "mean", "min", "max"):
            atol = want["_mean_atol"] if op == "mean" else 1e-30
            assert getattr(row, op) == pytest.approx(want[op], rel=1e-5, abs=atol), (row.name, op)
    return counts, len(df)


def test_ddp_bucket_view_grads_are_reduced_as_one_batch_and_equal_the_reduced_grads(output_root, tmp_path):
    for counts, rows in run_distributed(_ddp_bucket_views, world_size=2, timeout=180, args=(tmp_path,)):
        assert rows == 2 * 6
        # one bucket; the six grads of grad_reduced: 4 segment reductions and 1 aminmax, not 6
        assert counts == [(1, 4, 1)] * 2, counts
