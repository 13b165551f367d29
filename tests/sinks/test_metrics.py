"""MetricKeys: the keys, selection and cap the W&B and MLflow sinks share (no tracker needed)."""

from __future__ import annotations

import logging

import pytest

from trainmon.sinks.metrics import MetricKeys, MetricSettings
from trainmon.stats.rows import StatRow, StepRows


def rows(step: int) -> list[StatRow]:
    out = [
        StatRow("grad_reduced", name, step, {"norm": step + i + 0.5, "max": -(step + i) / 3})
        for i, name in enumerate(["layers.0.weight", "layers.1.weight", "head.bias"])
    ]
    out.append(StatRow("grad_reduced", "layers.0.weight", step, {"norm": 9.0, "max": 8.0}, vpp_stage=1))
    out += [StatRow("actv", "layers.0.mlp", step, {"norm": 10.0 * m + step}, micro_step=m) for m in (1, 0, 2)]
    out.append(StatRow("comm", "x", step, {"norm": 7.0}, extra={"call": "all_reduce", "when": "post"}))
    out.append(StatRow("grad_direction", "layers.0.weight", step, {"signs": "0xff"}))  # not a number
    return out


def metrics(settings: MetricSettings, step: int = 0, keys: MetricKeys | None = None) -> dict[str, float]:
    keys = keys or MetricKeys(settings, "W&B")
    return keys.metrics(StepRows.of(rows(step)).blocks())


def test_every_scalar_value_under_its_documented_key():
    assert metrics(MetricSettings()) == {
        "grad_reduced/norm/layers.0.weight": 0.5,
        "grad_reduced/max/layers.0.weight": -0.0,
        "grad_reduced/norm/layers.1.weight": 1.5,
        "grad_reduced/max/layers.1.weight": -1 / 3,
        "grad_reduced/norm/head.bias": 2.5,
        "grad_reduced/max/head.bias": -2 / 3,
        "grad_reduced/norm/layers.0.weight:vp1": 9.0,
        "grad_reduced/max/layers.0.weight:vp1": 8.0,
        "actv/norm/layers.0.mlp": 20.0,  # the last micro-step's, whatever order the rows came in
        "comm/norm/x:call=all_reduce:when=post": 7.0,
    }


def test_each_micro_step_gets_its_own_key():
    got = metrics(MetricSettings(micro_steps="each", families=["actv"]))
    assert got == {
        "actv/norm/layers.0.mlp:micro0": 0.0,
        "actv/norm/layers.0.mlp:micro1": 10.0,
        "actv/norm/layers.0.mlp:micro2": 20.0,
    }


def test_families_stats_and_name_patterns_select():
    got = metrics(MetricSettings(families=["grad_reduced"], stats=["norm"], names=["layers.*"]))
    assert got == {
        "grad_reduced/norm/layers.0.weight": 0.5,
        "grad_reduced/norm/layers.1.weight": 1.5,
        "grad_reduced/norm/layers.0.weight:vp1": 9.0,
    }


def test_the_cap_keeps_the_first_keys_for_good_and_warns_once(caplog):
    keys = MetricKeys(MetricSettings(max_metrics=3, families=["grad_reduced"]), "W&B")
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        first = metrics(MetricSettings(), 0, keys)
        later = metrics(MetricSettings(), 5, keys)
    kept = [
        "grad_reduced/norm/layers.0.weight",
        "grad_reduced/max/layers.0.weight",
        "grad_reduced/norm/layers.1.weight",
    ]
    assert list(first) == kept and list(later) == kept
    assert later[kept[0]] == 5.5
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "first 3 metric keys" in warned[0] and "max_metrics" in warned[0]


def test_settings_errors_name_the_key():
    with pytest.raises(ValueError, match=r"metrics\.names: \[''\] is not a list of non-empty strings"):
        MetricSettings(names=[""])
    with pytest.raises(ValueError, match=r"metrics\.timeout_s"):
        MetricSettings(timeout_s=-1)
