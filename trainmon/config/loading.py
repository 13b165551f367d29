"""The one strict loader: a config file (or decoded JSON) in, a ``MonitorConfig`` or one
``ConfigError`` listing every problem out.

The loader walks the whole file, collects every problem with its JSON key path (``ops[1]``,
``alert.rules[0].args.threshold``) with a did-you-mean for misspelled names, and raises one
:class:`ConfigError`, so a user fixes the file in one go.  Each key's parser is in
``_PARSERS``; the boolean keys need none (``schema.BOOLEAN_KEYS``).  Nothing here imports torch:
the CLI and the config watcher use it.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainmon.config.reader import Reader, at, did_you_mean, join, json_type, pairs_hook, show
from trainmon.config.schema import (
    BOOLEAN_KEYS,
    ESCALATION_KEYS,
    GRAD_LEVELS,
    KNOWN_FORMATS,
    SPEC_EXPECT,
    SPEC_KEYS,
    SPEC_VALUE,
    TOP_KEYS,
    AlertConfig,
    AlertRule,
    AnomalyConfig,
    CommConfig,
    GradProbeConfig,
    MonitorConfig,
    io_select,
)
from trainmon.errors import ConfigError, Problem
from trainmon.stats.table import STAT_NAMES

__all__ = ["KNOWN_RULES", "load_config", "parse_config"]

_FORMAT_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*$")
_FORMAT_EXPECT = "a sink name such as " + ", ".join(KNOWN_FORMATS)

# msprobe ops that are always written as columns, so asking for them changes nothing.
_ALWAYS_WRITTEN = ("shape", "dtype")

# msprobe options trainmon does not implement: a falsy value asks for nothing and is accepted.
_MSPROBE_ONLY = ("mg_direction", "append_output")

_MAX_NDIGITS = 17  # an IEEE double needs at most 17 significant digits to round-trip
_MAX_BOUNDS = 64  # one CSV column per interval: more than this is a histogram, not a probe


# ----------------------------------------------------------------------------- sections
# Each parser takes (reader, key path, value, default) and returns the parsed value.


def _int(minimum: int, maximum: int | None = None, nullable: bool = False) -> Callable:
    return lambda r, key, value, default: r.integer(
        key, value, default, minimum=minimum, maximum=maximum, nullable=nullable
    )


def _target_key(name: str) -> str:
    return f"targets[{json.dumps(name)}]"  # names contain dots, so a dotted path would mislead


def _parse_spec(r: Reader, key: str, spec: dict) -> tuple[tuple[str, str], ...]:
    out = []
    for name, value in spec.items():
        where = join(key, str(name))
        if name not in SPEC_KEYS:
            r.unknown(where, str(name), SPEC_KEYS, SPEC_KEYS)
        elif not isinstance(value, str) or not SPEC_VALUE.match(value):
            r.bad(where, f"{show(value)} is not a spec ({SPEC_EXPECT})")
        else:
            sel = io_select(value)
            if sel.count < 1 or (sel.index is not None and sel.index >= sel.count):
                r.bad(where, f"{show(value)} is out of range ({SPEC_EXPECT})")
            else:
                out.append((name, value))
    return tuple(out)


def _parse_targets(r: Reader, key: str, value: object, default: tuple) -> tuple[str, ...]:
    expect = "non-empty module or parameter name"
    if isinstance(value, dict):
        r.dupes(_target_key, value)
        names, specs = [], []
        for name, spec in value.items():
            if r.string(_target_key(name), name, expect) is None:
                continue
            if not isinstance(spec, dict):
                r.bad(
                    _target_key(name),
                    f"{show(spec)} is not an object ({{}} or a spec such as "
                    '{"input": "tuple[2]:0", "output": "tensor"})',
                )
            elif spec:
                parsed = _parse_spec(r, _target_key(name), spec)
                if parsed:
                    specs.append((name, parsed))
            names.append(name)
        r.derived["target_specs"] = tuple(specs)
        return tuple(names)
    if not isinstance(value, list):
        r.bad(key, f'{show(value)} is not a list or object (list of names, or {{"name": {{}}}})')
        return default
    seen: dict = {}
    return tuple(
        v
        for i, v in enumerate(value)
        if r.string(at(key, i), v, expect) is not None and r.distinct(key, value, seen, i)
    )


def _names(r: Reader, key: str, items: list, allowed: Sequence[str], what: str, drop: Sequence[str] = ()) -> list[str]:
    """The distinct known names in ``items`` in the user's order, minus ``drop``."""
    listed = ", ".join(allowed)
    seen: dict = {}
    out = []
    for i, name in enumerate(items):
        if not isinstance(name, str):
            r.bad(at(key, i), f"{show(name)} is not a string ({what} name: {listed})")
        elif name in drop:
            continue
        elif name not in allowed:
            r.bad(at(key, i), f"unknown {what} {name!r} ({did_you_mean(name, allowed)}allowed: {listed})")
        elif r.distinct(key, items, seen, i):
            out.append(name)
    return out


