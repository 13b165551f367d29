"""Sink interface: where recorded rows go.  Sinks never see tensors."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trainmon.stats.rows import StepRows

__all__ = ["Sink", "NullSink", "DropFamilies", "SinkOptions", "register_sink", "sink_class", "registered_sinks"]


@dataclass(frozen=True)
class SinkOptions:
    """What every sink is built from: its rank directory and the output settings."""

    rank_dir: Path
    rank: int = 0
    ndigits: int | None = None  # significant digits; None = full precision
    step_count_per_record: int = 1  # steps per CSV file window


class Sink(ABC):
    """``write`` hands over one step's rows; ``flush`` makes them durable; ``close`` ends."""

    def __init__(self, options: SinkOptions):
        self.options = options

    @abstractmethod
    def write(self, rows: StepRows, step: int) -> None: ...

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.flush()


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
            self.inner.write(StepRows(lambda: kept), step)

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
