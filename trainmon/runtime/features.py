"""Config values whose feature cannot run here: asking for one is a ConfigError, never silence."""

from __future__ import annotations

from trainmon.config import MonitorConfig
from trainmon.errors import Problem

__all__ = ["unsupported_problems", "FORMAT_NEEDS"]

# format -> (package its sink imports, pip extra that installs it): named in the error.
FORMAT_NEEDS: dict[str, tuple[str, str]] = {"parquet": ("pyarrow", "parquet"), "tensorboard": ("tensorboard", "")}


def unsupported_problems(config: MonitorConfig) -> list[Problem]:
    """Output formats whose sink cannot be imported in this environment."""
    from trainmon.sinks import available_formats

    available = available_formats()
    return [Problem("format", _missing(fmt, available)) for fmt in config.format if fmt not in available]


def _missing(fmt: str, available) -> str:
    text = f"{fmt!r} output is not available here (available: {', '.join(available)})"
    need = FORMAT_NEEDS.get(fmt)
    if need is not None:
        package, extra = need
        text += f"; it needs {package}: pip install {'trainmon[' + extra + ']' if extra else package}"
    return text
