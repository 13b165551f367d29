"""Cross-rank checks and the anomaly scan on simulated data-parallel runs with injected faults.

The simulated runs (tests/_support/simulate.py) average grads by hand and record every family
from the tensors, so where each fault starts is known exactly.
"""
from __future__ import annotations

import pytest

from tests._support.simulate import (
    BLOW_PARAM,
    CORRUPT_PARAM,
    CORRUPT_RANK,
    FAULT_RANK,
    FAULT_STEP,
    named_run,
    row,
    write_run,
)
from trainmon.diagnosis.ranks import check_ranks
from trainmon.diagnosis.engine_buckets import load_table
from trainmon.diagnosis.scan import scan


def _where(x):
    return (x.step, x.kind, x.name, x.rank)


def test_healthy_run_is_consistent_and_quiet():
    table = load_table(named_run("healthy"))
    assert check_ranks(table) == []
    assert scan(table) == []


def test_nan_in_one_ranks_input():
    table = load_table(named_run("nan"))
    issues = check_ranks(table)
    first = (FAULT_STEP, "actv", "inp.output", FAULT_RANK)
    assert _where(issues[0]) == first and issues[0].check == "nonfinite_some_ranks"
    assert issues[0].micro_step == 0 and issues[0].phase == "forward"
    # only the faulty rank, only from the fault step, and every pre-reduce grad of that rank
    assert {i.rank for i in issues} == {FAULT_RANK} and min(i.step for i in issues) == FAULT_STEP
    pre = [i for i in issues if i.kind == "grad_unreduced"]
    assert len(pre) == 10
    found = scan(table)
    assert _where(found[0]) == first and found[0].rule == "nonfinite"
    assert all(a.step >= FAULT_STEP for a in found)


@pytest.mark.parametrize("name", ["blow", "blow3"])
def test_one_ranks_grad_blown_up(name):
    table = load_table(named_run(name))
    issues = check_ranks(table)
    want = (FAULT_STEP, "grad_unreduced", BLOW_PARAM, FAULT_RANK)
    assert [(_where(i), i.check) for i in issues] == [(want, "pre_reduce_outlier")]
    assert issues[0].value > 1e3 * issues[0].expected
    found = scan(table)
    assert _where(found[0]) == want and found[0].rule == "spike" and found[0].op == "norm"
    # the post-reduce grad carries it to every rank, later in the step
    post = [a for a in found if a.step == FAULT_STEP and a.kind == "grad_reduced"]
    assert {a.rank for a in post} == set(table.ranks) and {a.name for a in post} == {BLOW_PARAM}


@pytest.mark.parametrize("name", ["corrupt", "corrupt3"])
def test_one_ranks_reduced_grad_corrupted(name):
    table = load_table(named_run(name))
    issues = check_ranks(table)
    want = (FAULT_STEP, "grad_reduced", CORRUPT_PARAM, CORRUPT_RANK)
    assert _where(issues[0]) == want and issues[0].check == "post_reduce_mismatch"
    averaged = [i for i in issues if i.check == "reduce_average"]
    assert [_where(i) for i in averaged] == [want]
    assert averaged[0].value == pytest.approx(3 * averaged[0].expected, rel=1e-5)
    # before the fault every rank agreed
    assert min(i.step for i in issues) == FAULT_STEP
    # the corrupted rank's params drift from the others afterwards (replicated_mismatch)
    later = {i.kind for i in issues if i.check == "replicated_mismatch"}
    assert {"param_updated", "param_origin"} <= later


def test_reduce_sum_and_checks_selection(tmp_path):
    rows = []
    for rank, local in ((0, 1.0), (1, 3.0)):
        rows.append(row(rank, "grad_unreduced", "w", 0, stats={"norm": 2 * local, "mean": local}, shape=[4]))
        rows.append(row(rank, "grad_reduced", "w", 0, stats={"norm": 8.0, "mean": 4.0}, shape=[4]))
    table = load_table(write_run(tmp_path / "sum", rows))
    assert check_ranks(table, reduce="sum") == []
    mean = check_ranks(table, checks=["reduce_average"])
    assert [(i.rank, i.value, i.expected) for i in mean] == [(0, 4.0, 2.0), (1, 4.0, 2.0)]


def test_two_ranks_disagreeing_without_evidence_names_both(tmp_path):
    rows = [row(r, "grad_reduced", "w", 0, stats={"norm": 1.0 + r, "mean": 0.0}, shape=[4]) for r in (0, 1)]
    issues = check_ranks(load_table(write_run(tmp_path / "two", rows)))
    assert [(i.rank, i.check, i.ranks) for i in issues] == [(0, "post_reduce_mismatch", (0, 1)),
                                                            (1, "post_reduce_mismatch", (0, 1))]
