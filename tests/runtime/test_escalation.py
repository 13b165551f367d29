"""Escalation and the flight recorder, on real training: one process, dynamic mode, 4 gloo ranks.

Training: TinyGPT, SGD, one rank's grad gets a NaN at ``NAN_STEP`` (so its params and everything
after are NaN: the alert fires again after each window until ``max_times``).  The truth is a
second run of the same training with the merged config recorded every step (``reference``), and
a third run without any monitor for the bitwise check.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import pytest
import torch

from tests._support.distributed import run_distributed
from tests._support.runs import read_family, run_cli
from trainmon.output import runs
from trainmon.testing.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches

TINY = GPTConfig(vocab=16, seq=4, dim=8, heads=2, layers=1)
STEPS, NAN_STEP, WINDOW, TIMES, HISTORY = 16, 4, 3, 2, 2
BASE = {"wg_distribution": True, "ops": ["norm", "min", "nans"],
        "alert": {"rules": [{"rule_name": "AnomalyNan"}]}}
EXTRA = {"xy_distribution": True, "all_xy": True, "ops": ["norm", "max", "nans"]}
ESCALATING = {**BASE, "on_anomaly": {"config": EXTRA, "steps": WINDOW, "max_times": TIMES,
                                     "history_steps": HISTORY}}
REFERENCE = {**BASE, **EXTRA}
# alert at 4 -> window 5..7 (recorder wrote 2..4); base resumes at 8, alerts at 8 -> window 9..11
# (recorder wrote 8: it was held during the first window); max_times reached: nothing after 11.
WINDOWS = [(5, 7), (9, 11)]
HELD = [(2, 4), (8, 8)]
ACTV_STEPS = [2, 3, 4, 5, 6, 7, 8, 9, 10, 11]


def _train(out: Path | None, config: dict | None, nan_rank: int, rank: int, tmp: Path) -> list[torch.Tensor]:
    from trainmon import TrainerMon

    torch.manual_seed(rank)
    model = TinyGPT(TINY)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = None
    if config is not None:
        os.environ.update(MONITOR_OUTPUT_DIR=str(out), TRAINMON_RUN_ID="run")
        path = tmp / f"config_{out.name}_{rank}.json"
        path.write_text(json.dumps(config))
        mon = TrainerMon(path)
        mon.set_monitor(model, optimizer=opt)
    for step, batch in enumerate(synthetic_batches(model.cfg, 2, STEPS, seed=rank)):
        model.loss(batch).backward()
        if step == NAN_STEP and rank == nan_rank:
            next(model.parameters()).grad[0, 0] = float("nan")
        opt.step()
        opt.zero_grad()
    if mon is not None:
        mon.close()
    return [p.detach().clone() for p in model.parameters()]


def _three_runs(rank: int, world: int, tmp: str, nan_rank: int, dynamic: bool = False, fmt: str = "csv") -> bool:
    tmp_path = Path(tmp)
    on = {"dynamic_on": True, "format": [fmt]} if dynamic else {"format": [fmt]}
    watched = _train(tmp_path / "escalating", {**ESCALATING, **on}, nan_rank, rank, tmp_path)
    _train(tmp_path / "reference", {**REFERENCE, **on}, nan_rank, rank, tmp_path)
    plain = _train(None, None, nan_rank, rank, tmp_path)
    # bitwise, NaN included: compare the bits
    return all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(watched, plain))


def _rows(rank_dir: Path, family: str, steps=None) -> pd.DataFrame:
    df = read_family(rank_dir, family) if any(rank_dir.glob("*.csv")) else runs.read_family(rank_dir, family)
    if steps is not None:
        df = df[df["step"].isin(steps)]
    return df.sort_values(["step", *[c for c in ("micro_step",) if c in df], "name"], kind="stable"
                          ).reset_index(drop=True)


def _check_run(tmp_path: Path, world: int, nan_rank: int) -> None:
    run, ref = tmp_path / "escalating" / "run", tmp_path / "reference" / "run"
    meta = json.loads((run / "run.json").read_text())
    esc = meta["escalations"]
    assert [(e["first_step"], e["last_step"]) for e in esc] == WINDOWS
    assert [tuple(e["history"]) for e in esc] == HELD
    assert [(e["trigger"]["rank"], e["trigger"]["step"], e["trigger"]["rule"]) for e in esc] == [
        (nan_rank, NAN_STEP, "nonfinite"), (nan_rank, 8, "nonfinite")]
    assert [e["times"] for e in esc] == [1, 2] and all(e["config"] == EXTRA for e in esc)
    for rank in range(world):
        mine, truth = run / f"rank{rank}", ref / f"rank{rank}"
        for family in ("actv", "actv_grad"):
            got = _rows(mine, family)
            assert sorted(got["step"].unique()) == ACTV_STEPS, (rank, family)
            # the recorder's rows (2..4, 8) and the windows' rows equal an always-on run's, exactly
            pd.testing.assert_frame_equal(got, _rows(truth, family, ACTV_STEPS), check_exact=True)
        # the base families are complete and unchanged through the windows (window rows carry the
        # window's ops: compare the base's ops)
        for family in ("grad_unreduced", "grad_reduced"):
            got = _rows(mine, family)
            assert sorted(got["step"].unique()) == list(range(STEPS)), (rank, family)
            cols = ["step", "name", "norm", "nans"]
            pd.testing.assert_frame_equal(got[cols], _rows(truth, family)[cols], check_exact=True)


@pytest.mark.slow
@pytest.mark.parametrize(("dynamic", "fmt"), [(False, "csv"), (True, "csv"), (False, "parquet")],
                         ids=["static", "dynamic", "static-parquet"])
def test_a_nan_escalates_for_exactly_n_steps_at_most_k_times_with_the_rows_before_it(tmp_path, monkeypatch,
                                                                                    dynamic, fmt):
    """With Parquet, the flight recorder's held steps and the window's rows of one step window
    are written by two sinks at once: two files of the window, every row in one of them."""
    if fmt == "parquet":
        pytest.importorskip("pyarrow")
    if dynamic:
        monkeypatch.setenv("DYNAMIC_MONITOR", "1")
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))  # _train sets these per run; restored after
    monkeypatch.setenv("TRAINMON_RUN_ID", "run")
    assert _three_runs(0, 1, str(tmp_path), 0, dynamic, fmt), "training changed"
    _check_run(tmp_path, 1, nan_rank=0)
    if not dynamic and fmt == "csv":
        _check_anomalies_command(tmp_path / "escalating" / "run")


def _check_anomalies_command(run: Path) -> None:
    text = run_cli("anomalies", str(run), "--limit", "1")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    at = lines.index("escalations: 2")
    assert lines[at + 1].split() == ["#", "window", "history", "alert", "step", "rank", "rule", "kind", "name"]
    assert lines[at + 2].split()[:6] == ["1", "5..7", "2..4", "4", "0", "nonfinite"]
    assert lines[at + 3].split()[:6] == ["2", "9..11", "8..8", "8", "0", "nonfinite"]
    data = json.loads(run_cli("anomalies", str(run / "rank0"), "--json").stdout)
    assert [(e["first_step"], e["last_step"], e["trigger"]["step"]) for e in data["escalations"]] == [
        (5, 7, 4), (9, 11, 8)]


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_a_nan_on_one_of_four_ranks_escalates_every_rank_on_the_same_steps(tmp_path, dynamic):
    # dynamic: the escalation agrees over the dynamic driver's own gloo group; static: over its own
    env = {"DYNAMIC_MONITOR": "1", "TRAINMON_DYNAMIC_TIMEOUT": "60"} if dynamic else {}
    unchanged = run_distributed(_three_runs, 4, timeout=360, args=(str(tmp_path), 2, dynamic), env=env)
    assert unchanged == [True] * 4, "training changed"
    _check_run(tmp_path, 4, nan_rank=2)


def test_a_bad_dynamic_timeout_is_one_warning_naming_it_not_a_silent_default(monkeypatch, caplog):
    from trainmon.runtime.escalation import _timeout_s

    monkeypatch.setenv("TRAINMON_DYNAMIC_TIMEOUT", "abc")
    with caplog.at_level("WARNING", logger="trainmon"):
        assert _timeout_s() == 1800.0
    assert [r.getMessage() for r in caplog.records if "TRAINMON_DYNAMIC_TIMEOUT" in r.getMessage()] == [
        "trainmon: TRAINMON_DYNAMIC_TIMEOUT: 'abc' is not a number of seconds (finite number > 0); "
        "escalation waits the default 1800 s"
    ]
    monkeypatch.setenv("TRAINMON_DYNAMIC_TIMEOUT", "90")
    assert _timeout_s() == 90.0
