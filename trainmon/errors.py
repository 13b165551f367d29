"""Exception types raised by trainmon."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TrainmonError", "ConfigError", "Problem", "DamagedFileError", "EnvError", "env_int"]


class TrainmonError(Exception):
    """Base class of every error trainmon raises on purpose."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config: where (JSON key path) and what."""

    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.key}: {self.message}" if self.key else self.message


class ConfigError(TrainmonError, ValueError):
    """A config file (or the targets it names) is invalid.

    Carries every problem found, not just the first, so a user fixes the file in one go.
    """

    def __init__(self, path: str, problems: list[Problem] | list[str]):
        self.path = str(path)
        self.problems = [p if isinstance(p, Problem) else Problem("", str(p)) for p in problems]
        super().__init__(self._render())

    def _render(self) -> str:
        n = len(self.problems)
        head = f"{n} problem{'s' if n != 1 else ''} in {self.path}"
        return head + "".join(f"\n  {p}" for p in self.problems)


class DamagedFileError(TrainmonError, ValueError):
    """A recorded file (CSV, or any other format a reader supports) is not what trainmon writes:
    one line naming the file, where (``line``/``column``, or ``row`` for a columnar format) and
    what is wrong.  Commands print it as one line and exit with code 2."""

    def __init__(
        self, path: object, message: str, line: int | None = None, column: int | str | None = None, unit: str = "line"
    ):
        self.path, self.message, self.line, self.column, self.unit = str(path), message, line, column, unit
        where = "".join(
            [f", {unit} {line}" if line is not None else "", f", column {column}" if column is not None else ""]
        )
        super().__init__(f"{self.path}{where}: {message}")


class EnvError(TrainmonError, ValueError):
    """An environment variable trainmon reads holds a value it cannot use: one line naming the
    variable, its value and what is allowed (commands print it and exit with code 2)."""

    def __init__(self, name: str, value: str, allowed: str):
        self.name, self.value, self.allowed = name, value, allowed
        super().__init__(f"environment variable {name}={value!r}: {allowed}")


def env_int(name: str, default: int, minimum: int = 1) -> int:
    """The integer ``os.environ[name]`` holds (``default`` when unset or empty), checked: an
    :class:`EnvError` for anything but an integer >= ``minimum``.  Read when used, never at import
    time, so a bad value is one line of the command that reads it, not a traceback."""
    import os

    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise EnvError(name, text, f"must be an integer >= {minimum} (default {default})") from None
    if value < minimum:
        raise EnvError(name, text, f"must be an integer >= {minimum} (default {default})")
    return value
