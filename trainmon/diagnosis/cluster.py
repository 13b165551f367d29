"""Where the per-bucket checks run: in this process, or on a Dask cluster (``--cluster ADDRESS``).

Every analysis command cuts a staged run into buckets (``engine_buckets``) and runs the one
pandas rule set on each; ``map_buckets`` is the single place that decides where those calls run.
``fn`` must be a module-level function and ``items`` plain picklable values (paths, ranges,
rules), so the same call can be shipped to workers that read the staged Parquet files from
shared storage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

__all__ = ["map_buckets"]

T = TypeVar("T")
R = TypeVar("R")


def map_buckets(fn: Callable[[T], R], items: Iterable[T], *, cluster: str | None = None) -> list[R]:
    """``[fn(item) for item in items]``, in order; on the Dask scheduler at ``cluster`` if given."""
    if cluster is None:
        return [fn(item) for item in items]
    raise NotImplementedError("the Dask cluster path is being built")  # replaced by the cluster work