def _parse_ops(r: Reader, key: str, value: object, default: tuple) -> tuple[str, ...]:
    items = r.array(key, value, f"non-empty list of: {', '.join(STAT_NAMES)}", nonempty=True)
    if items is None:
        return default
    ops = _names(r, key, items, STAT_NAMES, "stat", drop=_ALWAYS_WRITTEN)
    if all(op in _ALWAYS_WRITTEN for op in items):
        r.bad(key, f"{show(items)} names no statistic ('shape' and 'dtype' are always written)")
    return tuple(ops) or default


def _parse_format(r: Reader, key: str, value: object, default: tuple) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,) if _format_name(r, key, value) else default
    items = r.array(key, value, f"{_FORMAT_EXPECT}, or a non-empty list of sink names", nonempty=True)
    if items is None:
        return default
    seen: dict = {}
    return (
        tuple(v for i, v in enumerate(items) if _format_name(r, at(key, i), v) and r.distinct(key, items, seen, i))
        or default
    )


def _format_name(r: Reader, key: str, name: object) -> bool:
    """A well-spelled sink name; whether that sink exists is checked when the monitor attaches."""
    if not isinstance(name, str) or not _FORMAT_NAME.match(name):
        what = "is not a sink name" if isinstance(name, str) else "is not a string"
        r.bad(key, f"{show(name)} {what} (letters, digits, '_', '-', '.'; {_FORMAT_EXPECT})")
        return False
    if name in _SECTIONS:  # its settings block would be that config key
        r.bad(key, f"{name!r} is a config key, not a sink name ({_FORMAT_EXPECT})")
        return False
    return True


def _parse_module_ranks(r: Reader, key: str, value: object, default: tuple) -> tuple[int, ...]:
    items = r.array(key, value, "list of distinct ranks, integers >= 0; [] = all ranks")
    if items is None:
        return default
    seen: dict = {}
    return tuple(
        v
        for i, v in enumerate(items)
        if r.integer(at(key, i), v, None, minimum=0) is not None and r.distinct(key, items, seen, i)
    )


def _parse_regexes(r: Reader, key: str, value: object) -> tuple[str, ...]:
    items = r.array(key, value, "list of regular expressions")
    out = []
    for i, pattern in enumerate(items or ()):
        if r.string(at(key, i), pattern, "regular expression") is None:
            continue
        try:
            re.compile(pattern)
        except re.error as exc:
            r.bad(at(key, i), f"{pattern!r} is not a valid regular expression: {exc}")
            continue
        out.append(pattern)
    return tuple(out)


