"""``format`` names and sink settings blocks: spelling checked by the loader, existence and the
block's keys checked when the monitor is created (runtime.features), against the real registry."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import pytest
import torch

import trainmon.sinks.base as base
from trainmon import ConfigError, TrainerMon
from trainmon.config import load_config, parse_config
from trainmon.config.settings import parse_settings
from trainmon.runtime.features import sink_settings, unsupported_problems
from trainmon.sinks import SinkOptions, create_sink, known_formats
from trainmon.sinks.base import Sink
from trainmon.stats.rows import StepRows


@dataclass(frozen=True)
class _Settings:
    project: str | None = None
    ranks: Literal["zero", "all"] = "zero"
    max_keys: int = 1000
    names: list[str] = field(default_factory=list)
    rate: float = 1.0
    enabled: bool = True


class _SettingsSink(Sink):
    """Keeps what it was built with and what it received (real rows from a real training loop)."""

    settings_schema = _Settings
    built: ClassVar[list[_SettingsSink]] = []

    def __init__(self, options: SinkOptions):
        super().__init__(options)
        self.steps: dict[int, int] = {}
        _SettingsSink.built.append(self)

    def write(self, rows: StepRows, step: int) -> None:
        self.steps[step] = sum(len(b.names) for b in rows.blocks())


class _PlainSink(Sink):
    def write(self, rows: StepRows, step: int) -> None:
        pass


@pytest.fixture
def registered(monkeypatch):
    """Two sinks registered for one test only (the registry is process-wide)."""
    monkeypatch.setitem(base._REGISTRY, "test_settings", _SettingsSink)
    monkeypatch.setitem(base._REGISTRY, "test_plain", _PlainSink)
    _SettingsSink.built.clear()


def _train(config_path, steps: int = 3) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(config_path)
    mon.set_monitor(model, optimizer=opt)
    for _ in range(steps):
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    mon.close()


def test_unknown_format_is_rejected_when_the_monitor_is_created_with_did_you_mean(make_config, output_root):
    path = make_config(format=["csv", "tensorbord"])
    assert load_config(path).format == ("csv", "tensorbord")  # spelling is fine: the loader accepts it
    with pytest.raises(ConfigError) as err:
        TrainerMon(path)
    assert str(err.value).splitlines()[1] == (
        f"  format[1]: unknown format 'tensorbord' (did you mean 'tensorboard'? allowed: {', '.join(known_formats())})"
    )
    assert not output_root.exists()  # nothing was written for a config that cannot run


def test_builtin_names_are_known_without_importing_them():
    assert {"csv", "tensorboard", "parquet", "wandb", "mlflow"} <= set(known_formats())


def test_registered_sink_is_selectable_and_gets_its_settings(registered, make_config, output_root):
    path = make_config(
        format=["csv", "test_settings"], wg_distribution=True, test_settings={"project": "p1", "names": ["a", "b"]}
    )
    _train(path)
    (sink,) = _SettingsSink.built
    assert sink.options.settings == _Settings(project="p1", names=["a", "b"])
    # 4 params (2 weights, 2 biases) of grad_reduced at least, each of the 3 steps
    assert sorted(sink.steps) == [0, 1, 2] and min(sink.steps.values()) >= 4


def test_sink_with_schema_and_no_block_gets_the_defaults(registered, tmp_path):
    settings = sink_settings(parse_config({"format": ["test_settings"]}, "c.json"))
    assert settings == {"test_settings": _Settings()}
    sink = create_sink(["test_settings"], SinkOptions(rank_dir=tmp_path), threaded=False)
    assert sink.sinks[0].options.settings == _Settings()  # type: ignore[attr-defined]


def test_settings_block_problems_all_at_once_with_key_paths(registered):
    cfg = parse_config(
        {
            "format": ["csv", "test_settings", "test_plain"],
            "test_settings": {"projet": "x", "ranks": "al", "max_keys": "10", "names": ["a", 3], "rate": True},
            "test_plain": {"anything": 1},
        },
        "c.json",
    )
    got = [str(p) for p in unsupported_problems(cfg)]
    assert got == [
        "test_settings.projet: unknown key (did you mean 'project'?)",
        "test_settings.ranks: unknown value 'al' (did you mean 'all'? allowed: 'zero', 'all')",
        "test_settings.max_keys: '10' is not an integer",
        "test_settings.names[1]: 3 is not a string (list of strings)",
        "test_settings.rate: true is not a finite number",
        "test_plain: the 'test_plain' sink takes no settings (remove this block)",
    ]
    with pytest.raises(ConfigError, match=r"6 problems in c\.json"):
        sink_settings(cfg)


def test_settings_block_typo_fails_trainermon(registered, make_config, output_root):
    path = make_config(format=["test_settings"], test_settings={"projcet": "x"})
    with pytest.raises(ConfigError, match=r"test_settings\.projcet: unknown key \(did you mean 'project'\?\)"):
        TrainerMon(path)


def test_settings_round_trip_through_to_dict(registered):
    cfg = parse_config({"format": ["csv", "test_settings"], "test_settings": {"rate": 2}}, "c.json")
    data = cfg.to_dict()
    assert data["test_settings"] == {"rate": 2} and "sink_settings" not in data
    assert parse_config(json.loads(json.dumps(data)), "c.json") == cfg


def test_missing_builtin_sink_module_reads_like_a_missing_extra(monkeypatch):
    import trainmon.sinks as sinks

    monkeypatch.setitem(sinks.SINK_MODULES, "wandb", "trainmon_no_such_module_for_test")
    monkeypatch.delitem(base._REGISTRY, "wandb", raising=False)
    (problem,) = unsupported_problems(parse_config({"format": ["csv", "wandb"]}, "c.json"))
    assert problem.key == "format[1]"
    assert problem.message.endswith("it needs wandb: pip install trainmon[wandb]")


@pytest.mark.parametrize(
    ("hint", "block", "expected"),
    [
        (int | None, None, None),
        (int | None, 3, 3),
        (float, 2, 2.0),
        (list[str], ["a"], ["a"]),
        (str, "x", "x"),
    ],
)
def test_parse_settings_accepts_the_documented_types(hint, block, expected):
    schema = dataclass(frozen=True)(type("S", (), {"__annotations__": {"v": hint}}))
    instance, problems = parse_settings(schema, {"v": block}, "s")
    assert problems == [] and instance.v == expected and type(instance.v) is type(expected)


def test_parse_settings_required_key_and_non_object():
    schema = dataclass(frozen=True)(type("S", (), {"__annotations__": {"name": str}}))
    assert [str(p) for p in parse_settings(schema, {}, "s")[1]] == ["s.name: missing (string)"]
    assert [str(p) for p in parse_settings(schema, [1], "s")[1]] == ["s: [1] is not an object (keys: name)"]


@dataclass(frozen=True)
class _Checked:
    limit: int = 10

    def __post_init__(self) -> None:
        if self.limit < 1:
            raise ValueError(f"checked.limit: {self.limit} is out of range (integer >= 1)")


def test_a_schemas_own_check_is_one_problem_with_its_key_path():
    instance, problems = parse_settings(_Checked, {"limit": 0}, "checked")
    assert instance is None and [str(p) for p in problems] == ["checked.limit: 0 is out of range (integer >= 1)"]
    assert parse_settings(_Checked, {"limit": 3}, "checked") == (_Checked(3), [])
