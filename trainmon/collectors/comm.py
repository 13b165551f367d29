"""Tensors passed to ``torch.distributed`` collectives and point-to-point ops (``cc_distribution``).

Emits family ``comm`` (file ``comm_{a}-{b}.csv``), one row per tensor argument per recorded call:

========= ==================================================================================
column    value
========= ==================================================================================
name      the op (``all_reduce``, ``isend``, ``batch_isend_irecv``, ``ddp_bucket``, ...)
step      the step the row was recorded in (an async op: the step its completion was seen)
call      index of the call among this rank's comm calls of that step, from 0
when      ``pre`` (before the call, only with ``cc_pre_hook``) or ``post`` (after completion)
arg       position of the argument in the op's signature (``batch_isend_irecv``: 0)
item      index in a tensor-list argument (0 for a single tensor)
caller    ``file:line`` of the Python code that made the call
<ops>     the config's ``ops`` of that tensor; then ``shape``, ``dtype``
========= ==================================================================================

Config: ``{"cc_distribution": {"enable": true, "cc_codeline": ["train\\.py:4[0-9]$"],
"cc_pre_hook": true}}``.  ``cc_codeline`` regexes are searched in the caller's ``file:line``
(only the frame that made the call is looked at, and each call site is matched once).

The ops are replaced on the ``torch.distributed`` module (``isend``/``irecv`` also in
``distributed_c10d``, which ``P2POp`` checks against) and put back exactly on ``close()``.
``P2POp`` lists built before the wrap, or during it and run after ``close()``, keep working.
Only Python callers that look the op up on the module are seen: DDP's C++ reducer and
``torch.distributed._functional_collectives`` are invisible (see ``record_ddp_comm`` in
``trainmon.integrations.torch_ddp`` for DDP's bucket reduces).  The monitor's own collectives
(run directory, shard merges) are never recorded.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist

from trainmon.collectors.base import Collector, register_collector
from trainmon.core import dist as _dist
from trainmon.core.hooks import Handle
from trainmon.families import Family
from trainmon.stats.engine import Tracked

__all__ = ["CommCollector", "COMM_OPS"]

log = logging.getLogger(__name__)

COMM_OPS = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    # newer names (FSDP2 in torch 2.13 calls these) and the legacy ones (older Megatron);
    # whichever this torch lacks is skipped
    "all_gather_single",
    "reduce_scatter_single",
    "_all_gather_base",
    "_reduce_scatter_base",
)
_ALWAYS_ASYNC = ("isend", "irecv", "batch_isend_irecv")
# P2POp validates ``op`` against these names in distributed_c10d: they are replaced there too.
_ALSO_IN_C10D = ("isend", "irecv")
_PEER_KEY = {"isend": ("group_src", "group_dst"), "irecv": ("group_dst", "group_src")}


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


class _Op:
    """What the recorder needs to know about one op's signature."""

    def __init__(self, name: str, original: Callable):
        self.name = name
        self.original = original
        self.params = list(inspect.signature(original).parameters)
        self.async_pos = self.params.index("async_op") if "async_op" in self.params else None
        self.run = self._aligned if name == "batch_isend_irecv" else original

    def _aligned(self, *args: Any, **kwargs: Any) -> Any:
        with _AlignedP2P(args, kwargs):
            return self.original(*args, **kwargs)

    def is_async(self, args: tuple, kwargs: dict) -> bool:
        if self.name in _ALWAYS_ASYNC:
            return True
        if self.async_pos is None:
            return False
        if len(args) > self.async_pos:
            return bool(args[self.async_pos])
        return bool(kwargs.get("async_op", False))

    def tensor_args(self, args: tuple, kwargs: dict) -> list[tuple[int, int, torch.Tensor]]:
        """``(arg position, item, tensor)`` for every tensor argument, in signature order."""
        if self.name == "batch_isend_irecv":
            ops = args[0] if args else kwargs.get("p2p_op_list", [])
            return [(0, i, op.tensor) for i, op in enumerate(ops)]
        out: list[tuple[int, int, torch.Tensor]] = []
        for pos, name in enumerate(self.params):
            value = args[pos] if pos < len(args) else kwargs.get(name)
            out.extend((pos, i, t) for i, t in enumerate(_tensors(value)))
        return out


class _Patch:
    """The replaced module attributes; restores exactly what was there."""

    def __init__(self) -> None:
        self._entries: list[tuple[Any, str, Any, Any]] = []

    def install(self, module: Any, name: str, wrapper: Any) -> None:
        self._entries.append((module, name, getattr(module, name), wrapper))
        setattr(module, name, wrapper)

    def restore(self) -> None:
        for module, name, original, wrapper in reversed(self._entries):
            if getattr(module, name) is wrapper:
                setattr(module, name, original)
            else:  # someone wrapped over us: leave theirs; ours now passes straight through
                log.warning(
                    "trainmon: torch.distributed.%s was replaced after trainmon wrapped it; "
                    "leaving the newer one in place",
                    name,
                )
        self._entries.clear()


