"""The monitor config: frozen dataclasses and one strict loader.

Key names are msprobe's, so an existing msprobe ``monitor_config.json`` loads unchanged as long
as it only asks for things trainmon does.  Everything else is a problem, never a silent
fallback: the loader walks the whole file, collects every problem with its JSON key path
(``ops[1]``, ``alert.rules[0].args.threshold``) and raises one :class:`ConfigError`, so a user
fixes the file in one go.  Nothing here imports torch: the CLI and the config watcher use it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

from trainmon.config.reader import _Reader, _at, _did_you_mean, _join, _json_type, _pairs_hook, _show
from trainmon.errors import ConfigError, Problem
from trainmon.stats.table import DEFAULT_OPS, STAT_NAMES

__all__ = ["KNOWN_FORMATS", "KNOWN_RULES", "CommConfig", "AlertRule", "AlertConfig",
           "MonitorConfig", "load_config", "parse_config"]

KNOWN_FORMATS: tuple[str, ...] = ("csv", "tensorboard", "parquet")

# msprobe ops that are always written as columns, so asking for them changes nothing.
_ALWAYS_WRITTEN = ("shape", "dtype")

# msprobe options trainmon does not implement: a falsy value asks for nothing and is accepted.
_MSPROBE_ONLY = ("monitor_mbs_grad", "mg_direction", "stack_info", "append_output",
                 "recording_l2_features", "l2_targets", "sa_order")

_MAX_NDIGITS = 17  # an IEEE double needs at most 17 significant digits to round-trip


@dataclass(frozen=True)
class CommConfig:
    """``cc_distribution``: statistics of tensors passed to torch.distributed collectives."""

    enable: bool = False
    cc_codeline: tuple[str, ...] = ()
    cc_pre_hook: bool = False


@dataclass(frozen=True)
class AlertRule:
    """One anomaly rule; ``args`` is a plain dict of the rule's validated arguments."""

    rule_name: str
    # A dict cannot be hashed; leaving it out of the hash keeps configs usable as dict keys.
    args: Mapping[str, object] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class AlertConfig:
    rules: tuple[AlertRule, ...] = ()
    dump: bool = False


@dataclass(frozen=True)
class MonitorConfig:
    """A validated monitor config.  README.md ("Configuration file") lists every key."""

    targets: tuple[str, ...] = ()
    start_step: int = 0
    step_interval: int = 1
    collect_times: int | None = None
    format: tuple[str, ...] = ("csv",)
    ops: tuple[str, ...] = DEFAULT_OPS
    eps: float = 1e-8
    ndigits: int | None = None
    wg_distribution: bool = False
    mv_distribution: bool = False
    param_distribution: bool = False
    ur_distribution: bool = False
    xy_distribution: bool = False
    forward_only: bool = False
    backward_only: bool = False
    all_xy: bool = False
    print_struct: bool = False
    squash_name: bool = False
    global_layer_names: bool = False   # Megatron PP/VPP: name layers by their global layer_number
    module_ranks: tuple[int, ...] = ()
    step_count_per_record: int = 1
    replicated_once: bool = False      # replicated families written on data-parallel rank 0 only
    dynamic_on: bool = False
    cc_distribution: CommConfig = CommConfig()
    alert: AlertConfig = AlertConfig()
    source: str = field(default="", compare=False)

    def to_dict(self) -> dict[str, object]:
        """The config as JSON-ready data that ``parse_config`` turns back into an equal config."""
        data = dataclasses.asdict(self)
        del data["source"]
        return json.loads(json.dumps(data))  # tuples -> lists, deep copies of rule args


# ----------------------------------------------------------------------------- sections
# Each parser takes (reader, key path, value, default) and returns the parsed value.

def _int(minimum: int, maximum: int | None = None, nullable: bool = False) -> Callable:
    return lambda r, key, value, default: r.integer(key, value, default, minimum=minimum,
                                                    maximum=maximum, nullable=nullable)


def _target_key(name: str) -> str:
    return f"targets[{json.dumps(name)}]"  # names contain dots, so a dotted path would mislead


def _parse_targets(r: _Reader, key: str, value: object, default: tuple) -> tuple[str, ...]:
    expect = "non-empty module or parameter name"
    if isinstance(value, dict):
        r.dupes(_target_key, value)
        names = []
        for name, spec in value.items():
            if r.string(_target_key(name), name, expect) is None:
                continue
            if not isinstance(spec, dict):
                r.bad(_target_key(name), f"{_show(spec)} is not an object (use an empty object {{}})")
            elif spec:
                r.bad(_target_key(name), f"per-target specs are not supported ({_show(spec)}); "
                                         "use an empty object {}")
            names.append(name)
        return tuple(names)
    if not isinstance(value, list):
        r.bad(key, f"{_show(value)} is not a list or object (list of names, or {{\"name\": {{}}}})")
        return default
    seen: dict = {}
    return tuple(v for i, v in enumerate(value)
                 if r.string(_at(key, i), v, expect) is not None and r.distinct(key, value, seen, i))


