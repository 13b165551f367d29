"""Where recorded rows go: build the configured sinks behind one off-thread writer.

Sink modules are imported only when their format is asked for, so a format whose
dependencies are missing costs nothing until it is used.  A format name is one of three kinds
(looked up in this order): a sink registered with :func:`register_sink`, a built-in one
(:data:`SINK_MODULES`), or one an installed package advertises in the entry-point group
``trainmon.sinks`` (``name = "module:Class"`` or ``name = "module"`` whose import registers it;
loaded only when that format is asked for).  docs/sinks.md.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from trainmon.sinks.base import DropFamilies, NullSink, Sink, SinkOptions, register_sink, registered_sinks, sink_class

__all__ = [
    "Sink",
    "NullSink",
    "SinkOptions",
    "register_sink",
    "create_sink",
    "available_formats",
    "known_formats",
    "load_sink_class",
    "SinkLoadError",
    "SINK_MODULES",
    "ENTRY_POINT_GROUP",
]

logger = logging.getLogger(__name__)

# format name -> module whose import registers it
SINK_MODULES: dict[str, str] = {
    "csv": "trainmon.sinks.csv",
    "tensorboard": "trainmon.sinks.tensorboard",
    "parquet": "trainmon.sinks.parquet",
    "wandb": "trainmon.sinks.wandb",
    "mlflow": "trainmon.sinks.mlflow",
}

ENTRY_POINT_GROUP = "trainmon.sinks"


class SinkLoadError(Exception):
    """A third-party sink's entry point is broken (its import fails, or it names no sink)."""


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    """Sinks installed packages advertise, by format name (the first of a repeated name wins).
    Only their names are read here: nothing is imported."""
    found: dict[str, importlib.metadata.EntryPoint] = {}
    try:
        points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    except Exception as exc:  # a broken installed distribution must not break every config
        logger.warning("trainmon: cannot list the %s entry points: %s", ENTRY_POINT_GROUP, exc)
        return found
    for point in points:
        found.setdefault(point.name, point)
    return found


def known_formats() -> tuple[str, ...]:
    """Every format name that may be asked for: registered, built-in, advertised by a package.
    Nothing is imported: a name here may still be unusable (a missing extra)."""
    return tuple(sorted({*registered_sinks(), *SINK_MODULES, *_entry_points()}))


def load_sink_class(fmt: str) -> type[Sink]:
    """The sink class of ``fmt``, importing its module first if it has one.

    ``KeyError``: no such format; ``ImportError``: its module or a package it needs is missing;
    :class:`SinkLoadError`: an entry point that fails otherwise or registers nothing.
    """
    if fmt in registered_sinks():
        return sink_class(fmt)
    module = SINK_MODULES.get(fmt)
    if module is not None:
        importlib.import_module(module)
        return sink_class(fmt)
    point = _entry_points().get(fmt)
    if point is None:
        raise KeyError(fmt)
    return _load_entry_point(fmt, point)


def _load_entry_point(fmt: str, point: importlib.metadata.EntryPoint) -> type[Sink]:
    where = f"entry point {point.name} = {point.value} (group {ENTRY_POINT_GROUP})"
    try:
        loaded = point.load()
    except ImportError:
        raise
    except Exception as exc:
        raise SinkLoadError(f"{where} failed to load: {type(exc).__name__}: {exc}") from exc
    if isinstance(loaded, type) and issubclass(loaded, Sink):
        if fmt not in registered_sinks():
            register_sink(fmt)(loaded)
        return sink_class(fmt)
    if fmt in registered_sinks():  # a module whose import registered the sink
        return sink_class(fmt)
    raise SinkLoadError(f"{where} is neither a Sink subclass nor a module that registers a sink named {fmt!r}")


def available_formats() -> tuple[str, ...]:
    """Formats that can be built here: built-in ones whose module imports, plus registered ones
    (entry points are not imported for this: they are listed by :func:`known_formats`)."""
    names = set(registered_sinks())
    for fmt, module in SINK_MODULES.items():
        try:
            load_sink_class(fmt)
        except ImportError as exc:
            logger.debug("output format %r unavailable: %s", fmt, exc)
            continue
        except Exception as exc:  # a broken sink module must not break config validation
            logger.warning("output format %r unavailable: importing %s failed: %s", fmt, module, exc)
            continue
        names.add(fmt)
    return tuple(sorted(names))


def create_sink(
    formats: str | Sequence[str],
    options: SinkOptions,
    *,
    threaded: bool = True,
    max_pending_steps: int = 256,
    extra_sinks: Sequence[Sink] = (),
    drop_families: frozenset[str] = frozenset(),
    settings: Mapping[str, Any] | None = None,
) -> Sink:
    """One sink writing every format in ``formats`` (a name or a list of names).

    Returns ``AsyncSink(FanoutSink([...]))`` (or the bare ``FanoutSink`` with
    ``threaded=False``); an empty list gives a :class:`NullSink`.  Unknown or unusable
    formats raise ``ValueError`` naming the formats that are available.  ``extra_sinks`` (already
    built, e.g. the alert sink) join the same fan-out behind the same writer thread.  Rows of
    ``drop_families`` reach none of them (``replicated_once``).  ``settings`` maps a format to
    its parsed config block (``SinkOptions.settings`` of that sink; ``runtime.features.sink_settings``).
    """
    from trainmon.sinks.async_writer import AsyncSink, FanoutSink

    names = [formats] if isinstance(formats, str) else list(dict.fromkeys(formats))
    sinks = [_build(fmt, options, settings) for fmt in names] + list(extra_sinks)
    if not sinks:
        return NullSink(options)
    fanout: Sink = FanoutSink(sinks, options)
    if drop_families:
        fanout = DropFamilies(fanout, drop_families)
    return AsyncSink(fanout, max_pending_steps=max_pending_steps) if threaded else fanout


def _build(fmt: str, options: SinkOptions, settings: Mapping[str, Any] | None) -> Sink:
    try:
        cls = load_sink_class(fmt)
    except KeyError:
        raise ValueError(
            f"unknown output format {fmt!r}; available: {', '.join(available_formats()) or 'none'}"
        ) from None
    except (ImportError, SinkLoadError) as exc:
        raise ValueError(f"output format {fmt!r} cannot be used here: {exc}") from exc
    if settings is not None:
        options = dataclasses.replace(options, settings=settings.get(fmt))
    if options.settings is None and cls.settings_schema is not None:
        options = dataclasses.replace(options, settings=default_settings(cls))
    return cls(options)


def default_settings(cls: type[Sink]) -> Any:
    """``cls``'s settings when the config has no block for it: every field's default (a schema
    with a required field needs its block; runtime.features says so before any sink is built)."""
    assert cls.settings_schema is not None
    try:
        return cls.settings_schema()
    except TypeError as exc:
        raise ValueError(f"the {cls.__name__} sink needs its config block: {exc}") from None