@register_collector
class CommCollector(Collector):
    name = "comm"
    priority = 20

    @staticmethod
    def enabled(config) -> bool:
        return config.cc_distribution.enable

    def attach(self) -> None:
        cfg = self.ctx.config.cc_distribution
        self._pre = cfg.cc_pre_hook
        self._filters = [re.compile(p) for p in cfg.cc_codeline]
        self._sites: dict[tuple[str, int], bool] = {}
        self._lock = threading.RLock()
        self._inflight: list[tuple[list, list, dict]] = []  # (works, tensors, meta) of async calls
        self._count_step: int | None
        self._count_step, self._count = None, 0
        self.active = True
        if not dist.is_available():
            log.warning("trainmon: cc_distribution: torch.distributed is not available; nothing recorded")
            return
        import torch.distributed.distributed_c10d as c10d

        patch = _Patch()
        ref = weakref.ref(self)
        for op_name in COMM_OPS:
            original = getattr(dist, op_name, None)
            if original is None:
                continue
            wrapper = _make_wrapper(_Op(op_name, original), ref)
            patch.install(dist, op_name, wrapper)
            if op_name in _ALSO_IN_C10D and getattr(c10d, op_name) is original:
                patch.install(c10d, op_name, wrapper)
        self.handles.append(Handle(patch.restore))

    def detach(self) -> None:
        with self._lock:
            self.active = False
            self.poll()
            if self._inflight:
                log.warning(
                    "trainmon: %d async comm ops had not completed at close; their post rows are missing",
                    len(self._inflight),
                )
                self._inflight.clear()
        super().detach()

    def on_step_end(self) -> None:
        self.poll()

    # -- recording ---------------------------------------------------------------------------
    def next_call(self) -> int:
        step = self.ctx.clock.step
        if step != self._count_step:
            self._count_step, self._count = step, 0
        index, self._count = self._count, self._count + 1
        return index

    def selected(self, frame: Any) -> str | None:
        """The caller's ``file:line`` if this call is recorded, else None."""
        site = (frame.f_code.co_filename, frame.f_lineno) if frame is not None else ("?", 0)
        text = f"{site[0]}:{site[1]}"
        if not self._filters:
            return text
        hit = self._sites.get(site)
        if hit is None:
            hit = self._sites[site] = any(f.search(text) for f in self._filters)
        return text if hit else None

    def capture(self, op: str, when: str, tensors: list, meta: dict) -> None:
        engine = self.ctx.engine
        with self._lock:
            for pos, item, t in tensors:
                engine.capture(
                    Family.COMM,
                    [Tracked(op, t.detach())],
                    extra={"call": meta["call"], "when": when, "arg": pos, "item": item, "caller": meta["caller"]},
                )

    def track(self, works: list, tensors: list, meta: dict) -> None:
        with self._lock:
            self._inflight.append((works, tensors, meta))

    def poll(self) -> None:
        """Record the post rows of async calls that have completed since the last poll."""
        if not self._inflight:
            return
        with self._lock:
            waiting = []
            for works, tensors, meta in self._inflight:
                if all(w is None or w.is_completed() for w in works):
                    self.capture(meta["op"], "post", tensors, meta)
                else:
                    waiting.append((works, tensors, meta))
            self._inflight = waiting

    def call(self, op: _Op, args: tuple, kwargs: dict, frame: Any) -> Any:
        index = self.next_call()
        caller = self.selected(frame) if self.ctx.clock.collecting else None
        if caller is None:
            with _dist.internal():  # ops made inside this one are part of it, never counted
                return op.run(*args, **kwargs)
        self.poll()
        tensors = op.tensor_args(args, kwargs)
        meta = {"op": op.name, "call": index, "caller": caller}
        if self._pre:
            self.ctx.guard.run(self, self.capture, op.name, "pre", tensors, meta)
        with _dist.internal():  # batch_isend_irecv calls isend/irecv: one call, not three
            result = op.run(*args, **kwargs)
        if op.is_async(args, kwargs):
            works = result if isinstance(result, list) else [result]
            self.track(works, tensors, meta)
        else:
            self.ctx.guard.run(self, self.capture, op.name, "post", tensors, meta)
        return result


class _AlignedP2P:
    """While ``batch_isend_irecv`` runs, P2POps built before the wrap (holding the original
    ``isend``/``irecv``) point at the current module functions: batch_isend_irecv picks the peer
    keyword by identity with them, and would hand an original isend a receive's keyword."""

    def __init__(self, args: tuple, kwargs: dict):
        import torch.distributed.distributed_c10d as c10d

        ops = args[0] if args else kwargs.get("p2p_op_list", [])
        current = {getattr(getattr(c10d, n), "__trainmon_original__", None): getattr(c10d, n) for n in _ALSO_IN_C10D}
        self._swapped = [(p, p.op) for p in ops if getattr(p, "op", None) in current and p.op is not None]
        self._current = current

    def __enter__(self) -> None:
        for p, old in self._swapped:
            p.op = self._current[old]

    def __exit__(self, *exc: object) -> None:
        for p, old in self._swapped:
            p.op = old


def _make_wrapper(op: _Op, ref: weakref.ref[CommCollector]) -> Callable:
    original = op.original
    peer_fix = _PEER_KEY.get(op.name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if peer_fix is not None and peer_fix[0] in kwargs and peer_fix[1] not in kwargs:
            # batch_isend_irecv tells isend from irecv by identity with the *current* module
            # attribute, so a P2POp built after the wrap and run after close() gets the wrong key.
            kwargs[peer_fix[1]] = kwargs.pop(peer_fix[0])
        rec = ref()
        if rec is None or not rec.active or _dist.in_internal():
            return op.run(*args, **kwargs)
        return rec.call(op, args, kwargs, sys._getframe(1))

    cast(Any, wrapper).__trainmon_original__ = original  # a function attribute: untyped
    return wrapper