def _names(r: _Reader, key: str, items: list, allowed: Sequence[str], what: str,
           drop: Sequence[str] = ()) -> list[str]:
    """The distinct known names in ``items`` in the user's order, minus ``drop``."""
    listed = ", ".join(allowed)
    seen: dict = {}
    out = []
    for i, name in enumerate(items):
        if not isinstance(name, str):
            r.bad(_at(key, i), f"{_show(name)} is not a string ({what} name: {listed})")
        elif name in drop:
            continue
        elif name not in allowed:
            r.bad(_at(key, i), f"unknown {what} {name!r} ({_did_you_mean(name, allowed)}allowed: {listed})")
        elif r.distinct(key, items, seen, i):
            out.append(name)
    return out


def _parse_ops(r: _Reader, key: str, value: object, default: tuple) -> tuple[str, ...]:
    items = r.array(key, value, f"non-empty list of: {', '.join(STAT_NAMES)}", nonempty=True)
    if items is None:
        return default
    ops = _names(r, key, items, STAT_NAMES, "stat", drop=_ALWAYS_WRITTEN)
    if all(op in _ALWAYS_WRITTEN for op in items):
        r.bad(key, f"{_show(items)} names no statistic ('shape' and 'dtype' are always written)")
    return tuple(ops) or default


def _parse_format(r: _Reader, key: str, value: object, default: tuple) -> tuple[str, ...]:
    listed = ", ".join(KNOWN_FORMATS)
    if isinstance(value, str):
        if value in KNOWN_FORMATS:
            return (value,)
        r.bad(key, f"unknown format {value!r} ({_did_you_mean(value, KNOWN_FORMATS)}allowed: {listed})")
        return default
    items = r.array(key, value, f"one of {listed}, or a non-empty list of them", nonempty=True)
    if items is None:
        return default
    return tuple(_names(r, key, items, KNOWN_FORMATS, "format")) or default


def _parse_module_ranks(r: _Reader, key: str, value: object, default: tuple) -> tuple[int, ...]:
    items = r.array(key, value, "list of distinct ranks, integers >= 0; [] = all ranks")
    if items is None:
        return default
    seen: dict = {}
    return tuple(v for i, v in enumerate(items)
                 if r.integer(_at(key, i), v, None, minimum=0) is not None
                 and r.distinct(key, items, seen, i))


def _parse_regexes(r: _Reader, key: str, value: object) -> tuple[str, ...]:
    items = r.array(key, value, "list of regular expressions")
    out = []
    for i, pattern in enumerate(items or ()):
        if r.string(_at(key, i), pattern, "regular expression") is None:
            continue
        try:
            re.compile(pattern)
        except re.error as exc:
            r.bad(_at(key, i), f"{pattern!r} is not a valid regular expression: {exc}")
            continue
        out.append(pattern)
    return tuple(out)


def _parse_comm(r: _Reader, key: str, value: object, default: CommConfig) -> CommConfig:
    obj = r.obj(key, value, ("enable", "cc_codeline", "cc_pre_hook"), accepted=("cc_log_only",))
    if obj is None:
        return default
    if r.boolean(_join(key, "cc_log_only"), obj.get("cc_log_only", False), False):
        # msprobe ends the job after logging the call sites; trainmon never does that.
        r.bad(_join(key, "cc_log_only"), "True is an msprobe option trainmon does not support "
                                         "(only false is accepted)")
    return CommConfig(
        enable=r.boolean(_join(key, "enable"), obj.get("enable", default.enable), default.enable),
        cc_codeline=_parse_regexes(r, _join(key, "cc_codeline"), obj.get("cc_codeline", [])),
        cc_pre_hook=r.boolean(_join(key, "cc_pre_hook"), obj.get("cc_pre_hook", False), False),
    )


# ----------------------------------------------------------------------------- alert rules

@dataclass(frozen=True)
class _Arg:
    parse: Callable[[_Reader, str, object], object]
    required: bool = False
    expect: str = ""


def _threshold(r: _Reader, key: str, value: object) -> object:
    return r.number(key, value, None, minimum=0, inclusive=True)


_THRESHOLD = "finite number >= 0"

_RULE_OPS = (*STAT_NAMES, "update_ratio")


def _factor(r: _Reader, key: str, value: object) -> object:
    return r.number(key, value, None, minimum=1, inclusive=False)


def _positive_int(r: _Reader, key: str, value: object) -> object:
    return r.integer(key, value, None, minimum=1, maximum=None, nullable=False)


def _rule_ops(r: _Reader, key: str, value: object) -> object:
    items = r.array(key, value, f"non-empty list of: {', '.join(_RULE_OPS)}", nonempty=True)
    return None if items is None else tuple(_names(r, key, items, _RULE_OPS, "stat"))


_NONFINITE_ARGS = {"threshold": _Arg(_threshold, expect=_THRESHOLD)}
# The spike rule (trainmon.diagnosis.rules): fires when a value leaves the median of its recent
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


