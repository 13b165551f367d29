"""What the child of ``os.fork`` does with the monitor it inherited: nothing.

A DataLoader worker or a fork pool started from the training process inherits the monitor's
sessions, drivers and sinks.  They belong to the parent: its writer thread does not exist in the
child, a lock it held at the fork stays held for ever, and rows written from the child would land
in the parent's files as duplicate steps.  Objects registered here get ``forget_parent()`` called
in the child right after the fork (``os.register_at_fork``); each makes itself inert there, so
every hook becomes a no-op and no lock, thread, collective or file of the parent is touched.
A ``TrainerMon`` created in the child is a monitor of its own.
"""

from __future__ import annotations

import os
import weakref
from typing import Protocol

__all__ = ["forget_in_forked_child"]


class _Inherited(Protocol):
    def forget_parent(self) -> None: ...


_LIVE: weakref.WeakSet = weakref.WeakSet()


def forget_in_forked_child(obj: _Inherited) -> None:
    """Call ``obj.forget_parent()`` in the child of every later ``os.fork`` (while ``obj`` lives)."""
    _LIVE.add(obj)


def _forget_all() -> None:
    for obj in list(_LIVE):
        try:
            obj.forget_parent()
        except Exception:  # never fail a fork: the object is unused in the child either way
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_all)
