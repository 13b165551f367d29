"""A sink's own config block, checked against the frozen dataclass the sink declares.

A sink says which keys its block takes with ``Sink.settings_schema``: a frozen dataclass whose
fields are the keys (annotations among bool, int, float, str, list[str], ``X | None`` and
``Literal[...]``; a field without a default is required).  :func:`parse_settings` checks a block
with the same strictness as the rest of the config (unknown keys with did-you-mean, wrong types
naming the key path, every problem at once).  No torch here: the loader and the CLI use it.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal, Union

from trainmon.config.reader import Reader, at, did_you_mean, join, show
from trainmon.errors import Problem

__all__ = ["parse_settings", "settings_keys"]

_NONE = type(None)


def settings_keys(schema: type) -> tuple[str, ...]:
    """The keys a block of ``schema`` may hold, in declaration order."""
    return tuple(f.name for f in dataclasses.fields(schema))


def parse_settings(schema: type, block: object, where: str) -> tuple[Any, list[Problem]]:
    """``(schema instance, [])`` for a valid ``block`` (``None`` or ``{}`` = every default), else
    ``(None, problems)`` naming each bad key as ``<where>.<key>``."""
    if not dataclasses.is_dataclass(schema):
        raise TypeError(f"settings_schema of {where!r} must be a dataclass, got {schema!r}")
    r = Reader()
    keys = settings_keys(schema)
    obj = r.obj(where, {} if block is None else block, keys)
    if obj is None:
        return None, r.problems
    hints = typing.get_type_hints(schema)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(schema):
        key = join(where, f.name)
        if f.name in obj:
            ok, value = _check(r, key, obj[f.name], hints[f.name])
            if ok:
                values[f.name] = value
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            r.bad(key, f"missing ({_expect(hints[f.name])})")
    if r.problems:
        return None, r.problems
    try:
        return schema(**values), []
    except (ValueError, TypeError) as exc:  # the schema's own checks (__post_init__): one problem
        return None, [_own_check_problem(where, str(exc))]


def _own_check_problem(where: str, message: str) -> Problem:
    """A schema's own error as a Problem: ``"wandb.families: unknown ..."`` keeps its key path."""
    key, sep, rest = message.partition(": ")
    if sep and (key == where or key.startswith((where + ".", where + "["))):
        return Problem(key, rest)
    return Problem(where, message)


def _check(r: Reader, key: str, value: object, hint: Any) -> tuple[bool, Any]:
    """(True, the value as the field holds it) or (False, None) with a problem recorded."""
    expect = _expect(hint)
    options = _options(hint)
    if value is None:
        if _NONE in options:
            return True, None
        r.bad(key, f"null is not allowed ({expect})")
        return False, None
    before = len(r.problems)
    for option in options:
        ok, parsed = _matches(r, key, value, option, expect)
        if ok:
            return True, parsed
        if len(r.problems) > before:
            return False, None  # a list with bad items: their problems say it all
    if isinstance(value, str) and any(typing.get_origin(o) is Literal for o in options):
        allowed = [a for o in options if typing.get_origin(o) is Literal for a in typing.get_args(o)]
        hint_text = did_you_mean(value, [str(a) for a in allowed])
        r.bad(key, f"unknown value {value!r} ({hint_text}allowed: {expect})")
    else:
        r.bad(key, f"{show(value)} is not {_article(expect)}")
    return False, None


def _matches(r: Reader, key: str, value: object, option: Any, expect: str) -> tuple[bool, Any]:
    origin = typing.get_origin(option)
    if option is bool:
        return isinstance(value, bool), value
    if option is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if option is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        return ok, float(value) if ok else None  # type: ignore[arg-type]
    if option is str:
        return isinstance(value, str), value
    if origin is Literal:
        return value in typing.get_args(option) and isinstance(value, (str, int, bool)), value
    if origin in (list, tuple) and isinstance(value, list):
        item_type = typing.get_args(option)[0] if typing.get_args(option) else str
        bad = [i for i, item in enumerate(value) if not _matches(r, at(key, i), item, item_type, expect)[0]]
        for i in bad:
            r.bad(at(key, i), f"{show(value[i])} is not {_article(_expect(item_type))} ({expect})")
        if bad:
            return False, None
        return True, (tuple(value) if origin is tuple else list(value))
    return False, None


def _options(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) in (Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


_NAMES = {bool: "boolean (true or false)", int: "integer", float: "finite number", str: "string"}


def _expect(hint: Any) -> str:
    parts = []
    for option in _options(hint):
        origin = typing.get_origin(option)
        if option is _NONE:
            parts.append("null")
        elif origin is Literal:
            parts.append(", ".join(repr(a) for a in typing.get_args(option)))
        elif origin in (list, tuple):
            args = typing.get_args(option)
            parts.append(f"list of {_NAMES.get(args[0], 'values') if args else 'values'}s")
        else:
            parts.append(_NAMES.get(option, getattr(option, "__name__", str(option))))
    return " or ".join(parts)


def _article(expect: str) -> str:
    """'a string or null', 'an integer', 'one of 'a', 'b''."""
    if expect.startswith("list"):
        return "a " + expect
    if expect.startswith("'"):
        return "one of " + expect
    return ("an " if expect[0] in "aeiou" else "a ") + expect