def _parse_comm(r: Reader, key: str, value: object, default: CommConfig) -> CommConfig:
    obj = r.obj(key, value, ("enable", "cc_codeline", "cc_pre_hook"), accepted=("cc_log_only",))
    if obj is None:
        return default
    if r.boolean(join(key, "cc_log_only"), obj.get("cc_log_only", False), False):
        # msprobe ends the job after logging the call sites; trainmon never does that.
        r.bad(join(key, "cc_log_only"), "true is an msprobe option trainmon does not support (only false is accepted)")
    return CommConfig(
        enable=r.boolean(join(key, "enable"), obj.get("enable", default.enable), default.enable),
        cc_codeline=_parse_regexes(r, join(key, "cc_codeline"), obj.get("cc_codeline", [])),
        cc_pre_hook=r.boolean(join(key, "cc_pre_hook"), obj.get("cc_pre_hook", False), False),
    )


def _js(value: object) -> str:
    """A value as the JSON file spells it (true, null, "L1"), for messages."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        return show(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _parse_bounds(r: Reader, key: str, value: object, default: tuple) -> tuple[float, ...]:
    expect = f"non-empty list of at most {_MAX_BOUNDS} finite numbers in increasing order"
    items = r.array(key, value, expect, nonempty=True)
    if items is None:
        return default
    if len(items) > _MAX_BOUNDS:
        r.bad(key, f"{len(items)} cut points are too many ({expect})")
        return default
    out: list[float] = []
    for i, v in enumerate(items):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            r.bad(at(key, i), f"{_js(v)} is not a finite number ({expect})")
            continue
        got = float(v)
        if out and got <= out[-1]:
            r.bad(at(key, i), f"{_js(v)} is not greater than the cut point before it ({expect})")
            continue
        out.append(got)
    return tuple(out) if len(out) == len(items) else default


def _parse_grad_probe(r: Reader, key: str, value: object, default: GradProbeConfig | None) -> GradProbeConfig | None:
    if value is None:
        return None
    obj = r.obj(key, value, ("grad_level", "param_list", "bounds"))
    if obj is None:
        return default
    base = GradProbeConfig()
    level = obj.get("grad_level", base.grad_level)
    if level not in GRAD_LEVELS:
        hint = ""
        if isinstance(level, str):
            hint = (
                f"did you mean {level.upper()!r}? "
                if level.upper() in GRAD_LEVELS
                else did_you_mean(level, GRAD_LEVELS)
            )
        r.bad(join(key, "grad_level"), f"{_js(level)} is not a grad level ({hint}allowed: {', '.join(GRAD_LEVELS)})")
        level = base.grad_level
    names_key = join(key, "param_list")
    items = r.array(names_key, obj.get("param_list", []), "list of parameter or module names; [] = all") or []
    seen: dict = {}
    names = tuple(
        v
        for i, v in enumerate(items)
        if r.string(at(names_key, i), v, "non-empty parameter or module name") is not None
        and r.distinct(names_key, items, seen, i)
    )
    bounds = _parse_bounds(r, join(key, "bounds"), obj.get("bounds", list(base.bounds)), base.bounds)
    return GradProbeConfig(grad_level=level, param_list=names, bounds=bounds)


def _parse_l2_targets(r: Reader, key: str, value: object, default: tuple) -> tuple:
    if not isinstance(value, dict):
        r.bad(key, f'{show(value)} is not an object ({{"attention_hook": [names], ...}})')
        return default
    out = []
    for hook, names in value.items():
        items = r.array(join(key, str(hook)), names, "list of module names")
        if items is not None:
            out.append(
                (
                    str(hook),
                    tuple(
                        n
                        for i, n in enumerate(items)
                        if r.string(at(join(key, str(hook)), i), n, "module name") is not None
                    ),
                )
            )
    return tuple(out)


def _parse_sa_order(r: Reader, key: str, value: object, default: str) -> str:
    if not isinstance(value, str) or (value and sorted(value.replace(" ", "").split(",")) != ["b", "d", "h", "s"]):
        r.bad(key, f'{show(value)} is not an order of b,s,h,d (e.g. "b,s,h,d" or "s,b,h,d")')
        return default
    return value


# ----------------------------------------------------------------------------- alert rules


@dataclass(frozen=True)
class _Arg:
    parse: Callable[[Reader, str, object], object]
    required: bool = False
    expect: str = ""


def _threshold(r: Reader, key: str, value: object) -> object:
    return r.number(key, value, None, minimum=0, inclusive=True)


_THRESHOLD = "finite number >= 0"

_RULE_OPS = (*STAT_NAMES, "update_ratio")


def _factor(r: Reader, key: str, value: object) -> object:
    return r.number(key, value, None, minimum=1, inclusive=False)


def _positive_int(r: Reader, key: str, value: object) -> object:
    return r.integer(key, value, None, minimum=1, maximum=None, nullable=False)


def _rule_ops(r: Reader, key: str, value: object) -> object:
    items = r.array(key, value, f"non-empty list of: {', '.join(_RULE_OPS)}", nonempty=True)
    return None if items is None else tuple(_names(r, key, items, _RULE_OPS, "stat"))


_NONFINITE_ARGS = {"threshold": _Arg(_threshold, expect=_THRESHOLD)}
# The spike rule (trainmon.analysis.rules): fires when a value leaves the median of its recent
# history by ``factor`` either way; msprobe's relative ``threshold`` t means factor 1 + t.
_SPIKE_ARGS = {
    "threshold": _Arg(_threshold, expect=_THRESHOLD),
    "factor": _Arg(_factor, expect="number > 1"),
    "floor": _Arg(_threshold, expect=_THRESHOLD),
    "warmup": _Arg(_positive_int, expect="integer >= 1"),
    "window": _Arg(_positive_int, expect="integer >= 1"),
    "ops": _Arg(_rule_ops, expect="list of stat names"),
}

# rule name -> its arguments.  A new rule is one entry here (and its implementation elsewhere).
KNOWN_RULES: dict[str, dict[str, _Arg]] = {
    "AnomalyNan": _NONFINITE_ARGS,
    "nonfinite": _NONFINITE_ARGS,
    "AnomalyTurbulence": _SPIKE_ARGS,
    "spike": _SPIKE_ARGS,
}


def _parse_rule(r: Reader, key: str, value: object) -> AlertRule | None:
    obj = r.obj(key, value, ("rule_name", "args"))
    if obj is None:
        return None
    names = tuple(KNOWN_RULES)
    name = obj.get("rule_name")
    if "rule_name" not in obj:
        r.bad(join(key, "rule_name"), f"missing (one of {', '.join(names)})")
        return None
    if not isinstance(name, str) or name not in KNOWN_RULES:
        hint = did_you_mean(name, names) if isinstance(name, str) else ""
        r.bad(join(key, "rule_name"), f"unknown rule {show(name)} ({hint}allowed: {', '.join(names)})")
        return None
    specs = KNOWN_RULES[name]
    args_key = join(key, "args")
    args = r.obj(args_key, obj.get("args", {}), tuple(specs))
    if args is None:
        return None
    for arg, spec in specs.items():
        if spec.required and arg not in args:
            r.bad(join(args_key, arg), f"missing ({name} needs a {spec.expect})")
    parsed = {arg: specs[arg].parse(r, join(args_key, arg), v) for arg, v in args.items()}
    return AlertRule(rule_name=name, args=parsed)


def _parse_alert(r: Reader, key: str, value: object, default: AlertConfig) -> AlertConfig:
    obj = r.obj(key, value, ("rules", "dump"))
    if obj is None:
        return default
    rules_key = join(key, "rules")
    items = r.array(rules_key, obj.get("rules", []), 'list of {"rule_name": ..., "args": {...}}')
    rules = [_parse_rule(r, at(rules_key, i), item) for i, item in enumerate(items or ())]
    return AlertConfig(
        rules=tuple(rule for rule in rules if rule is not None),
        dump=r.boolean(join(key, "dump"), obj.get("dump", False), False),
    )


# ----------------------------------------------------------------------------- on_anomaly

_ANOMALY_KEYS = ("config", "steps", "max_times", "history_steps")


def _parse_on_anomaly(r: Reader, key: str, value: object, default: AnomalyConfig | None) -> AnomalyConfig | None:
    if value is None:
        return None
    obj = r.obj(key, value, _ANOMALY_KEYS)
    if obj is None:
        return default
    for name in ("config", "steps"):
        if name not in obj:
            r.bad(
                join(key, name),
                "missing ("
                + (
                    'the partial config to record, e.g. {"xy_distribution": true, "all_xy": true}'
                    if name == "config"
                    else "how many steps to record it for, integer >= 1"
                )
                + ")",
            )
    steps = r.integer(join(key, "steps"), obj.get("steps", 1), 1, minimum=1)
    times = r.integer(join(key, "max_times"), obj.get("max_times", 1), 1, minimum=1)
    history = r.integer(join(key, "history_steps"), obj.get("history_steps", 0), 0, minimum=0)
    partial = _parse_partial(r, join(key, "config"), obj.get("config", {}))
    return AnomalyConfig(config=partial, steps=steps or 1, max_times=times or 1, history_steps=history or 0)


def _parse_partial(r: Reader, key: str, value: object) -> dict[str, object]:
    """The partial config's keys, each parsed by its top-level parser (same checks, same messages)."""
    if not isinstance(value, dict):
        r.bad(key, f"{show(value)} is not an object (a partial config with keys among: {', '.join(ESCALATION_KEYS)})")
        return {}
    r.dupes(lambda name: join(key, name), value)
    out: dict[str, object] = {}
    for name, item in value.items():
        path = key + "." + str(name)
        if name in ESCALATION_KEYS:
            out[name] = _SECTIONS[name](r, path, item, getattr(_DEFAULTS, name))
        elif name in _SECTIONS:
            r.bad(
                path,
                "cannot be changed by an escalation (its window sets the schedule; outputs, ranks and "
                f"alert rules stay the base config's); allowed: {', '.join(ESCALATION_KEYS)}",
            )
        else:
            r.unknown(path, str(name), ESCALATION_KEYS, ESCALATION_KEYS)
    return out


