"""The run-time alert sink: same findings as the offline scan, JSONL crash safety, rate-limited
logs, settings from the real config loader, escalation."""
from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests._support.simulate import FAULT_RANK, FAULT_STEP, named_run
from trainmon.analysis.rules import COUNT_OPS, Anomaly, Rules, SpikeRule
from trainmon.config import parse_config
from trainmon.diagnosis.engine_buckets import load_table
from trainmon.diagnosis.scan import read_alert_files, scan
from trainmon.runtime.alert_latch import AlertLatch
from trainmon.sinks.alerts import ALERTS_FILE, AlertSettings, AlertSink
from trainmon.sinks.async_writer import AsyncSink
from trainmon.sinks.base import SinkOptions
from trainmon.stats.rows import StatRow, StepRows

REPO = Path(__file__).resolve().parents[2]


def _steps_of(table, rank):
    """The recorded rows of one rank as the StatRows each step handed to the sinks."""
    f = table.frame[table.frame["rank"] == rank].sort_values("step", kind="mergesort")
    ops = {fam: [(op, op in COUNT_OPS) for op in cols] for fam, cols in table.family_stats.items()}
    steps: dict[int, list[StatRow]] = {}
    for r in f.to_dict("records"):
        stats = {op: (int(r[op]) if count and r[op] == r[op] else float(r[op]))
                 for op, count in ops[r["family"]]}
        steps.setdefault(int(r["step"]), []).append(StatRow(
            r["family"], r["name"], int(r["step"]), stats, shape=(), dtype=r["dtype"],
            vpp_stage=int(r["vpp_stage"]), micro_step=None if r["micro_step"] < 0 else int(r["micro_step"])))
    yield from steps.items()


def _identity(a):
    return (a.step, a.kind, a.name, a.rank, a.micro_step, a.op, a.rule)


@pytest.mark.parametrize("name", ["nan", "blow"])
def test_sink_behind_the_writer_thread_finds_what_the_scan_finds(tmp_path, name):
    table = load_table(named_run(name))
    online = []
    for rank in table.ranks:
        sink = AsyncSink(AlertSink(SinkOptions(rank_dir=tmp_path / f"rank{rank}", rank=rank)))
        for step, rows in _steps_of(table, rank):
            sink.write(StepRows.of(rows), step)
        sink.close()
    online = read_alert_files(tmp_path)
    offline = scan(table)
    assert offline and sorted(map(_identity, online)) == sorted(map(_identity, offline))
    # each rank's file is in training-flow order and has the documented fields
    for rank in table.ranks:
        lines = [json.loads(x) for x in (tmp_path / f"rank{rank}" / ALERTS_FILE).read_text().splitlines()]
        parsed = [Anomaly.from_json(d) for d in lines]
        assert parsed == sorted(parsed, key=Anomaly.sort_key)
        assert set(lines[0]) == {"step", "phase", "kind", "name", "rank", "op", "value", "rule", "micro_step",
                                 "vpp_stage", "baseline", "source", "position", "occurrence", "time"}
    first = sorted(online, key=lambda a: a.sort_key())[0]
    assert (first.step, first.rank) == (FAULT_STEP, FAULT_RANK)


def test_healthy_rows_write_no_file(tmp_path):
    table = load_table(named_run("healthy"))
    sink = AlertSink(SinkOptions(rank_dir=tmp_path / "rank0"))
    for step, rows in _steps_of(table, 0):
        sink.write(StepRows.of(rows), step)
    sink.close()
    assert sink.count == 0 and not (tmp_path / "rank0" / ALERTS_FILE).exists()


def _nan_rows(step, n=8):
    # NaNs that grow every step: a NaN count equal at every step from the first is by design (a mask)
    return [StatRow("grad_reduced", f"p{i}", step, {"norm": math.nan, "nans": 3 + step}, (4,), "torch.float32")
            for i in range(n)]


