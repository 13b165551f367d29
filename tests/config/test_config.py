"""The strict config loader: defaults, valid files, and the exact text of every problem."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainmon.config import (
    ESCALATION_KEYS,
    KNOWN_FORMATS,
    AlertConfig,
    AlertRule,
    AnomalyConfig,
    CommConfig,
    GradProbeConfig,
    MonitorConfig,
    load_config,
    parse_config,
)
from trainmon.errors import ConfigError, Problem

REPO = Path(__file__).resolve().parents[2]
STATS = "norm, mean, min, max, zeros, nans, infs, std"
# The order of docs/configuration.md's table (and of the schema's fields)
TOP_KEYS = ("targets, start_step, step_interval, collect_times, format, ops, eps, ndigits, "
            "wg_distribution, mv_distribution, param_distribution, ur_distribution, xy_distribution, "
            "forward_only, backward_only, all_xy, print_struct, squash_name, module_ranks, step_count_per_record, "
            "global_layer_names, replicated_once, dynamic_on, monitor_mbs_grad, stack_info, recording_l2_features, "
            "l2_targets, sa_order, cc_distribution, alert, grad_probe, loss_alignment, on_anomaly")


def problems_of(data: object) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as info:
        parse_config(data, "cfg.json")
    assert info.value.path == "cfg.json"
    assert all(isinstance(p, Problem) for p in info.value.problems)
    return [(p.key, p.message) for p in info.value.problems]


def write(tmp_path: Path, text: str | bytes, name: str = "monitor.json") -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def file_problem(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    err = info.value
    assert err.path == str(path)
    assert len(err.problems) == 1 and err.problems[0].key == ""
    assert str(err).startswith(f"1 problem in {path}\n  ")
    return err.problems[0].message


# ----------------------------------------------------------------------------- valid configs

def test_defaults():
    cfg = parse_config({}, "empty.json")
    assert cfg == MonitorConfig()
    assert cfg.source == "empty.json"
    assert cfg.targets == () and cfg.module_ranks == ()
    assert (cfg.start_step, cfg.step_interval, cfg.collect_times) == (0, 1, None)
    assert cfg.format == ("csv",) and cfg.ops == ("norm", "mean", "min", "max")
    assert cfg.eps == 1e-8 and cfg.ndigits is None and cfg.step_count_per_record == 100
    flags = ("wg_distribution", "mv_distribution", "param_distribution", "ur_distribution",
             "xy_distribution", "forward_only", "backward_only", "all_xy", "print_struct",
             "squash_name", "dynamic_on")
    assert all(getattr(cfg, f) is False for f in flags)
    assert cfg.cc_distribution == CommConfig(enable=False, cc_codeline=(), cc_pre_hook=False)
    assert cfg.alert == AlertConfig(rules=(), dump=False)


def test_config_is_frozen_hashable_and_source_not_compared():
    cfg = parse_config({"alert": {"rules": [{"rule_name": "AnomalyNan"}]}}, "a.json")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.start_step = 3  # type: ignore[misc]
    assert hash(cfg) == hash(parse_config({"alert": {"rules": [{"rule_name": "AnomalyNan"}]}}, "b.json"))
    assert cfg == dataclasses.replace(cfg, source="elsewhere.json")


FULL = {
    "targets": {"model.layers.0": {"input": "tuple[2]:0", "output_grad": "tensor"}, "model.layers.1.mlp": {}},
    "start_step": 5,
    "step_interval": 10,
    "collect_times": 3,
    "format": ["tensorboard", "csv"],
    "ops": ["std", "norm", "zeros", "infs", "nans", "min", "max", "mean"],
    "eps": 1e-6,
    "ndigits": 9,
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
    "ur_distribution": True,
    "xy_distribution": True,
    "forward_only": True,
    "backward_only": False,
    "all_xy": True,
    "print_struct": True,
    "squash_name": True,
    "global_layer_names": True,
    "module_ranks": [3, 0],
    "step_count_per_record": 4,
    "replicated_once": True,
    "dynamic_on": True,
    "grad_probe": {"grad_level": "L2", "param_list": ["model.layers.0"], "bounds": [-1, -0.5, 0, 2.5]},
    "loss_alignment": True,
    "monitor_mbs_grad": True,
    "stack_info": True,
    "recording_l2_features": True,
    "l2_targets": {"attention_hook": ["0:layers.0.attn"], "linear_hook": []},
    "sa_order": "s,b,h,d",
    "cc_distribution": {"enable": True, "cc_codeline": [r"layers\.\d+", "^train$"], "cc_pre_hook": True},
    "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}},
                        {"rule_name": "AnomalyNan", "args": {"threshold": 1}},
                        {"rule_name": "AnomalyNan"}],
              "dump": True},
    "on_anomaly": {"config": {"param_distribution": True, "ops": ["norm"]}, "steps": 5, "max_times": 2,
                   "history_steps": 3},
}


def test_full_config_round_trip(tmp_path):
    path = write(tmp_path, json.dumps(FULL, indent=2))
    cfg = load_config(path)
    assert cfg.source == str(path)
    assert cfg == MonitorConfig(
        targets=("model.layers.0", "model.layers.1.mlp"),
        target_specs=(("model.layers.0", (("input", "tuple[2]:0"), ("output_grad", "tensor"))),),
        start_step=5, step_interval=10,
        collect_times=3, format=("tensorboard", "csv"),
        ops=("std", "norm", "zeros", "infs", "nans", "min", "max", "mean"), eps=1e-6, ndigits=9,
        wg_distribution=True, mv_distribution=True, param_distribution=True, ur_distribution=True,
        xy_distribution=True, forward_only=True, backward_only=False, all_xy=True, print_struct=True,
        squash_name=True, global_layer_names=True, module_ranks=(3, 0), step_count_per_record=4,
        replicated_once=True, dynamic_on=True, monitor_mbs_grad=True, stack_info=True, recording_l2_features=True,
        l2_targets=(("attention_hook", ("0:layers.0.attn",)), ("linear_hook", ())), sa_order="s,b,h,d",
        grad_probe=GradProbeConfig("L2", ("model.layers.0",), (-1.0, -0.5, 0.0, 2.5)), loss_alignment=True,
        cc_distribution=CommConfig(enable=True, cc_codeline=(r"layers\.\d+", "^train$"), cc_pre_hook=True),
        alert=AlertConfig(rules=(AlertRule("AnomalyTurbulence", {"threshold": 0.5}),
                                 AlertRule("AnomalyNan", {"threshold": 1.0}),
                                 AlertRule("AnomalyNan", {})), dump=True),
        on_anomaly=AnomalyConfig(config={"param_distribution": True, "ops": ("norm",)}, steps=5, max_times=2,
                                 history_steps=3))
    # args are plain dicts, not the loader's own dict subclass
    assert all(type(rule.args) is dict for rule in cfg.alert.rules)
    # to_dict is plain JSON that loads back to an equal config, and it carries every key of FULL
    data = json.loads(json.dumps(cfg.to_dict()))
    assert parse_config(data, "again.json") == cfg
    assert set(data) == set(FULL)
    assert data["ops"] == FULL["ops"] and data["targets"] == FULL["targets"]


def test_eps_int_is_a_float():
    cfg = parse_config({"eps": 1}, "x")
    assert cfg.eps == 1.0 and isinstance(cfg.eps, float)


def test_format_single_string_and_null_optionals():
    cfg = parse_config({"format": "tensorboard", "collect_times": None, "ndigits": None}, "x")
    assert cfg.format == ("tensorboard",) and cfg.collect_times is None and cfg.ndigits is None
    assert KNOWN_FORMATS == ("csv", "tensorboard", "parquet", "wandb", "mlflow")


def test_shipped_example_loads():
    path = REPO / "monitor_config.json"
    cfg = load_config(path)
    raw = json.loads(path.read_text(encoding="utf-8"))
    assert cfg.wg_distribution and cfg.mv_distribution and cfg.param_distribution
    assert cfg.ops == ("norm", "mean", "min", "max", "nans")
    assert cfg.format == ("csv",)
    assert list(cfg.targets) == list(raw.get("targets", []))


def test_msprobe_style_config_loads(tmp_path):
    text = json.dumps({
        "targets": {"language_model.encoder.layers.0": {}, "language_model.encoder.layers.1": {}},
        "print_struct": False,
        "module_ranks": [],
        "ur_distribution": False,
        "xy_distribution": True,
        "all_xy": False,
        "forward_only": False,
        "backward_only": False,
        "wg_distribution": True,
        "mv_distribution": False,
        "param_distribution": False,
        "cc_distribution": {"enable": False, "cc_codeline": [], "cc_pre_hook": False, "cc_log_only": False},
        "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": False},
        "ops": ["min", "max", "norm", "zeros", "nans", "mean", "shape", "dtype"],
        "eps": 1e-8,
        "ndigits": 12,
        "step_count_per_record": 1,
        "squash_name": True,
        "monitor_mbs_grad": False,
        "mg_direction": False,
        "stack_info": False,
        "append_output": [],
        "recording_l2_features": False,
        "l2_targets": {},
        "sa_order": "",
        "dynamic_on": False,
    })
    cfg = load_config(write(tmp_path, text))
    assert cfg.targets == ("language_model.encoder.layers.0", "language_model.encoder.layers.1")
    assert cfg.ops == ("min", "max", "norm", "zeros", "nans", "mean")  # user order, shape/dtype dropped
    assert cfg.xy_distribution and cfg.wg_distribution and cfg.squash_name and cfg.ndigits == 12
    assert cfg.alert.rules == (AlertRule("AnomalyTurbulence", {"threshold": 0.5}),)
    assert cfg.cc_distribution == CommConfig()


def test_shape_and_dtype_anywhere_in_ops_are_dropped():
    assert parse_config({"ops": ["shape", "max", "dtype", "nans"]}, "x").ops == ("max", "nans")


# ----------------------------------------------------------------------------- one bad value each

BAD = [
    ({"wg_distrbution": True}, "wg_distrbution", "unknown key (did you mean 'wg_distribution'?)"),
    ({"stack_infos": False}, "stack_infos", "unknown key (did you mean 'stack_info'?)"),
    ({"zzz": 1}, "zzz", f"unknown key (allowed: {TOP_KEYS})"),
    ({"ops": ["norm", "nrom"]}, "ops[1]",
     f"unknown stat 'nrom' (did you mean 'norm'? allowed: {STATS})"),
    ({"ops": ["id"]}, "ops[0]", f"unknown stat 'id' (allowed: {STATS})"),
    ({"ops": "norm"}, "ops", f"'norm' is not a list (non-empty list of: {STATS})"),
    ({"ops": []}, "ops", f"[] is empty (non-empty list of: {STATS})"),
    ({"ops": ["norm", "mean", "norm"]}, "ops[2]", "duplicate 'norm' (already at ops[0])"),
    ({"ops": [1]}, "ops[0]", f"1 is not a string (stat name: {STATS})"),
    ({"ops": ["shape", "dtype"]}, "ops",
     "[\"shape\", \"dtype\"] names no statistic ('shape' and 'dtype' are always written)"),
    ({"start_step": -1}, "start_step", "-1 is out of range (integer >= 0)"),
    ({"start_step": True}, "start_step", "true is not an integer (integer >= 0)"),
    ({"step_interval": 0}, "step_interval", "0 is out of range (integer >= 1)"),
    ({"step_interval": 2.0}, "step_interval", "2.0 is not an integer (integer >= 1)"),
    ({"collect_times": 0}, "collect_times", "0 is out of range (integer >= 1 or null)"),
    ({"step_count_per_record": "10"}, "step_count_per_record", "'10' is not an integer (integer >= 1)"),
    ({"step_count_per_record": None}, "step_count_per_record", "null is not an integer (integer >= 1)"),
    ({"ndigits": 0}, "ndigits", "0 is out of range (integer 1..17 or null)"),
    ({"ndigits": 18}, "ndigits", "18 is out of range (integer 1..17 or null)"),
    ({"eps": 0}, "eps", "0 is out of range (finite number > 0)"),
    ({"eps": -1e-8}, "eps", "-1e-08 is out of range (finite number > 0)"),
    ({"eps": float("inf")}, "eps", "Infinity is out of range (finite number > 0)"),
    ({"eps": "1e-8"}, "eps", "'1e-8' is not a number (finite number > 0)"),
    ({"eps": False}, "eps", "false is not a number (finite number > 0)"),
    ({"wg_distribution": 1}, "wg_distribution", "1 is not a boolean (true or false)"),
    ({"dynamic_on": "true"}, "dynamic_on", "'true' is not a boolean (true or false)"),
    ({"forward_only": True, "backward_only": True}, "backward_only",
     "true together with forward_only: true records nothing (set at most one of them)"),
    ({"xy_distribution": True}, "xy_distribution",
     "true needs targets (the modules to record) or all_xy: true (every module)"),
    ({"xy_distribution": True, "targets": [], "all_xy": False}, "xy_distribution",
     "true needs targets (the modules to record) or all_xy: true (every module)"),
    # an unknown but well-spelled name ('parket') passes here: runtime.features rejects it at attach
    # (tests/config/test_sink_formats.py)
    ({"format": "par ket"}, "format",
     "'par ket' is not a sink name (letters, digits, '_', '-', '.'; a sink name such as csv, tensorboard, "
     "parquet, wandb, mlflow)"),
    ({"format": ["csv", 3]}, "format[1]",
     "3 is not a string (letters, digits, '_', '-', '.'; a sink name such as csv, tensorboard, parquet, wandb, "
     "mlflow)"),
    ({"format": ["csv", "alert"]}, "format[1]",
     "'alert' is a config key, not a sink name (a sink name such as csv, tensorboard, parquet, wandb, mlflow)"),
    ({"format": []}, "format",
     "[] is empty (a sink name such as csv, tensorboard, parquet, wandb, mlflow, or a non-empty list of sink names)"),
    ({"format": ["csv", "csv"]}, "format[1]", "duplicate 'csv' (already at format[0])"),
    ({"format": 1}, "format",
     "1 is not a list (a sink name such as csv, tensorboard, parquet, wandb, mlflow, or a non-empty list of sink "
     "names)"),
    ({"format": ["csv"], "wandb": {"project": "x"}}, "wandb",
     "settings for the 'wandb' sink, which format does not list (add 'wandb' to format, or remove this block)"),
    ({"format": ["csv", "wandb"], "wandb": 3}, "wandb", "3 is not an object (the settings of the 'wandb' sink)"),
    ({"format": ["csv", "wandb"], "wandbb": {}}, "wandbb", "unknown key (did you mean 'wandb'?)"),
    ({"targets": "layers.0"}, "targets",
     "'layers.0' is not a list or object (list of names, or {\"name\": {}})"),
    ({"targets": ["a", ""]}, "targets[1]", "'' is empty (non-empty module or parameter name)"),
    ({"targets": ["a", " "]}, "targets[1]", "' ' is empty (non-empty module or parameter name)"),
    ({"targets": [3]}, "targets[0]", "3 is not a string (non-empty module or parameter name)"),
    ({"targets": ["a", "b", "a"]}, "targets[2]", "duplicate 'a' (already at targets[0])"),
    ({"targets": {"layers.0": {"inptu": "tuple[2]:0"}}}, 'targets["layers.0"].inptu',
     "unknown key (did you mean 'input'?)"),
    ({"targets": {"layers.0": {"output": "tuple[2]:2"}}}, 'targets["layers.0"].output',
     "'tuple[2]:2' is out of range (\"tensor\", \"tuple[N]\" or \"tuple[N]:i\" with 0 <= i < N)"),
    ({"targets": {"layers.0": {"input_grad": "list[2]"}}}, 'targets["layers.0"].input_grad',
     "'list[2]' is not a spec (\"tensor\", \"tuple[N]\" or \"tuple[N]:i\" with 0 <= i < N)"),
    ({"targets": {"layers.0": True}}, 'targets["layers.0"]',
     "true is not an object ({} or a spec such as {\"input\": \"tuple[2]:0\", \"output\": \"tensor\"})"),
    ({"module_ranks": 0}, "module_ranks",
     "0 is not a list (list of distinct ranks, integers >= 0; [] = all ranks)"),
    ({"module_ranks": [0, 1, 0]}, "module_ranks[2]", "duplicate 0 (already at module_ranks[0])"),
    ({"module_ranks": [True]}, "module_ranks[0]", "true is not an integer (integer >= 0)"),
    ({"module_ranks": [-2]}, "module_ranks[0]", "-2 is out of range (integer >= 0)"),
    ({"cc_distribution": True}, "cc_distribution",
     "true is not an object (keys: enable, cc_codeline, cc_pre_hook)"),
    ({"cc_distribution": {"enabel": True}}, "cc_distribution.enabel",
     "unknown key (did you mean 'enable'?)"),
    ({"cc_distribution": {"cc_codeline": ["ok", "("]}}, "cc_distribution.cc_codeline[1]",
     "'(' is not a valid regular expression: missing ), unterminated subpattern at position 0"),
    ({"cc_distribution": {"cc_codeline": "x"}}, "cc_distribution.cc_codeline",
     "'x' is not a list (list of regular expressions)"),
    ({"cc_distribution": {"cc_log_only": True}}, "cc_distribution.cc_log_only",
     "true is an msprobe option trainmon does not support (only false is accepted)"),
    ({"cc_distribution": {"cc_pre_hook": 0}}, "cc_distribution.cc_pre_hook",
     "0 is not a boolean (true or false)"),
    ({"alert": []}, "alert", "[] is not an object (keys: rules, dump)"),
    ({"alert": {"dump": 1}}, "alert.dump", "1 is not a boolean (true or false)"),
    ({"alert": {"rules": {}}}, "alert.rules",
     "{} is not a list (list of {\"rule_name\": ..., \"args\": {...}})"),
    ({"alert": {"rules": [{"rule_name": "AnomalyNaN"}]}}, "alert.rules[0].rule_name",
     "unknown rule 'AnomalyNaN' (did you mean 'AnomalyNan'? allowed: AnomalyNan, nonfinite, AnomalyTurbulence, spike)"),
    ({"alert": {"rules": [{"rule_name": 7}]}}, "alert.rules[0].rule_name",
     "unknown rule 7 (allowed: AnomalyNan, nonfinite, AnomalyTurbulence, spike)"),
    ({"alert": {"rules": [{"args": {}}]}}, "alert.rules[0].rule_name",
     "missing (one of AnomalyNan, nonfinite, AnomalyTurbulence, spike)"),
    ({"alert": {"rules": [{"rule_name": "spike", "args": {"factor": 1}}]}}, "alert.rules[0].args.factor",
     "1 is out of range (finite number > 1)"),
    ({"alert": {"rules": [{"rule_name": "spike", "args": {"ops": ["nrom"]}}]}}, "alert.rules[0].args.ops[0]",
     "unknown stat 'nrom' (did you mean 'norm'? allowed: norm, mean, min, max, zeros, nans, infs, std, "
     "update_ratio)"),
    ({"alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"warmup": 0}}]}},
     "alert.rules[0].args.warmup", "0 is out of range (integer >= 1)"),
    ({"alert": {"rules": [{"rule_name": "AnomalyNan", "args": {"threshold": -0.5}}]}},
     "alert.rules[0].args.threshold", "-0.5 is out of range (finite number >= 0)"),
    ({"alert": {"rules": [{"rule_name": "AnomalyNan", "args": {"threshold": "1"}}]}},
     "alert.rules[0].args.threshold", "'1' is not a number (finite number >= 0)"),
    ({"alert": {"rules": [{"rule_name": "AnomalyNan", "args": {"threshhold": 1}}]}},
     "alert.rules[0].args.threshhold", "unknown key (did you mean 'threshold'?)"),
    ({"alert": {"rules": [{"rule_name": "AnomalyNan", "arg": {}}]}}, "alert.rules[0].arg",
     "unknown key (did you mean 'args'?)"),
    ({"alert": {"rules": ["AnomalyNan"]}}, "alert.rules[0]",
     "'AnomalyNan' is not an object (keys: rule_name, args)"),
    ({"stack_info": 1}, "stack_info", "1 is not a boolean (true or false)"),
    ({"sa_order": "b,s,h"}, "sa_order", "'b,s,h' is not an order of b,s,h,d (e.g. \"b,s,h,d\" or \"s,b,h,d\")"),
    ({"append_output": ["Dec03_10-00-00", "Dec03_11-00-00"]}, "append_output",
     "[\"Dec03_10-00-00\", \"Dec03_11-00-00\"] is an msprobe option trainmon does not support "
     "(remove it or set it to false)"),
    ({"mg_direction": True}, "mg_direction",
     "true is an msprobe option trainmon does not support (remove it or set it to false)"),
    ({"l2_targets": {"attention_hook": "0:0.self_attention"}}, "l2_targets.attention_hook",
     "'0:0.self_attention' is not a list (list of module names)"),
]


@pytest.mark.parametrize("data,key,message", BAD, ids=[f"{i}-{k}" for i, (_, k, _) in enumerate(BAD)])
def test_bad_value_gives_one_exact_problem(data, key, message):
    assert problems_of(data) == [(key, message)]


def test_bad_cases_are_distinct_and_plenty():
    assert len(BAD) >= 25
    assert len({json.dumps(d, sort_keys=True, default=str) for d, _, _ in BAD}) == len(BAD)


# ----------------------------------------------------------------------------- many problems at once

def test_every_problem_of_a_file_in_one_error(tmp_path):
    text = """{
  "wg_distrbution": true,
  "ops": ["norm", "nrom", "shape"],
  "step_interval": 0,
  "format": "csv",
  "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": -1}}]},
  "ndigits": 6,
  "mg_direction": true
}"""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    err = info.value
    assert isinstance(err, ValueError)
    assert str(err) == (
        f"5 problems in {path}\n"
        "  wg_distrbution: unknown key (did you mean 'wg_distribution'?)\n"
        f"  ops[1]: unknown stat 'nrom' (did you mean 'norm'? allowed: {STATS})\n"
        "  step_interval: 0 is out of range (integer >= 1)\n"
        "  alert.rules[0].args.threshold: -1 is out of range (finite number >= 0)\n"
        "  mg_direction: true is an msprobe option trainmon does not support "
        "(remove it or set it to false)")


def test_nested_problems_are_all_reported():
    data = {"cc_distribution": {"enable": "yes", "cc_codeline": ["[", 5], "x": 1},
            "alert": {"rules": [{"rule_name": "AnomalyNan", "args": {"threshold": None}},
                                {"rule_name": "Nope"}], "dump": "no"}}
    assert problems_of(data) == [
        ("cc_distribution.x", "unknown key (allowed: enable, cc_codeline, cc_pre_hook)"),
        ("cc_distribution.enable", "'yes' is not a boolean (true or false)"),
        ("cc_distribution.cc_codeline[0]",
         "'[' is not a valid regular expression: unterminated character set at position 0"),
        ("cc_distribution.cc_codeline[1]", "5 is not a string (regular expression)"),
        ("alert.rules[0].args.threshold", "null is not a number (finite number >= 0)"),
        ("alert.rules[1].rule_name", "unknown rule 'Nope' (allowed: AnomalyNan, nonfinite, AnomalyTurbulence, spike)"),
        ("alert.dump", "'no' is not a boolean (true or false)"),
    ]


NAN_RULE = {"rules": [{"rule_name": "AnomalyNan"}]}


def test_on_anomaly_parses_its_partial_config_with_the_top_level_parsers():
    cfg = parse_config({"wg_distribution": True, "targets": ["layers.0"], "alert": NAN_RULE, "on_anomaly": {
        "config": {"xy_distribution": True, "ops": ["norm", "nans"], "cc_distribution": {"enable": True}},
        "steps": 4, "max_times": 3, "history_steps": 8}}, "cfg.json")
    assert cfg.on_anomaly == AnomalyConfig(config={"xy_distribution": True, "ops": ("norm", "nans"),
                                                   "cc_distribution": CommConfig(enable=True)},
                                           steps=4, max_times=3, history_steps=8)
    merged = cfg.escalated()
    assert (merged.wg_distribution, merged.xy_distribution, merged.ops, merged.targets, merged.on_anomaly) == (
        True, True, ("norm", "nans"), ("layers.0",), None)
    assert merged.cc_distribution.enable and merged.alert == cfg.alert
    assert parse_config(cfg.to_dict(), "again.json") == cfg           # round trip through JSON
    hash(cfg)
    short = parse_config({"alert": NAN_RULE, "on_anomaly": {"config": {}, "steps": 1}}, "cfg.json")
    assert short.on_anomaly == AnomalyConfig(config={}, steps=1, max_times=1, history_steps=0)
    assert parse_config({"on_anomaly": None}, "cfg.json").on_anomaly is None


def test_on_anomaly_problems_are_all_reported_with_their_key_paths():
    allowed = ", ".join(ESCALATION_KEYS)
    data = {"on_anomaly": {"config": {"xy_distribution": True, "start_step": 3, "wg_distrbution": True,
                                      "ops": ["nrom"]},
                           "max_time": 2, "history_steps": -1}}
    assert problems_of(data) == [
        ("on_anomaly.max_time", "unknown key (did you mean 'max_times'?)"),
        ("on_anomaly.steps", "missing (how many steps to record it for, integer >= 1)"),
        ("on_anomaly.history_steps", "-1 is out of range (integer >= 0)"),
        ("on_anomaly.config.start_step", "cannot be changed by an escalation (its window sets the schedule; "
                                         f"outputs, ranks and alert rules stay the base config's); allowed: {allowed}"),
        ("on_anomaly.config.wg_distrbution", "unknown key (did you mean 'wg_distribution'?)"),
        ("on_anomaly.config.ops[0]", f"unknown stat 'nrom' (did you mean 'norm'? allowed: {STATS})"),
        ("on_anomaly", "needs alert.rules: an escalation starts when a run-time alert fires "
                       "(e.g. \"alert\": {\"rules\": [{\"rule_name\": \"AnomalyNan\"}]})"),
        ("on_anomaly.config.xy_distribution", "true needs targets (the modules to record) or all_xy: true "
                                              "(every module) (in the base config merged with on_anomaly.config)"),
    ]
    assert problems_of({"alert": NAN_RULE, "on_anomaly": {"config": [], "steps": 0}}) == [
        ("on_anomaly.steps", "0 is out of range (integer >= 1)"),
        ("on_anomaly.config", f"[] is not an object (a partial config with keys among: {allowed})")]
    # a combination only the merge makes is the partial config's problem; one of the base is not repeated
    assert problems_of({"forward_only": True, "alert": NAN_RULE,
                        "on_anomaly": {"config": {"backward_only": True}, "steps": 2}}) == [
        ("on_anomaly.config.backward_only", "true together with forward_only: true records nothing (set at "
                                            "most one of them) (in the base config merged with on_anomaly.config)")]
    assert problems_of({"forward_only": True, "backward_only": True, "alert": NAN_RULE,
                        "on_anomaly": {"config": {}, "steps": 2}}) == [
        ("backward_only", "true together with forward_only: true records nothing (set at most one of them)")]


def test_repeated_json_keys_are_problems(tmp_path):
    path = write(tmp_path, '{"ops": ["norm"], "targets": {"a": {}, "a": {}},'
                           ' "alert": {"dump": true, "dump": false}, "ops": ["max"]}')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = "duplicate key (JSON would silently keep only the last value)"
    assert [(p.key, p.message) for p in info.value.problems] == [
        ("ops", msg), ('targets["a"]', msg), ("alert.dump", msg)]


# ----------------------------------------------------------------------------- file errors

def test_json_syntax_error_line_and_column(tmp_path):
    text = '{\n  "ops": ["norm"],\n  "eps": 1e-8\n  "wg_distribution": true\n}\n'
    line4 = text.splitlines()[3]
    column = line4.index('"') + 1  # the parser stops at the key that should follow a comma
    assert file_problem(write(tmp_path, text)) == (
        f"invalid JSON at line 4, column {column}: Expecting ',' delimiter")


def test_json_trailing_comma_is_located(tmp_path):
    text = '{"wg_distribution": true,\n "ops": ["norm", "max",]\n}'
    column = text.splitlines()[1].index("]") + 1
    assert file_problem(write(tmp_path, text)) == f"invalid JSON at line 2, column {column}: Expecting value"


def test_missing_file(tmp_path):
    assert file_problem(tmp_path / "nowhere" / "monitor.json") == "file not found"


def test_directory(tmp_path):
    assert file_problem(tmp_path) == "is a directory, expected a JSON file"


@pytest.mark.parametrize("text,kind", [("[1, 2]", "a list"), ('"csv"', "a string"), ("3", "a number"),
                                       ("null", "null"), ("true", "a boolean")])
def test_top_level_not_an_object(tmp_path, text, kind):
    assert file_problem(write(tmp_path, text)) == (
        f"the top level is {kind}, expected an object ({{\"key\": value, ...}})")


def test_empty_file(tmp_path):
    assert file_problem(write(tmp_path, " \n")) == "the file is empty (expected a JSON object)"


def test_not_utf8(tmp_path):
    raw = '{"targets": ["café"]}'.encode("latin-1")
    offset = raw.index(bytes([0xE9]))
    assert file_problem(write(tmp_path, raw)) == f"not valid UTF-8 (byte 0xe9 at offset {offset})"


def test_byte_order_mark_is_tolerated(tmp_path):
    cfg = load_config(write(tmp_path, b'\xef\xbb\xbf{"wg_distribution": true}'))
    assert cfg.wg_distribution is True


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="file permissions do not stop root")
def test_unreadable_file(tmp_path):
    path = write(tmp_path, "{}")
    path.chmod(0)
    try:
        assert file_problem(path) == "cannot read the file: Permission denied"
    finally:
        path.chmod(0o644)


def test_path_through_a_file_is_a_read_error(tmp_path):
    blocker = write(tmp_path, "{}", name="plain_file")
    message = file_problem(blocker / "monitor.json")
    assert message == "cannot read the file: Not a directory"


def test_pathlike_and_str_paths(tmp_path):
    path = write(tmp_path, '{"step_interval": 2}')
    assert load_config(str(path)) == load_config(path)
    assert load_config(path).step_interval == 2


# ----------------------------------------------------------------------------- the module and docs

def test_config_and_output_layers_import_no_torch():
    code = ("import sys, trainmon.config, trainmon.output.runs, trainmon.output.layout, trainmon.output.tb_tags; "
            "bad = [m for m in ('torch', 'numpy', 'pydantic') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_docs_table_lists_every_key():
    # The config reference is the page docs/configuration.md ("# Configuration file").
    text = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^\| `([a-z0-9_.]+)` \|", text, flags=re.MULTILINE))
    # specs live in targets; sink_settings are the blocks named like a format (the `<format>` row)
    fields = {f.name for f in dataclasses.fields(MonitorConfig)} - {"source", "target_specs", "sink_settings"}
    assert "`<format>`" in text
    nested = {f"cc_distribution.{f.name}" for f in dataclasses.fields(CommConfig)}
    nested |= {f"alert.{f.name}" for f in dataclasses.fields(AlertConfig)}
    nested |= {f"grad_probe.{f.name}" for f in dataclasses.fields(GradProbeConfig)}
    nested |= {f"on_anomaly.{f.name}" for f in dataclasses.fields(AnomalyConfig)}
    assert fields | nested <= documented
    assert documented - {"cc_distribution.cc_log_only"} <= fields | nested
    # every top-level key the docs list is one the loader accepts
    for key in fields:
        parse_config({key: MonitorConfig().to_dict()[key]}, "x")


def test_docs_table_lists_the_keys_in_the_schemas_order_each_with_its_docstring():
    from trainmon.config import TOP_KEYS as keys
    from trainmon.config.schema import key_doc

    text = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    table = text.split("## Top-level keys", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"^\| `([a-z0-9_]+)` \|", table, flags=re.MULTILINE)
    assert documented == list(keys) == TOP_KEYS.split(", ")
    for config in (MonitorConfig, CommConfig, AlertConfig, GradProbeConfig, AnomalyConfig):
        for f in dataclasses.fields(config):
            if f.name not in ("target_specs", "sink_settings", "source", "rule_name", "args"):
                assert key_doc(config, f.name).strip(), (config.__name__, f.name)


def test_boolean_and_escalation_keys_come_from_the_fields():
    from trainmon.config import BOOLEAN_KEYS

    defaults = MonitorConfig()
    assert set(BOOLEAN_KEYS) == {k for k in TOP_KEYS.split(", ") if getattr(defaults, k) is False}
    for name in BOOLEAN_KEYS:  # each one is read as a strict boolean
        assert getattr(parse_config({name: True}, "x") if name != "xy_distribution"
                       else parse_config({name: True, "all_xy": True}, "x"), name) is True
        assert problems_of({name: 1}) == [(name, "1 is not a boolean (true or false)")]
    assert ESCALATION_KEYS == ("targets", "ops", "eps", "wg_distribution", "mv_distribution", "param_distribution",
                               "ur_distribution", "xy_distribution", "forward_only", "backward_only", "all_xy",
                               "squash_name", "cc_distribution")