def _check_on_anomaly(r: Reader, values: Mapping[str, object]) -> None:
    spec = values.get("on_anomaly")
    if not isinstance(spec, AnomalyConfig):
        return
    alert = values.get("alert")
    if not isinstance(alert, AlertConfig) or not alert.rules:
        r.bad(
            "on_anomaly",
            "needs alert.rules: an escalation starts when a run-time alert fires "
            '(e.g. "alert": {"rules": [{"rule_name": "AnomalyNan"}]})',
        )
    merged = Reader()
    _check_combinations(merged, {**values, **spec.config})
    for p in merged.problems:  # a combination only the merge makes: name the partial config
        if p not in r.problems:
            r.bad("on_anomaly.config." + p.key, p.message + " (in the base config merged with on_anomaly.config)")


# ----------------------------------------------------------------------------- top level


def _boolean(r: Reader, key: str, value: object, default: bool) -> bool:
    return r.boolean(key, value, default)


# The parser of each key that is not a boolean.
_PARSERS: dict[str, Callable] = {
    "targets": _parse_targets,
    "start_step": _int(0),
    "step_interval": _int(1),
    "collect_times": _int(1, nullable=True),
    "format": _parse_format,
    "ops": _parse_ops,
    "eps": lambda r, key, value, default: r.number(key, value, default, minimum=0, inclusive=False),
    "ndigits": _int(1, _MAX_NDIGITS, nullable=True),
    "module_ranks": _parse_module_ranks,
    "step_count_per_record": _int(1),
    "l2_targets": _parse_l2_targets,
    "sa_order": _parse_sa_order,
    "cc_distribution": _parse_comm,
    "alert": _parse_alert,
    "grad_probe": _parse_grad_probe,
    "on_anomaly": _parse_on_anomaly,
}
if set(_PARSERS) | set(BOOLEAN_KEYS) != set(TOP_KEYS):  # a key added to the schema needs its parser here
    raise RuntimeError(f"config keys without a parser: {sorted(set(TOP_KEYS) - set(_PARSERS) - set(BOOLEAN_KEYS))}")

