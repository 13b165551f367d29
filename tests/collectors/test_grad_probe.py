"""grad_probe: interval fractions and =0 against counts the test makes, the L2 sign sample (same
positions in every process), param_list checking, and the files a real run writes."""
from __future__ import annotations

import csv
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests._support.probe_runs import train_run
from tests._support.runs import REPO, read_family
from trainmon import ConfigError, TrainerMon
from trainmon.collectors.grad_probe import (
    DIRECTION_SAMPLES,
    direction_positions,
    direction_words,
    interval_counts,
    interval_labels,
)
from trainmon.testing.tiny_gpt import TinyGPT

BOUNDS = [-1.0, -0.1, 0.0, 0.25, 3.0]


def counts_by_hand(x: torch.Tensor, bounds: list[float]) -> list[int]:
    """Per interval (lo, hi] and =0, element by element in float64 Python: the independent truth."""
    values = [float(v) for v in x.detach().double().reshape(-1).tolist()]
    edges = [-math.inf, *bounds, math.inf]
    out = [0] * (len(bounds) + 1)
    for v in values:
        if math.isnan(v):
            continue
        for i in range(len(out)):
            last = i == len(out) - 1
            if edges[i] < v <= edges[i + 1] or (last and v == math.inf) or (i == 0 and v == -math.inf):
                out[i] += 1
                break
    return out + [sum(1 for v in values if v == 0.0)]


def tricky(dtype: torch.dtype) -> torch.Tensor:
    torch.manual_seed(3)
    x = torch.randn(4000, dtype=torch.float64) * 2
    x[:40] = 0.0
    x[40:50] = -0.0
    special = torch.tensor([*BOUNDS, math.nan, math.nan, math.inf, -math.inf, 0.1, -0.1, 1e-30, -1e-30],
                           dtype=torch.float64)
    x[50:50 + len(special)] = special
    # values one ulp either side of every cut point in the target dtype
    near = torch.tensor(BOUNDS, dtype=dtype)
    ups = torch.nextafter(near.float(), torch.full_like(near.float(), math.inf)).to(dtype)
    downs = torch.nextafter(near.float(), torch.full_like(near.float(), -math.inf)).to(dtype)
    x = x.to(dtype)
    x[100:100 + len(BOUNDS)] = ups
    x[200:200 + len(BOUNDS)] = downs
    return x.reshape(40, 100)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_interval_counts_equal_a_count_made_element_by_element(dtype):
    x = tricky(dtype)
    got = interval_counts(x, BOUNDS).tolist()
    assert got == counts_by_hand(x, BOUNDS)
    assert sum(got[:-1]) == x.numel() - int(torch.isnan(x.float()).sum())   # NaN is in no interval


def test_a_bound_between_two_representable_values_is_decided_exactly():
    # 0.1 is not a float32: the float32 nearest to it is above 0.1, so it belongs to (0.1, inf)
    x = torch.tensor([0.1, 0.09999999], dtype=torch.float32)
    assert interval_counts(x, [0.1]).tolist() == counts_by_hand(x, [0.1]) == [1, 1, 0]


def test_interval_counts_of_a_tensor_larger_than_one_chunk(monkeypatch):
    import trainmon.collectors.grad_probe as gp

    monkeypatch.setattr(gp, "_CHUNK", 1000)
    x = tricky(torch.float32)
    assert gp.interval_counts(x, BOUNDS).tolist() == counts_by_hand(x, BOUNDS)


def test_labels_are_msprobes():
    assert interval_labels([-1, 0, 1]) == ("(-inf, -1]", "(-1, 0]", "(0, 1]", "(1, inf)", "=0")
    assert interval_labels([-0.5, 1e-3, 2.5]) == ("(-inf, -0.5]", "(-0.5, 0.001]", "(0.001, 2.5]",
                                                 "(2.5, inf)", "=0")


def test_direction_positions_are_distinct_sorted_and_fixed_by_name_and_shape():
    pos = direction_positions("layers.0.mlp.0.weight", (64, 32))
    assert len(pos) == DIRECTION_SAMPLES == len(set(pos.tolist()))
    assert (np.diff(pos) > 0).all() and pos[0] >= 0 and pos[-1] < 64 * 32
    assert np.array_equal(direction_positions.__wrapped__("layers.0.mlp.0.weight", (64, 32)), pos)
    assert not np.array_equal(direction_positions("layers.1.mlp.0.weight", (64, 32)), pos)
    assert direction_positions("bias", (10,)).tolist() == list(range(10))   # small: every element
    big = direction_positions("embedding.weight", (50_000, 4096))
    assert len(big) == DIRECTION_SAMPLES and big[-1] < 50_000 * 4096


@pytest.mark.slow  # 3.0-5.6 s on a loaded 2-core VM (2026-12-06)
def test_direction_positions_are_identical_in_another_process():
    code = ("import json,sys; from trainmon.collectors.grad_probe import direction_positions as d; "
            "print(json.dumps([d(n, tuple(s)).tolist() for n, s in json.loads(sys.argv[1])]))")
    params = [["layers.0.attn.qkv.weight", [48, 16]], ["embedding.weight", [32000, 512]], ["pos", [8, 16]]]
    out = subprocess.run([sys.executable, "-c", code, json.dumps(params)], capture_output=True, text=True,
                         env={"PYTHONPATH": str(REPO), "PYTHONHASHSEED": "12345", "PATH": ""}, check=True)
    assert json.loads(out.stdout) == [direction_positions(n, tuple(s)).tolist() for n, s in params]


