"""Young-generation garbage collections while a function runs: the deterministic measure of per-row
garbage (CPython collects generation 0 every ~700 net container allocations), used by the tests and
``benchmarks/host_cost.py``."""

from __future__ import annotations

import gc
from collections.abc import Callable

__all__ = ["young_collections"]


def young_collections(fn: Callable[[], object], *, collect_first: bool = True) -> int:
    """Generation-0 collections started while ``fn`` runs, on any thread; ``collect_first``: a full
    collection before, so that garbage made earlier is not counted."""
    count = 0

    def callback(phase: str, info: dict) -> None:
        nonlocal count
        if phase == "start" and info.get("generation") == 0:
            count += 1

    if collect_first:
        gc.collect()
    gc.callbacks.append(callback)
    try:
        fn()
    finally:
        gc.callbacks.remove(callback)
    return count
