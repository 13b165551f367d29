"""Sink interface: where recorded rows go.  Sinks never see tensors."""

from __future__ import annotations

import itertools
import logging
import os
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from trainmon.stats.rows import StepRows

__all__ = [
    "Sink",
    "NullSink",
    "DropFamilies",
    "SinkOptions",
    "register_sink",
    "sink_class",
    "registered_sinks",
    "claim_file",
    "writer_token",
]


@dataclass(frozen=True)
class SinkOptions:
    """What every sink is built from: its rank directory and the output settings."""

    rank_dir: Path
    rank: int = 0
    ndigits: int | None = None  # significant digits; None = full precision
    step_count_per_record: int = 1  # steps per CSV file window
    # This sink's own config block (the top-level key named like its format), parsed into its
    # ``settings_schema``; None when the sink declares no schema.
    settings: Any = None


class Sink(ABC):
    """``write`` hands over one step's rows; ``flush`` makes them durable; ``close`` ends.

    ``settings_schema``: a frozen dataclass whose fields are the keys of this sink's own config
    block (``"<format>": {...}``), checked by ``trainmon.config.settings.parse_settings``; the
    parsed instance arrives as ``options.settings`` (every default when the config has no block).
    None: the sink takes no block.
    """

    settings_schema: ClassVar[type | None] = None

    def __init__(self, options: SinkOptions):
        self.options = options
        _LIVE_SINKS.add(self)

    def forget_parent(self) -> None:
        """Run in the child of ``os.fork`` (a DataLoader worker, a fork pool): this copy belongs to
        the parent, whose writer thread, locks and files the child must never use (a lock held by
        the parent's writer thread at the fork would hang the child; its rows would duplicate the
        parent's).  Every call becomes a no-op and every lock a fresh one: the child records nothing."""
        for name, value in list(vars(self).items()):
            if isinstance(value, _LOCK_TYPES):
                setattr(self, name, type(value)())
        vars(self).update(write=_ignore, flush=_ignore, close=_ignore)  # for any Sink subclass

    @abstractmethod
    def write(self, rows: StepRows, step: int) -> None: ...

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.flush()


_LOCK_TYPES = (type(threading.Lock()), type(threading.RLock()))
_LIVE_SINKS: weakref.WeakSet[Sink] = weakref.WeakSet()


def _ignore(*args: object, **kwargs: object) -> None:
    pass


def _forget_parent_sinks() -> None:
    for sink in list(_LIVE_SINKS):
        try:
            sink.forget_parent()
        except Exception:  # never fail a fork; this copy is unused either way
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_parent_sinks)


class NullSink(Sink):
    """For ranks that do not write (``module_ranks``): the rank check lives in one place."""

    def __init__(self, options: SinkOptions | None = None):
        super().__init__(options or SinkOptions(rank_dir=Path(".")))

    def write(self, rows: StepRows, step: int) -> None:
        pass


class DropFamilies(Sink):
    """Hands ``inner`` every row except those of ``families`` (``replicated_once`` on ranks that
    are not data-parallel rank 0).  Runs where ``inner`` runs (the writer thread), so the rows are
    still built off the training thread."""

    def __init__(self, inner: Sink, families: frozenset[str]):
        super().__init__(inner.options)
        self.inner, self.families = inner, frozenset(families)

    def write(self, rows: StepRows, step: int) -> None:
        kept = [b for b in rows.blocks() if b.family not in self.families]
        if kept:
            self.inner.write(StepRows(lambda: kept, rows.wall_time), step)

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:
        self.inner.close()


_REGISTRY: dict[str, type[Sink]] = {}


def register_sink(name: str) -> Callable[[type[Sink]], type[Sink]]:
    """Class decorator: make a sink available as ``format: "<name>"``."""

    def add(cls: type[Sink]) -> type[Sink]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"sink '{name}' is already registered by {_REGISTRY[name].__qualname__}")
        _REGISTRY[name] = cls
        return cls

    return add


def sink_class(name: str) -> type[Sink]:
    return _REGISTRY[name]


def registered_sinks() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


class LostRows:
    """Rows a file sink could not write: the first failure is logged at once, the rest counted
    and reported at close (so a full disk gives two lines, not one per step)."""

    def __init__(self, where: Path, logger: logging.Logger):
        self.where = where
        self.log = logger  # the sink's own logger
        self.count = 0
        self._reported = 0
        self.first_error: str | None = None

    def lose(self, n_rows: int, path: object, exc: BaseException) -> None:
        self.count += n_rows
        if self.first_error is None:
            self.first_error = f"{path}: {exc}"
            self.log.warning(
                "trainmon: cannot write monitor output %s: %s; further failures are counted and reported at close",
                path,
                exc,
            )

    def report(self) -> None:
        new = self.count - self._reported
        if new:
            self.log.warning(
                "trainmon: %d monitor rows could not be written under %s (first error: %s)",
                new,
                self.where,
                self.first_error,
            )
            self._reported = self.count


# Several sinks of one process may write one rank directory at once (an escalation's flight
# recorder and its window, two monitors of one model): the names they write under must not collide.
_CLAIMS_LOCK = threading.Lock()
_CLAIMED_FILES: set[Path] = set()
_WRITER_TOKENS = itertools.count()


def claim_file(path: Path) -> bool:
    """Take ``path`` for this process's sinks: False if a sink of this process took it already
    (for a file that appears on disk only when finished, like a Parquet window)."""
    with _CLAIMS_LOCK:
        if path in _CLAIMED_FILES:
            return False
        _CLAIMED_FILES.add(path)
        return True


def writer_token() -> int:
    """A number no other sink of this process has: part of its temporary file names."""
    with _CLAIMS_LOCK:
        return next(_WRITER_TOKENS)


def sync_dir(path: Path) -> None:
    """Make a directory's entries (new, renamed files) durable; best effort, never raises."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
