"""Config values whose feature cannot run here: asking for one is a ConfigError, never silence.

The loader accepts any well-formed ``format`` name (it has no torch and no sink registry); here,
when the monitor attaches, each name is checked against the sinks that exist (registered,
built-in, or advertised by an installed package's ``trainmon.sinks`` entry point), its sink is
imported, and its config block is checked against the sink's ``settings_schema``.
"""

from __future__ import annotations

from typing import Any

from trainmon.config import MonitorConfig
from trainmon.config.reader import did_you_mean
from trainmon.config.settings import parse_settings
from trainmon.errors import ConfigError, Problem

__all__ = ["unsupported_problems", "sink_settings", "FORMAT_NEEDS"]

# format -> (package its sink imports, pip extra that installs it): named in the error.
FORMAT_NEEDS: dict[str, tuple[str, str]] = {
    "parquet": ("pyarrow", "parquet"),
    "tensorboard": ("tensorboard", ""),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}


def unsupported_problems(config: MonitorConfig) -> list[Problem]:
    """Unknown formats, formats whose sink cannot be imported here, and bad sink config blocks."""
    return _resolve(config)[1]


def sink_settings(config: MonitorConfig) -> dict[str, Any]:
    """format -> its sink's parsed config block (None for a sink without ``settings_schema``);
    ``ConfigError`` when :func:`unsupported_problems` has any."""
    settings, problems = _resolve(config)
    if problems:
        raise ConfigError(config.source or "config", problems)
    return settings


def _resolve(config: MonitorConfig) -> tuple[dict[str, Any], list[Problem]]:
    blocks = dict(config.sink_settings)
    settings: dict[str, Any] = {}
    problems: list[Problem] = []
    for i, fmt in enumerate(config.format):
        cls, problem = _sink_class(fmt, i)
        if problem is not None:
            problems.append(problem)
            continue
        schema = cls.settings_schema
        if schema is None:
            if fmt in blocks:
                problems.append(Problem(fmt, f"the {fmt!r} sink takes no settings (remove this block)"))
            settings[fmt] = None
            continue
        instance, found = parse_settings(schema, blocks.get(fmt), fmt)
        problems += found
        settings[fmt] = instance
    return settings, problems


def _unknown(fmt: str, known: tuple[str, ...]) -> str:
    return f"unknown format {fmt!r} ({did_you_mean(fmt, known)}allowed: {', '.join(known)})"


def _sink_class(fmt: str, index: int) -> tuple[Any, Problem | None]:
    """The sink class of ``fmt`` (imported now), or the problem of ``format[index]``.  The installed
    packages' entry points are scanned (milliseconds) only for a name that is not registered or built in."""
    from trainmon.sinks import SINK_MODULES, SinkLoadError, available_formats, known_formats, load_sink_class

    key = f"format[{index}]"
    try:
        return load_sink_class(fmt), None
    except ImportError as exc:
        return None, Problem(key, _missing(fmt, available_formats(), exc))
    except SinkLoadError as exc:
        return None, Problem(key, f"the {fmt!r} sink cannot be loaded: {exc}")
    except KeyError:
        if fmt in SINK_MODULES:
            return None, Problem(key, f"{SINK_MODULES[fmt]} registered no sink named {fmt!r}")
        return None, Problem(key, _unknown(fmt, known_formats()))


def _missing(fmt: str, available: tuple[str, ...], exc: ImportError) -> str:
    text = f"{fmt!r} output is not available here (available: {', '.join(available)})"
    need = FORMAT_NEEDS.get(fmt)
    if need is not None:
        package, extra = need
        text += f"; it needs {package}: pip install {'trainmon[' + extra + ']' if extra else package}"
    else:
        text += f"; importing it failed: {exc}"
    return text
