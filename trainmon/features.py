"""Config keys whose features have not landed yet: enabling one is a ConfigError, never silence."""
from __future__ import annotations

from trainmon.config import MonitorConfig
from trainmon.errors import Problem

__all__ = ["unsupported_problems"]

# key -> (predicate "the config asks for it", what to say)
_PENDING = {
}


def unsupported_problems(config: MonitorConfig) -> list[Problem]:
    from trainmon.sinks import available_formats

    problems = [Problem(key, msg) for key, (asks, msg) in _PENDING.items() if asks(config)]
    for fmt in config.format:
        if fmt not in available_formats():
            problems.append(Problem("format", f"{fmt!r} output is not supported yet"))
    return problems
