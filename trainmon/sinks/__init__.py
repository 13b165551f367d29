"""Where recorded rows go: build the configured sinks behind one off-thread writer.

Sink modules are imported only when their format is asked for, so a format whose
dependencies are missing costs nothing until it is used.  A sink written elsewhere
becomes available by calling :func:`register_sink` before :func:`create_sink`.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence

from trainmon.sinks.base import DropFamilies, NullSink, Sink, SinkOptions, register_sink, registered_sinks, sink_class

__all__ = ["Sink", "NullSink", "SinkOptions", "register_sink", "create_sink", "available_formats", "SINK_MODULES"]

logger = logging.getLogger(__name__)

# format name -> module whose import registers it
SINK_MODULES: dict[str, str] = {
    "csv": "trainmon.sinks.csv",
    "tensorboard": "trainmon.sinks.tensorboard",
    "parquet": "trainmon.sinks.parquet",
}


def _load(fmt: str) -> type[Sink]:
    """The sink class of ``fmt``, importing its module first if it has one."""
    module = SINK_MODULES.get(fmt)
    if module is not None:
        importlib.import_module(module)
    return sink_class(fmt)


def available_formats() -> tuple[str, ...]:
    """Formats that can be built here: built-in ones whose module imports, plus registered ones."""
    names = set(registered_sinks())
    for fmt, module in SINK_MODULES.items():
        try:
            _load(fmt)
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
) -> Sink:
    """One sink writing every format in ``formats`` (a name or a list of names).

    Returns ``AsyncSink(FanoutSink([...]))`` (or the bare ``FanoutSink`` with
    ``threaded=False``); an empty list gives a :class:`NullSink`.  Unknown or unusable
    formats raise ``ValueError`` naming the formats that are available.  ``extra_sinks`` (already
    built, e.g. the alert sink) join the same fan-out behind the same writer thread.  Rows of
    ``drop_families`` reach none of them (``replicated_once``).
    """
    from trainmon.sinks.async_writer import AsyncSink, FanoutSink

    names = [formats] if isinstance(formats, str) else list(dict.fromkeys(formats))
    sinks = [_build(fmt, options) for fmt in names] + list(extra_sinks)
    if not sinks:
        return NullSink(options)
    fanout: Sink = FanoutSink(sinks, options)
    if drop_families:
        fanout = DropFamilies(fanout, drop_families)
    return AsyncSink(fanout, max_pending_steps=max_pending_steps) if threaded else fanout


def _build(fmt: str, options: SinkOptions) -> Sink:
    try:
        cls = _load(fmt)
    except KeyError:
        raise ValueError(
            f"unknown output format {fmt!r}; available: {', '.join(available_formats()) or 'none'}"
        ) from None
    except ImportError as exc:
        raise ValueError(f"output format {fmt!r} cannot be used here: {exc}") from exc
    return cls(options)
