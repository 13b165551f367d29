"""Every ready-made config (examples/configs/*.json and monitor_config.json) loads and really runs.

Each one is loaded with the strict loader and then drives 2 steps of TinyGPT (2 micro-batches
each); the files written are checked against what the config asks for and against the model itself.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests._support.runs import REPO, read_family, reference_stats
from trainmon import TrainerMon, load_config, seed_all
from trainmon.config import MonitorConfig, parse_config
from trainmon.families import FAMILIES, MOMENTS, Family
from trainmon.testing.tiny_gpt import TinyGPT, train

CONFIGS = sorted((REPO / "examples" / "configs").glob("*.json")) + [REPO / "monitor_config.json"]
STEPS, GRAD_ACC = 2, 2


def _id(path: Path) -> str:
    return str(path.relative_to(REPO))


def expected_families(cfg: MonitorConfig) -> set[str]:
    """The families a single-process run of ``cfg`` writes (no collectives run, so no ``comm``)."""
    on = set()
    for family, info in FAMILIES.items():
        if info.config_flag is None:  # written when the loop calls the API (record_loss)
            continue
        if info.moment and family not in MOMENTS:  # state AdamW does not keep (momentum_buffer, ...)
            continue
        flag = getattr(cfg, info.config_flag)
        if family is Family.COMM or not (flag.enable if info.config_flag == "cc_distribution" else flag):
            continue
        if (family is Family.ACTV and cfg.backward_only) or (family is Family.ACTV_GRAD and cfg.forward_only):
            continue
        on.add(str(family))
    return on


def written_families(rank_dir: Path) -> set[str]:
    return {f.value for f in Family if read_family(rank_dir, f.value).shape[0]}


def run(path: Path) -> tuple[TinyGPT, Path]:
    seed_all(1234)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with TrainerMon(path) as monitor:
        monitor.set_monitor(model, grad_acc_steps=GRAD_ACC, optimizer=optimizer)
        train(model, optimizer, STEPS, GRAD_ACC)
    return model, monitor.run_dir


def test_every_example_is_there():
    names = {p.name for p in CONFIGS}
    assert {
        "weight_grads.json",
        "all_on.json",
        "activations.json",
        "dynamic.json",
        "tensorboard.json",
        "alerts.json",
        "monitor_config.json",
    } <= names


@pytest.mark.parametrize("path", CONFIGS, ids=_id)
def test_config_loads_strictly_and_says_what_its_file_says(path):
    cfg = load_config(path)
    raw = json.loads(path.read_text(encoding="utf-8"))
    assert parse_config(cfg.to_dict(), "round trip") == parse_config(raw, "file")
    for key, value in raw.items():
        if isinstance(value, (bool, int, float)) or value is None:
            assert getattr(cfg, key) == value, key
    assert expected_families(cfg) or cfg.cc_distribution.enable, "an example that records nothing"


@pytest.mark.parametrize("path", CONFIGS, ids=_id)
def test_two_steps_of_tiny_gpt_write_what_the_config_asks_for(path, output_root, monkeypatch):
    cfg = load_config(path)
    if cfg.dynamic_on:
        monkeypatch.setenv("DYNAMIC_MONITOR", "true")  # the file is watched; "dynamic_on": true starts at once
    original_all_reduce = dist.all_reduce
    model, run_dir = run(path)
    rank0 = run_dir / "rank0"
    assert dist.all_reduce is original_all_reduce, "close() puts the comm functions back"

    expected = expected_families(cfg)
    assert written_families(rank0) == expected
    params = dict(model.named_parameters())
    collected = [s for s in range(STEPS) if s >= cfg.start_step and (s - cfg.start_step) % cfg.step_interval == 0]
    collected = collected[: cfg.collect_times] if cfg.collect_times else collected
    for family in expected:
        df = read_family(rank0, family)
        stats = ["update_ratio"] if family == "update_ratio" else list(cfg.ops)
        assert [c for c in df.columns if c in stats or c in ("update_ratio",)] == stats, family
        assert sorted(set(df["step"])) == collected, family
        if family.startswith("actv"):
            per_step = df.groupby("step")["micro_step"].nunique()
            assert (per_step == GRAD_ACC).all(), family
            if cfg.targets:
                assert all(any(name.startswith(t + ".") for t in cfg.targets) for name in df["name"]), family
        else:
            assert set(df["name"]) == set(params), family

    if "param_updated" in expected and collected[-1] == STEPS - 1:
        last = read_family(rank0, "param_updated").query(f"step == {STEPS - 1}").set_index("name")
        for name, p in params.items():
            truth = reference_stats(p)
            assert math.isclose(last.loc[name, "norm"], truth["norm"], rel_tol=1e-5), name
            if "max" in cfg.ops:
                assert last.loc[name, "max"] == pytest.approx(truth["max"], rel=1e-6), name
    if "tensorboard" in cfg.format:
        assert list((run_dir / "tensorboard" / "rank0").glob("events.out.tfevents.*"))
    if cfg.alert.rules:
        assert not (rank0 / "anomalies.jsonl").exists(), "a healthy run raises no alert"
    if cfg.print_struct:
        assert (run_dir / "module_struct.json").is_file()
