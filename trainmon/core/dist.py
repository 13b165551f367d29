"""Rank/world helpers that work (as a single process) without torch.distributed."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["initialized", "rank", "world_size", "broadcast_object", "all_gather_rows", "internal", "in_internal"]

_state = threading.local()


@contextmanager
def internal() -> Iterator[None]:
    """Marks the monitor's own collectives, so the comm-op recorder leaves them out."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def in_internal() -> bool:
    return getattr(_state, "depth", 0) > 0


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank(group: Any = None) -> int:
    return dist.get_rank(group) if initialized() else 0


def world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if initialized() else 1


def broadcast_object(value: Any, group: Any = None) -> Any:
    """``value`` of the group's first rank, on every rank of ``group``."""
    if not initialized() or world_size(group) == 1:
        return value
    src = dist.get_global_rank(group, 0) if group is not None else 0
    box = [value]
    with internal():
        dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_rows(t: torch.Tensor, group: Any) -> torch.Tensor:
    """``[world, *t.shape]``: every rank's ``t`` (same shape on all ranks), in group rank order."""
    if dist.get_backend(group) == "gloo" and t.device.type != "cpu":
        t = t.cpu()  # gloo reduces host memory
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    with internal():
        dist.all_gather(out, t.contiguous(), group=group)
    return torch.stack(out)
