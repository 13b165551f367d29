"""Agreement between the ranks of the monitor's group at a step boundary, on a gloo group of its own.

Used by the dynamic driver (which config is in force) and by escalations (did any rank alert).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from trainmon.core import dist as _dist

__all__ = ["Agreement"]


class Agreement:
    """Rank 0's values on every rank of ``group``; a no-op in a single process."""

    def __init__(self, group: Any = None, timeout_s: float = 1800.0):
        self.local = not _dist.initialized() or _dist.world_size(group) == 1
        self.group = None
        self.is_source = True
        if self.local:
            return
        kwargs: dict[str, Any] = {"backend": "gloo", "timeout": timedelta(seconds=timeout_s)}
        if group is not None:
            # Only the members build it, so a job whose other ranks never monitor still works.
            kwargs.update(ranks=dist.get_process_group_ranks(group), use_local_synchronization=True)
        # A CPU (gloo) group of its own: no device sync at the boundary, and a timeout of its own.
        self.group = dist.new_group(**kwargs)
        self.src = dist.get_global_rank(self.group, 0)
        self.is_source = dist.get_rank(self.group) == 0
        self._pair = torch.zeros(2, dtype=torch.int64)
        self._flag = torch.zeros(1, dtype=torch.int64)

    def version(self, version: int, step: int) -> tuple[int, int]:
        """Rank 0's (version, step)."""
        if self.local:
            return version, step
        if self.is_source:
            self._pair[0], self._pair[1] = version, step
        dist.broadcast(self._pair, src=self.src, group=self.group)
        v, s = self._pair.tolist()
        return v, s

    def value(self, value: Any) -> Any:
        """Rank 0's ``value`` (any picklable object)."""
        if self.local:
            return value
        box = [value if self.is_source else None]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]

    def max(self, value: int) -> int:
        """The largest ``value`` of all ranks (one all-reduce of one int64)."""
        if self.local:
            return value
        self._flag[0] = int(value)
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(self._flag.item())

    def value_from(self, value: Any, group_rank: int) -> Any:
        """``value`` of the rank ``group_rank`` of the group (any picklable object)."""
        if self.local:
            return value
        assert self.group is not None  # built in __init__ unless local
        box = [value if dist.get_rank(self.group) == group_rank else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, group_rank), group=self.group)
        return box[0]

    @property
    def size(self) -> int:
        return 1 if self.local else dist.get_world_size(self.group)

    @property
    def group_rank(self) -> int:
        return 0 if self.local else dist.get_rank(self.group)

    def all_true(self, ok: bool) -> bool:
        if self.local:
            return ok
        self._flag[0] = int(bool(ok))
        dist.all_reduce(self._flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(self._flag.item())

    def close(self) -> None:
        if self.group is not None:
            group, self.group = self.group, None
            try:
                dist.destroy_process_group(group)
            except Exception:
                pass
