"""Config values whose feature cannot run here: asking for one is a ConfigError, never silence."""
from __future__ import annotations

from trainmon.config import MonitorConfig
from trainmon.errors import Problem

__all__ = ["unsupported_problems"]


def unsupported_problems(config: MonitorConfig) -> list[Problem]:
    """Output formats whose sink cannot be imported in this environment."""
    from trainmon.sinks import available_formats

    available = available_formats()
    return [Problem("format", f"{fmt!r} output is not available here (available: {', '.join(available)})")
            for fmt in config.format if fmt not in available]
