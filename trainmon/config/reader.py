"""The config loader's reader: walks decoded JSON, records every problem with its key path.

Kept apart from ``config.loading`` (the section parsers) so each file has one job; the sinks'
settings blocks (``config.settings``) are read with it too.
"""

from __future__ import annotations

import difflib
import json
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from trainmon.errors import Problem

__all__ = ["JSONObject", "Reader", "at", "did_you_mean", "join", "json_type", "pairs_hook", "show"]


class JSONObject(dict):
    """A decoded JSON object that remembers keys the file repeated (json keeps the last)."""

    dupes: tuple[str, ...] = ()


def pairs_hook(pairs: list[tuple[str, object]]) -> JSONObject:
    obj = JSONObject(pairs)
    obj.dupes = tuple(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)
    return obj


def show(value: object) -> str:
    """A value in JSON spelling (true, null, [1, "a"], {"k": false}), cut to 60 characters; a
    top-level string is quoted 'like this', as the names in every message are."""
    try:
        text = repr(value) if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def at(prefix: str, index: int) -> str:
    return f"{prefix}[{index}]"


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1)
    return f"did you mean {close[0]!r}? " if close else ""


def json_type(value: object) -> str:
    names = {list: "a list", str: "a string", int: "a number", float: "a number", bool: "a boolean"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


class Reader:
    """Checks values and records problems; on a bad value it returns the default and goes on."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []
        # config fields a section parser derives besides its own value (targets -> target_specs)
        self.derived: dict[str, Any] = {}

    def bad(self, key: str, message: str) -> None:
        self.problems.append(Problem(key, message))

    def integer(
        self,
        key: str,
        value: object,
        default: int | None,
        *,
        minimum: int,
        maximum: int | None = None,
        nullable: bool = False,
    ) -> int | None:
        expect = f"integer {minimum}..{maximum}" if maximum is not None else f"integer >= {minimum}"
        expect += " or null" if nullable else ""
        if value is None and nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            self.bad(key, f"{show(value)} is not an integer ({expect})")
        elif value < minimum or (maximum is not None and value > maximum):
            self.bad(key, f"{value} is out of range ({expect})")
        else:
            return value
        return default

    def number(
        self, key: str, value: object, default: float | None, *, minimum: float, inclusive: bool
    ) -> float | None:
        expect = f"finite number {'>=' if inclusive else '>'} {minimum:g}"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.bad(key, f"{show(value)} is not a number ({expect})")
        elif not math.isfinite(value) or value < minimum or (value == minimum and not inclusive):
            self.bad(key, f"{show(value)} is out of range ({expect})")
        else:
            return float(value)
        return default

    def boolean(self, key: str, value: object, default: bool) -> bool:
        if isinstance(value, bool):
            return value
        self.bad(key, f"{show(value)} is not a boolean (true or false)")
        return default

    def string(self, key: str, value: object, expect: str) -> str | None:
        if isinstance(value, str) and value.strip():
            return value
        what = "is empty" if isinstance(value, str) else "is not a string"
        self.bad(key, f"{show(value)} {what} ({expect})")
        return None

    def array(self, key: str, value: object, expect: str, nonempty: bool = False) -> list | None:
        if not isinstance(value, list):
            self.bad(key, f"{show(value)} is not a list ({expect})")
        elif nonempty and not value:
            self.bad(key, f"[] is empty ({expect})")
        else:
            return value
        return None

    def dupes(self, key_of: Callable[[str], str], obj: Mapping) -> None:
        for name in getattr(obj, "dupes", ()):
            self.bad(key_of(name), "duplicate key (JSON would silently keep only the last value)")

    def obj(self, key: str, value: object, known: Sequence[str], accepted: Sequence[str] = ()) -> dict | None:
        """``value`` if it is an object whose keys are all in ``known`` + ``accepted``."""
        if not isinstance(value, dict):
            self.bad(key, f"{show(value)} is not an object (keys: {', '.join(known)})")
            return None
        self.dupes(lambda name: join(key, name), value)
        choices = tuple(known) + tuple(accepted)
        for name in value:
            if name not in choices:
                self.unknown(join(key, str(name)), str(name), choices, known)
        return {k: v for k, v in value.items() if k in choices}

    def unknown(self, key: str, name: str, choices: Sequence[str], known: Sequence[str]) -> None:
        hint = did_you_mean(name, choices) or f"allowed: {', '.join(known)}"
        self.bad(key, f"unknown key ({hint.rstrip()})")

    def distinct(self, key: str, items: list, seen: dict, index: int) -> bool:
        """False (and a problem) when ``items[index]`` already appeared."""
        value = items[index]
        if value in seen:
            self.bad(at(key, index), f"duplicate {show(value)} (already at {at(key, seen[value])})")
            return False
        seen[value] = index
        return True
