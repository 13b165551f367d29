"""The device-side shard merge (one all_gather per group) against the host reference merge."""
from __future__ import annotations

import math

import torch

from trainmon.stats.engine import merge_rows
from trainmon.stats.partials import compute_partials, device_columns
from trainmon.stats.table import merge_partials, partials_for

COLUMNS = device_columns(partials_for(("norm", "mean", "min", "max", "std", "zeros", "nans", "infs")))


def _rows_of_shards(full: torch.Tensor, cuts: list[int]) -> torch.Tensor:
    pieces = list(torch.tensor_split(full, cuts))
    return torch.stack([compute_partials([p], COLUMNS, 1e-8)[0] for p in pieces])  # [world, C]


def test_merge_rows_equals_reference_merge_and_full_tensor():
    g = torch.Generator().manual_seed(0)
    fulls = [torch.randn(37, generator=g, dtype=torch.float64) * 3 + 1,
             torch.randn(5, generator=g, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)]
    fulls[1][2] = float("inf")
    cuts = [[10, 30], [2, 5], [4, 4]]     # the last two shards of the zeros tensor are empty
    gathered = torch.stack([_rows_of_shards(f, c) for f, c in zip(fulls, cuts)], dim=1)  # [world, rows, C]
    merged = merge_rows(gathered, COLUMNS)
    for i, full in enumerate(fulls):
        host = merge_partials([dict(zip(COLUMNS, gathered[w, i].tolist())) for w in range(gathered.shape[0])])
        whole = dict(zip(COLUMNS, compute_partials([full], COLUMNS, 1e-8)[0].tolist()))
        for j, c in enumerate(COLUMNS):
            got = merged[i, j].item()
            for want in (host[c], whole[c]):
                assert (math.isnan(got) and math.isnan(want)) or math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9), \
                    (i, c, got, want)


def test_merge_rows_of_all_empty_shards_gives_empty_partials():
    gathered = torch.stack([_rows_of_shards(torch.zeros(0), [0]) for _ in range(1)], dim=1)
    merged = dict(zip(COLUMNS, merge_rows(gathered, COLUMNS)[0].tolist()))
    assert merged["count"] == 0 and merged["sumsq"] == 0 and merged["m2"] == 0
    assert merged["min"] == math.inf and merged["max"] == -math.inf