def test_logs_once_per_name_and_rule_then_counts(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="trainmon.sinks.alerts")
    sink = AlertSink(SinkOptions(rank_dir=tmp_path, rank=3))
    for step in range(12):
        sink.write(StepRows.of(_nan_rows(step)), step)
    sink.close()
    messages = [r.getMessage() for r in caplog.records]
    firsts = [m for m in messages if m.startswith("trainmon alert: rank 3 step")]
    assert len([m for m in firsts if "grad_reduced p" in m]) == 5          # max_log_lines per step
    assert "rank 3 step 0: 3 more tensors alerted" in " ".join(messages)
    assert sum("p0 nonfinite: 10 alerts so far (latest at step 9)" in m for m in messages) == 1
    assert not any("p0" in m for m in messages if "step 1 " in m or "step 2 " in m)
    assert any("rank 3: 96 alerts on 8 (name, rule) pairs" in m for m in messages)
    lines = (tmp_path / ALERTS_FILE).read_text().splitlines()
    assert len(lines) == 96 and json.loads(lines[0])["value"] == 3


def test_killed_writer_leaves_whole_lines(tmp_path):
    script = textwrap.dedent(f"""
        import math, sys
        from pathlib import Path
        from trainmon.stats.rows import StatRow, StepRows
        from trainmon.sinks.alerts import AlertSink
        from trainmon.sinks.base import SinkOptions
        sink = AlertSink(SinkOptions(rank_dir=Path({str(tmp_path)!r})))
        step = 0
        while True:
            nans = {{"norm": math.nan, "nans": step + 1}}   # growing: not non-finite by design
            sink.write(StepRows.of([StatRow("grad_reduced", "layer.%d.weight" % i, step, nans,
                                (2,), "torch.float32") for i in range(200)]), step)
            if step == 20:
                print("ready", flush=True)
            step += 1
        """)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.3)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    text = (tmp_path / ALERTS_FILE).read_text()
    lines = text.splitlines()
    assert text.endswith("\n") and len(lines) >= 21 * 200
    steps = [json.loads(line)["step"] for line in lines]          # every line is whole JSON
    assert steps == sorted(steps) and set(steps) == set(range(steps[-1] + 1))
    assert len(steps) == 200 * (steps[-1] + 1)                    # whole steps only


def test_settings_from_the_config_loader():
    cfg = parse_config({"alert": {"rules": [{"rule_name": "AnomalyNan", "args": {"threshold": 100}},
                                            {"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}],
                                  "dump": True}}, "t.json")
    s = AlertSettings.from_alert_config(cfg.alert)
    assert s.rules == Rules(nonfinite=True, spike=SpikeRule(factor=1.5), threshold=100, ops=("norm",))
    nan_only = AlertSettings.from_alert_config(parse_config(
        {"alert": {"rules": [{"rule_name": "AnomalyNan"}]}}, "t.json").alert)
    assert nan_only.rules.spike is None and nan_only.rules.nonfinite
    # proposed extra args, read by name so the loader can grow them
    extended = AlertSettings.from_alert_config({"rules": [{"rule_name": "AnomalyTurbulence", "args": {
        "factor": 4, "floor": 1e-3, "warmup": 3, "window": 8, "ops": ["norm", "max"]}}]})
    assert extended.rules.spike == SpikeRule(4.0, 1e-3, 3, 8) and extended.rules.ops == ("norm", "max")


def test_the_alert_latch_holds_the_first_alert_written_on_the_writer_thread(tmp_path):
    latch = AlertLatch()
    sink = AsyncSink(AlertSink(SinkOptions(rank_dir=tmp_path, rank=2), AlertSettings(), latch=latch))
    assert latch.attached
    sink.write(StepRows.of([]), 4)                      # a healthy step is judged too
    assert latch.wait_checked(4, 30) and latch.first is None
    sink.write(StepRows.of(_nan_rows(5, n=2)), 5)
    sink.write(StepRows.of(_nan_rows(6, n=1)), 6)
    assert latch.wait_checked(6, 30)
    first = latch.first
    assert (first.step, first.rank, first.rule, first.kind, first.name, first.op) == (
        5, 2, "nonfinite", "grad_reduced", "p0", "nans")
    assert not latch.wait_checked(7, 0.05)              # step 7 was never written: no judging
    latch.clear()
    assert latch.first is None
    sink.close()
