"""A ``TorchDispatchMode`` that counts what the statistics path asks of a device.

Used by the accelerator-path tests and ``benchmarks/device_ops.py`` under the seam
(``TRAINMON_DEVICE_PATH=1``): every aten op that is not a view is a proxy for one kernel launch;
``_local_scalar_dense``/``item``/``nonzero``/``is_nonzero`` are host syncs; ops that turn Python
data into a tensor (``lift_fresh``, the source of every ``torch.tensor(...)``) or change a tensor's
device are host<->device copies; ``largest`` is the largest tensor an op allocated (out= results
and views allocate nothing).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCounter", "SYNC_OPS", "host_syncs"]

SYNC_OPS = frozenset({"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal"})
_HOST_DATA = frozenset({"lift_fresh", "lift_fresh_copy", "scalar_tensor"})


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as c: ...`` then ``c.ops`` (non-view aten ops), ``c.syncs`` (those the
    caller asked for: a sync made inside another op's kernel is not seen, see ``host_syncs``),
    ``c.copies`` (host data entering or a device change), ``c.largest`` (bytes), ``c.names``,
    ``c.dtypes`` (the dtypes of the tensors ops produced: ``c.dtypes[torch.float64]`` is fp64 work)."""

    def __init__(self, buffers: bool = True) -> None:
        """``buffers=False``: ``empty``/``zeros`` allocations (persistent row buffers) do not count
        towards ``largest``."""
        super().__init__()
        self._skip_largest = frozenset() if buffers else frozenset({"empty", "zeros", "empty_strided"})
        self.names: Counter[str] = Counter()
        self.dtypes: Counter[torch.dtype] = Counter()
        self.ops = self.syncs = self.copies = self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.is_view or name in ("detach", "alias"):
            return out
        self.ops += 1
        self.names[name] += 1
        if name in SYNC_OPS:
            self.syncs += 1
        if name in _HOST_DATA or (name in ("_to_copy", "copy_") and _device_change(args, kwargs, out)):
            self.copies += 1
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.dtypes[t.dtype] += 1
        if "out" not in kwargs and not _mutates(func) and name not in self._skip_largest:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def _mutates(func) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


def _device_change(args, kwargs, out) -> bool:
    if len(args) > 1 and isinstance(args[1], torch.Tensor) and isinstance(args[0], torch.Tensor):  # copy_
        return args[0].device != args[1].device
    src = next((a for a in args if isinstance(a, torch.Tensor)), None)
    dst = out if isinstance(out, torch.Tensor) else None
    if name_device := kwargs.get("device"):
        return src is not None and torch.device(name_device) != src.device
    return src is not None and dst is not None and src.device != dst.device


def host_syncs(fn) -> int:
    """Host syncs made while ``fn()`` runs, those inside other ops' kernels included (e.g.
    ``segment_reduce`` checking its lengths with two ``item()`` calls unless ``unsafe=True``),
    which a dispatch mode such as ``OpCounter`` never sees: counted from the profiler's events
    (``_local_scalar_dense``, ``nonzero``, ``is_nonzero``, ``equal``).  The profiler's first start
    takes about a second."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = {f"aten::{name}" for name in SYNC_OPS - {"item"}}  # item is _local_scalar_dense's caller
    return sum(1 for event in prof.events() if event.name in names)
