"""Reading run dirs into a flow-ordered table: layout, windows, header variants, comm, errors."""
from __future__ import annotations

import math

import pandas as pd
import pytest

from tests._support.simulate import row, write_run
from trainmon.analysis.flow import FLOW_KEYS, PHASES, phase_of
from trainmon.diagnosis.engine_buckets import load_table
from trainmon.diagnosis.reader import RunDirError, resolve_run_dir


def _stats(norm, mean=0.0):
    return {"norm": norm, "mean": mean, "nans": 0}


def test_rows_keep_file_order_within_a_step_and_families_sort_by_phase(tmp_path):
    run = tmp_path / "run"
    rows = []
    for step in range(4):
        # backward order for grad_unreduced, model order for grad_reduced
        for name in ("head.weight", "body.weight", "emb.weight"):
            rows.append(row(0, "grad_unreduced", name, step, stats=_stats(1.0 + step)))
        for name in ("emb.weight", "body.weight", "head.weight"):
            rows.append(row(0, "grad_reduced", name, step, stats=_stats(2.0 + step)))
        for m in range(2):
            for name in ("emb.output", "body.output"):
                rows.append(row(0, "actv", name, step, stats=_stats(3.0), micro_step=m))
    write_run(run, rows, steps_per_file=3)
    table = load_table(run)
    f = table.frame
    assert table.families == ("actv", "grad_unreduced", "grad_reduced")
    assert sorted(set(f["step"])) == [0, 1, 2, 3]          # windows 0-2 and 3-5 both read
    s1 = f[f["step"] == 1]
    assert list(s1["family"].unique()) == ["actv", "grad_unreduced", "grad_reduced"]
    assert list(s1[s1["family"] == "grad_unreduced"]["name"]) == ["head.weight", "body.weight", "emb.weight"]
    assert list(s1[s1["family"] == "actv"]["micro_step"]) == [0, 0, 1, 1]
    assert list(s1[s1["family"] == "actv"]["position"]) == [0, 1, 0, 1]
    assert (f[f["family"] == "grad_reduced"]["micro_step"] == -1).all()
    assert list(f.sort_values(list(FLOW_KEYS), kind="mergesort").index) == list(f.index)
    assert set(f["phase"]) == {"forward", "pre_reduce", "post_reduce"}
    assert [PHASES.index(phase_of(k)) for k in ("hyperparams", "actv", "actv_grad", "grad_unreduced", "comm",
                                                 "grad_reduced", "exp_avg")] == [0, 1, 2, 3, 4, 5, 6]


def test_exact_values_nonfinite_shapes_and_numel(tmp_path):
    run = tmp_path / "run"
    values = [1e-30, 0.1 + 0.2, 3.4e38, math.nan, math.inf, -math.inf]
    rows = [row(0, "grad_reduced", f"p{i}", 0, stats={"norm": v, "mean": 0.0}, shape=[4, 8])
            for i, v in enumerate(values)]
    write_run(run, rows)
    f = load_table(run).frame
    got = f["norm"].tolist()
    assert got[:3] == values[:3]                           # bit-exact round trip
    assert math.isnan(got[3]) and got[4] == math.inf and got[5] == -math.inf
    assert (f["numel"] == 32).all() and (f["shape"] == "[4, 8]").all()


def test_comm_extra_columns_and_repeated_names(tmp_path):
    run = tmp_path / "run"
    rows = []
    for call in range(3):
        rows.append(row(0, "comm", "all_reduce", 0, stats=_stats(float(call + 1)),
                        extra={"op": "all_reduce", "call": call, "phase": "pre"}))
    rows.append(row(0, "comm", "broadcast", 0, stats=_stats(5.0),
                    extra={"op": "broadcast", "call": 0, "phase": "pre"}))
    write_run(run, rows)
    table = load_table(run)
    f = table.family("comm")
    assert table.family_stats["comm"] == ("norm", "mean", "nans")
    # A comm row's own "phase" cell (an extra) does not replace the table's phase column.
    assert (f["phase"] == "comm").all()
    assert list(f["occurrence"]) == [0, 1, 2, 0]
    assert list(f["position"]) == [0, 1, 2, 3]


def test_header_variants_and_family_own_columns(tmp_path):
    run = tmp_path / "run"
    rank = run / "rank0"
    rank.mkdir(parents=True)
    pd.DataFrame({"vpp_stage": [0], "name": ["w"], "step": [0], "norm": [1.0], "shape": ["[2]"],
                  "dtype": ["torch.float32"]}).to_csv(rank / "grad_reduced_0-0.csv", index=False)
    pd.DataFrame({"vpp_stage": [0], "name": ["w"], "step": [0], "norm": [2.0], "std": [0.5],
                  "shape": ["[2]"], "dtype": ["torch.float32"]}).to_csv(rank / "grad_reduced_0-0.1.csv",
                                                                         index=False)
    pd.DataFrame({"vpp_stage": [0], "name": ["w"], "step": [0], "update_ratio": [0.01], "shape": ["[2]"],
                  "dtype": ["torch.float32"]}).to_csv(rank / "update_ratio_0-0.csv", index=False)
    (rank / "anomalies.jsonl").write_text("")
    (rank / "notes.txt").write_text("not a family")
    table = load_table(run)
    assert table.family_stats == {"grad_reduced": ("norm", "std"), "update_ratio": ("update_ratio",)}
    assert table.family("grad_reduced")["norm"].tolist() == [1.0, 2.0]
    assert table.family("update_ratio")["phase"].tolist() == ["optimizer"]


def test_run_dir_resolution(tmp_path):
    out = tmp_path / "monitor_output"
    write_run(out / "run_a", [row(r, "grad_reduced", "w", 0, stats=_stats(1.0)) for r in (0, 1, 10, 2)])
    assert resolve_run_dir(out) == out / "run_a"            # the only run of an output dir
    assert load_table(out).ranks == (0, 1, 2, 10)
    assert load_table(out / "run_a" / "rank10").ranks == (10,)    # one rank dir
    assert load_table(out, ranks=[1]).ranks == (1,)
    write_run(out / "run_b", [row(0, "grad_reduced", "w", 0, stats=_stats(1.0))])
    with pytest.raises(RunDirError, match=r"holds 2 runs \(run_a, run_b\); pass one of them"):
        resolve_run_dir(out)
    with pytest.raises(RunDirError, match="no such directory"):
        resolve_run_dir(tmp_path / "missing")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(RunDirError, match="not a directory"):
        resolve_run_dir(tmp_path / "file.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunDirError, match="no trainmon run here"):
        resolve_run_dir(tmp_path / "empty")