# Every top-level key, in the schema's order (the order "allowed: ..." lists them in).
_SECTIONS: dict[str, Callable] = {name: _PARSERS.get(name, _boolean) for name in TOP_KEYS}

_DEFAULTS = MonitorConfig()


def _check_combinations(r: Reader, values: Mapping[str, object]) -> None:
    if values.get("forward_only") and values.get("backward_only"):
        r.bad("backward_only", "true together with forward_only: true records nothing (set at most one of them)")
    if values.get("xy_distribution") and not values.get("targets") and not values.get("all_xy"):
        r.bad("xy_distribution", "true needs targets (the modules to record) or all_xy: true (every module)")


def parse_config(data: object, source: str) -> MonitorConfig:
    """Validate already-decoded JSON; raise one ConfigError listing every problem."""
    r = Reader()
    if not isinstance(data, dict):
        r.bad("", f'the top level is {json_type(data)}, expected an object ({{"key": value, ...}})')
        raise ConfigError(source, r.problems)
    r.dupes(str, data)
    values: dict[str, Any] = {}
    formats = _listed_formats(data.get("format"))
    blocks: list[tuple[str, Mapping[str, Any]]] = []
    for name, value in data.items():  # file order, so problems read top to bottom
        if name in _SECTIONS:
            values[name] = _SECTIONS[name](r, name, value, getattr(_DEFAULTS, name))
        elif name in _MSPROBE_ONLY:
            if value:  # a falsy value requests nothing, so an msprobe config carrying it loads
                r.bad(
                    name,
                    f"{show(value)} is an msprobe option trainmon does not support (remove it or set it to false)",
                )
        elif name in formats:
            if isinstance(value, dict):
                blocks.append((name, value))
            else:
                r.bad(name, f"{show(value)} is not an object (the settings of the {name!r} sink)")
        elif name in KNOWN_FORMATS:
            r.bad(
                name,
                f"settings for the {name!r} sink, which format does not list "
                f"(add {name!r} to format, or remove this block)",
            )
        else:
            r.unknown(str(name), str(name), tuple(_SECTIONS) + _MSPROBE_ONLY + formats, tuple(_SECTIONS))
    _check_combinations(r, values)
    _check_on_anomaly(r, values)
    if r.problems:
        raise ConfigError(source, r.problems)
    return MonitorConfig(**values, **r.derived, sink_settings=tuple(blocks), source=source)