def _parse_rule(r: _Reader, key: str, value: object) -> AlertRule | None:
    obj = r.obj(key, value, ("rule_name", "args"))
    if obj is None:
        return None
    names = tuple(KNOWN_RULES)
    name = obj.get("rule_name")
    if "rule_name" not in obj:
        r.bad(_join(key, "rule_name"), f"missing (one of {', '.join(names)})")
        return None
    if not isinstance(name, str) or name not in KNOWN_RULES:
        hint = _did_you_mean(name, names) if isinstance(name, str) else ""
        r.bad(_join(key, "rule_name"), f"unknown rule {_show(name)} ({hint}allowed: {', '.join(names)})")
        return None
    specs = KNOWN_RULES[name]
    args_key = _join(key, "args")
    args = r.obj(args_key, obj.get("args", {}), tuple(specs))
    if args is None:
        return None
    for arg, spec in specs.items():
        if spec.required and arg not in args:
            r.bad(_join(args_key, arg), f"missing ({name} needs a {spec.expect})")
    parsed = {arg: specs[arg].parse(r, _join(args_key, arg), v) for arg, v in args.items()}
    return AlertRule(rule_name=name, args=parsed)


def _parse_alert(r: _Reader, key: str, value: object, default: AlertConfig) -> AlertConfig:
    obj = r.obj(key, value, ("rules", "dump"))
    if obj is None:
        return default
    rules_key = _join(key, "rules")
    items = r.array(rules_key, obj.get("rules", []), "list of {\"rule_name\": ..., \"args\": {...}}")
    rules = [_parse_rule(r, _at(rules_key, i), item) for i, item in enumerate(items or ())]
    return AlertConfig(rules=tuple(rule for rule in rules if rule is not None),
                       dump=r.boolean(_join(key, "dump"), obj.get("dump", False), False))


# ----------------------------------------------------------------------------- top level

_BOOLS = ("wg_distribution", "mv_distribution", "param_distribution", "ur_distribution",
          "xy_distribution", "forward_only", "backward_only", "all_xy", "print_struct",
          "squash_name", "dynamic_on", "global_layer_names", "replicated_once")

_SECTIONS: dict[str, Callable] = {
    "targets": _parse_targets,
    "start_step": _int(0),
    "step_interval": _int(1),
    "collect_times": _int(1, nullable=True),
    "format": _parse_format,
    "ops": _parse_ops,
    "eps": lambda r, key, value, default: r.number(key, value, default, minimum=0, inclusive=False),
    "ndigits": _int(1, _MAX_NDIGITS, nullable=True),
    **{name: lambda r, key, value, default: r.boolean(key, value, default) for name in _BOOLS},
    "module_ranks": _parse_module_ranks,
    "step_count_per_record": _int(1),
    "cc_distribution": _parse_comm,
    "alert": _parse_alert,
}

_DEFAULTS = MonitorConfig()


def _check_combinations(r: _Reader, values: Mapping[str, object]) -> None:
    if values.get("forward_only") and values.get("backward_only"):
        r.bad("backward_only", "True together with forward_only: True records nothing "
                               "(set at most one of them)")
    if values.get("xy_distribution") and not values.get("targets") and not values.get("all_xy"):
        r.bad("xy_distribution", "True needs targets (the modules to record) or all_xy: True "
                                 "(every module)")


def parse_config(data: object, source: str) -> MonitorConfig:
    """Validate already-decoded JSON; raise one ConfigError listing every problem."""
    r = _Reader()
    if not isinstance(data, dict):
        r.bad("", f"the top level is {_json_type(data)}, expected an object ({{\"key\": value, ...}})")
        raise ConfigError(source, r.problems)
    r.dupes(str, data)
    values: dict[str, object] = {}
    for name, value in data.items():  # file order, so problems read top to bottom
        if name in _SECTIONS:
            values[name] = _SECTIONS[name](r, name, value, getattr(_DEFAULTS, name))
        elif name in _MSPROBE_ONLY:
            if value:  # a falsy value requests nothing, so an msprobe config carrying it loads
                r.bad(name, f"{_show(value)} is an msprobe option trainmon does not support "
                            "(remove it or set it to false)")
        else:
            r.unknown(str(name), str(name), tuple(_SECTIONS) + _MSPROBE_ONLY, tuple(_SECTIONS))
    _check_combinations(r, values)
    if r.problems:
        raise ConfigError(source, r.problems)
    return MonitorConfig(**values, source=source)


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
        return json.loads(text, object_pairs_hook=_pairs_hook)
    except json.JSONDecodeError as exc:
        raise fail(f"invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    except RecursionError:
        raise fail("invalid JSON: nested too deeply") from None


def load_config(path: str | os.PathLike) -> MonitorConfig:
    """Read, decode and validate a config file; every failure is one ConfigError naming it."""
    source = os.fspath(path)
    return parse_config(_read_json(Path(source)), source)
