"""The multi-rank test harness itself: values in rank order, a failing rank's traceback, a hang
turned into a failure."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests._support.distributed import DistributedFailure, run_distributed

pytestmark = pytest.mark.slow   # real multi-process gloo jobs


def _sum_ranks(rank, world, scale):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return (rank, world, t.item() * scale)


def _rank1_fails(rank, world):
    if rank == 1:
        raise ValueError("boom on purpose")
    return rank


def _rank1_hangs(rank, world):
    if rank == 1:
        time.sleep(60)
    return rank


def test_results_in_rank_order_and_failures_raise():
    assert run_distributed(_sum_ranks, world_size=3, args=(2.0,)) == [(r, 3, 6.0) for r in range(3)]
    with pytest.raises(DistributedFailure, match=r"(?s)rank 1 failed.*ValueError: boom on purpose"):
        run_distributed(_rank1_fails, world_size=2)
    start = time.monotonic()
    with pytest.raises(DistributedFailure, match=r"ranks \[1\] did not finish within 3 s"):
        run_distributed(_rank1_hangs, world_size=2, timeout=3)
    assert time.monotonic() - start < 30