def _listed_formats(value: object) -> tuple[str, ...]:
    """The names ``format`` lists, as written (the section parser checks them)."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, str) and v not in _SECTIONS)
    return ()


# ----------------------------------------------------------------------------- the file


def _read_json(path: Path) -> object:
    """The decoded file, or a ConfigError naming the path and what is wrong with it."""

    def fail(message: str) -> ConfigError:
        return ConfigError(str(path), [Problem("", message)])

    if path.is_dir():
        raise fail("is a directory, expected a JSON file")
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise fail("file not found") from None
    except OSError as exc:
        raise fail(f"cannot read the file: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8-sig")  # editors on Windows like to start with a byte-order mark
    except UnicodeDecodeError as exc:
        raise fail(f"not valid UTF-8 (byte {raw[exc.start]:#04x} at offset {exc.start})") from None
    if not text.strip():
        raise fail("the file is empty (expected a JSON object)")
    try:
        return json.loads(text, object_pairs_hook=pairs_hook)
    except json.JSONDecodeError as exc:
        raise fail(f"invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    except RecursionError:
        raise fail("invalid JSON: nested too deeply") from None


def load_config(path: str | os.PathLike) -> MonitorConfig:
    """Read, decode and validate a config file; every failure is one ConfigError naming it."""
    source = os.fspath(path)
    return parse_config(_read_json(Path(source)), source)