def test_direction_words_hold_the_sign_bits_of_the_sampled_positions():
    torch.manual_seed(0)
    g = torch.randn(64, 40)
    g.view(-1)[:300] = 0.0
    g.view(-1)[300] = math.nan
    pos = direction_positions("w", (64, 40))
    row = direction_words(g, torch.from_numpy(pos)).tolist()
    assert row[0] == len(pos)
    flat = g.reshape(-1).tolist()
    want = [flat[p] > 0 for p in pos.tolist()]          # NaN > 0 is False, 0 > 0 is False
    got = [(int(row[1 + i // 32]) >> (i % 32)) & 1 == 1 for i in range(len(pos))]
    assert got == want


@pytest.mark.slow
def test_a_real_run_writes_all_three_levels_exactly(tmp_path):
    bounds = [-0.01, 0, 0.002]
    truth = train_run(tmp_path, {"grad_probe": {"grad_level": "L2", "bounds": bounds}}, steps=2)
    rank0 = truth.run_dir / "rank0"
    with open(next(rank0.glob("grad_probe_0-*.csv")), newline="") as fh:
        header = next(csv.reader(fh))
    assert header == ["vpp_stage", "name", "step", "(-inf, -0.01]", "(-0.01, 0]", "(0, 0.002]", "(0.002, inf)",
                      "=0", "shape", "dtype"]
    first_line = next(rank0.glob("grad_probe_0-*.csv")).read_text().splitlines()[0]
    assert first_line.startswith('vpp_stage,name,step,"(-inf, -0.01]","(-0.01, 0]"')   # CSV-quoted labels
    probe = read_family(rank0, "grad_probe")
    assert len(probe) == 2 * len(truth.grads[0])
    for row in probe.itertuples(index=False):
        g = truth.grads[row.step][row.name]
        want = [c / g.numel() for c in counts_by_hand(g, bounds)]
        assert list(row[3:8]) == want, row.name
    reduced = read_family(rank0, "grad_reduced")           # L0: the statistics of the same grads
    for row in reduced.itertuples(index=False):
        g = truth.grads[row.step][row.name].double()
        assert row.norm == pytest.approx(g.norm().item(), rel=1e-5)
        assert row.max == g.max().item()
    directions = read_family(rank0, "grad_direction")
    for row in directions.itertuples(index=False):
        g = truth.grads[row.step][row.name]
        pos = direction_positions(row.name, tuple(g.shape))
        assert row.n == len(pos)
        words = [int(getattr(row, f"w{i}")) for i in range(32)]
        bits = [(words[i // 32] >> (i % 32)) & 1 for i in range(len(pos))]
        assert bits == [int(v > 0) for v in g.reshape(-1)[torch.from_numpy(pos)].tolist()], row.name


@pytest.mark.slow
def test_l1_records_only_the_listed_params_and_l0_only_statistics(tmp_path):
    truth = train_run(tmp_path / "l1", {"grad_probe": {"grad_level": "L1", "param_list": ["layers.1.mlp"]}},
                      steps=1)
    rank0 = truth.run_dir / "rank0"
    assert set(read_family(rank0, "grad_probe")["name"]) == {"layers.1.mlp.0.weight", "layers.1.mlp.0.bias",
                                                           "layers.1.mlp.2.weight", "layers.1.mlp.2.bias"}
    assert not list(rank0.glob("grad_direction_*"))
    truth = train_run(tmp_path / "l0", {"grad_probe": {"grad_level": "L0"}}, steps=1)
    rank0 = truth.run_dir / "rank0"
    assert sorted(p.name.split("_0-")[0] for p in rank0.glob("*_0-*")) == ["grad_reduced", "loss"]


def test_a_param_list_name_that_matches_nothing_is_one_config_error(tmp_path, make_config, output_root):
    from tests._support.probe_runs import SMALL

    cfg = make_config(grad_probe={"param_list": ["layers.0.mlp.0.weight", "layers.0.mpl", "nothing"]})
    with pytest.raises(ConfigError) as err:
        TrainerMon(cfg).set_monitor(TinyGPT(SMALL), optimizer=None)
    problems = [str(p) for p in err.value.problems]
    assert problems[0].startswith("grad_probe.param_list[1]: 'layers.0.mpl' matches no trainable parameter "
                                  "(selected by targets) of the model (did you mean 'layers.0.mlp'")
    assert problems[1:] == ["grad_probe.param_list[2]: 'nothing' matches no trainable parameter (selected by "
                            "targets) of the model"]


@pytest.mark.slow
def test_tensorboard_gets_the_interval_fractions_but_no_packed_sign_words(tmp_path):
    from tests.sinks.test_tensorboard import f32, load_scalars, tb_dir

    truth = train_run(tmp_path, {"grad_probe": {"grad_level": "L2"}, "format": ["csv", "tensorboard"],
                                "tensorboard": {"tags": "per_tensor"}}, steps=2)
    tags = load_scalars(tb_dir(truth.run_dir))
    assert tags and not [t for t in tags if t.startswith("grad_direction.")]
    probe = read_family(truth.run_dir / "rank0", "grad_probe")
    for label in interval_labels([-1, 0, 1]):
        for name, rows in probe.groupby("name"):
            got = tags[f"grad_probe.{label}/vp0:{name}"]
            assert got == [(int(s), f32(v)) for s, v in zip(rows["step"], rows[label])], (label, name)
