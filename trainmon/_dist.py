"""Rank/world helpers that work (as a single process) without torch.distributed."""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["initialized", "rank", "world_size", "broadcast_object"]


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
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]
