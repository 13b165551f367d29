"""The W&B sink against the real ``wandb`` package in offline mode, read back from what it stored.

wandb 0.31 ships no Python reader of its ``run-<id>.wandb`` files (the old ``datastore`` module left
with the Go core), so :func:`wandb_history` reads the file's documented framing (LevelDB log
records: 32 KiB blocks, 7-byte headers) and decodes each record with wandb's own protobuf
``Record``.  The truth is the CSV the same rows were written to, read with pandas.
"""

from __future__ import annotations

import json
import math
import struct
import time
from pathlib import Path

import pytest

from tests._support.runs import only_run_dir, read_family, trainmon_warnings
from trainmon.sinks import SinkOptions, create_sink
from trainmon.stats.rows import StatRow, StepRows

wandb = pytest.importorskip("wandb")
from trainmon.sinks.wandb import STEP_KEY, WandbSettings, WandbSink  # noqa: E402

OPS = ("norm", "mean", "max", "nans")
SPECIAL = (0.1 + 0.2, 1e-300, math.nan, math.inf, -math.inf, -0.0, 1 / 3)


@pytest.fixture
def offline(tmp_path, monkeypatch) -> Path:
    """W&B offline, everything under tmp_path; no user run left behind.  wandb reads its
    environment once per process (``wandb.setup``): ``wandb.teardown`` makes it read it again."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "trainmon-tests")
    wandb.teardown()
    yield tmp_path
    if wandb.run is not None:
        wandb.run.finish()
    wandb.teardown()


# -- reading back --------------------------------------------------------------------------------


def wandb_records(path: Path) -> list:
    """Every record of one ``.wandb`` file, decoded with wandb's protobuf."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, pending, out = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B", path
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + n], pos + 7 + n
        pending = chunk if kind in (1, 2) else pending + chunk  # FULL/FIRST start, MIDDLE/LAST add
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def offline_runs(root: Path, timeout: float = 60.0) -> dict[str, Path]:
    """run name -> its .wandb file, for every offline run under ``root``.  ``run.finish()`` returns
    before wandb's service has written the file out (seen under load: a 7-byte header alone), so
    each file is read once it holds its closing ``exit`` record."""
    runs = {}
    for path in root.glob("wandb/offline-run-*/run-*.wandb"):
        deadline = time.monotonic() + timeout
        while not any(r.WhichOneof("record_type") == "exit" for r in wandb_records(path)):
            assert time.monotonic() < deadline, f"{path}: no exit record after {timeout} s"
            time.sleep(0.1)
        names = [r.run.display_name for r in wandb_records(path) if r.WhichOneof("record_type") == "run"]
        runs[names[0]] = path
    return runs


def wandb_history(path: Path) -> list[dict[str, float]]:
    """The logged rows, in order: key -> value (JSON-decoded: NaN and Infinity included)."""
    rows = []
    for r in wandb_records(path):
        if r.WhichOneof("record_type") == "history":
            rows.append({".".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item})
    return rows


def logged_by_step(path: Path) -> dict[int, dict[str, float]]:
    """trainmon's rows by training step (``trainmon/step``), W&B's own keys dropped."""
    out: dict[int, dict[str, float]] = {}
    for row in wandb_history(path):
        if STEP_KEY in row:
            # trainmon's keys: <family>/<stat>/<name>; the user's own ("loss", "_step", ...) left out
            out.setdefault(int(row[STEP_KEY]), {}).update({k: v for k, v in row.items() if k.count("/") >= 2})
    return out


def csv_metrics(rank_dir: Path, families, ops_of) -> dict[int, dict[str, float]]:
    """What the sink should have logged, from the CSV alone: per step, per documented key, the
    value of the row (of the last micro-step, for per-micro-batch families)."""
    out: dict[int, dict[str, float]] = {}
    for family in families:
        df = read_family(rank_dir, family)
        if "micro_step" in df.columns:
            df = df.sort_values("micro_step", kind="stable")
        for row in df.to_dict("records"):
            vp = f":vp{row['vpp_stage']}" if row["vpp_stage"] else ""
            for op in ops_of(family):
                out.setdefault(int(row["step"]), {})[f"{family}/{op}/{row['name']}{vp}"] = float(row[op])
    return out


def assert_same(logged: dict, expected: dict) -> None:
    assert set(logged) == set(expected)
    for step, values in expected.items():
        got = {k: v for k, v in logged[step].items() if k != STEP_KEY}
        assert set(got) == set(values), step
        for key, want in values.items():
            if math.isnan(want):
                assert math.isnan(got[key]), key
            else:
                assert got[key] == pytest.approx(want, rel=1e-12, abs=0.0), key


# -- hand-built rows -----------------------------------------------------------------------------


def step_rows(step: int) -> StepRows:
    """grad_reduced (two names, one on vpp stage 1) and actv over two micro-steps, with values
    that stress precision and the specials."""
    rows = []
    for k, name in enumerate(["layers.0.weight", "layers.1.bias"]):
        stats = {op: SPECIAL[(k + j + step) % len(SPECIAL)] * (step + 1) for j, op in enumerate(OPS)}
        stats["nans"] = k + step
        rows.append(StatRow("grad_reduced", name, step, stats, (4, 2), "torch.float32", vpp_stage=k))
    for micro in (0, 1):
        stats = {op: (micro + 1) * 0.1 + step + j / 7 for j, op in enumerate(OPS)}
        rows.append(StatRow("actv", "layers.0.mlp.output", step, stats, (8,), "torch.float32", micro_step=micro))
    return StepRows.of(rows)


def patient(**kw) -> WandbSettings:
    """W&B settings with a close deadline for tests about what gets logged: on a loaded 2-core CI
    machine, starting W&B in the sink's child process can outlast the default 30 s."""
    return WandbSettings(**{"timeout_s": 180, **kw})


def write_steps(rank_dir: Path, steps, rank: int = 0, settings: WandbSettings | None = None):
    options = SinkOptions(rank_dir=rank_dir, rank=rank)
    wandb_sink = WandbSink(options, settings or patient())
    sink = create_sink("csv", options, extra_sinks=[wandb_sink])
    for step in steps:
        sink.write(step_rows(step), step)
    sink.close()
    return wandb_sink


@pytest.mark.slow
def test_every_logged_value_equals_the_csv_row(offline):
    rank_dir = offline / "run-20260101" / "rank0"
    sink = write_steps(rank_dir, range(4))
    assert sink.own_run and sink.failed is None
    path = offline_runs(offline)["run-20260101"]  # a run of its own, named after the run id
    expected = csv_metrics(rank_dir, ("grad_reduced", "actv"), lambda f: OPS)
    assert "grad_reduced/norm/layers.1.bias:vp1" in expected[0]
    assert_same(logged_by_step(path), expected)
    # logged with step=: W&B's own step is the training step
    assert [int(r["_step"]) for r in wandb_history(path)] == [0, 1, 2, 3]


@pytest.mark.slow
def test_every_rank_logs_its_own_run_in_one_group(offline):
    run_dir = offline / "run-xyz"
    write_steps(run_dir / "rank1", [0], rank=1)  # rank 0 only by default: nothing from rank 1
    assert offline_runs(offline) == {}
    write_steps(run_dir / "rank1", [0, 1], rank=1, settings=patient(all_ranks=True))
    path = offline_runs(offline)["run-xyz-rank1"]
    (run,) = [r.run for r in wandb_records(path) if r.WhichOneof("record_type") == "run"]
    assert run.run_group == "run-xyz"
    assert_same(logged_by_step(path), csv_metrics(run_dir / "rank1", ("grad_reduced", "actv"), lambda f: OPS))


@pytest.mark.slow
def test_the_users_run_is_reused_and_left_open(offline):
    user = wandb.init(name="users-run")
    user.log({"loss": 1.0}, step=0)
    rank_dir = offline / "run-a" / "rank0"
    sink = write_steps(rank_dir, range(4))
    assert not sink.own_run and sink.run is user
    assert wandb.run is user  # not finished: the user logs on
    user.log({"loss": 0.5}, step=3)
    user.log({"loss": 0.25}, step=4)
    user.finish()
    assert list(offline_runs(offline)) == ["users-run"]
    path = offline_runs(offline)["users-run"]
    assert_same(logged_by_step(path), csv_metrics(rank_dir, ("grad_reduced", "actv"), lambda f: OPS))
    assert [r["loss"] for r in wandb_history(path) if "loss" in r] == [1.0, 0.5, 0.25]


@pytest.mark.slow
def test_a_run_finished_under_it_is_one_warning_and_nothing_else_changes(offline, output_root, make_config):
    torch = pytest.importorskip("torch")
    from trainmon import TrainerMon
    from trainmon.testing.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches

    cfg = GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=1)
    user = wandb.init(name="users-run")
    model, reference = _twin_models(cfg, TinyGPT, torch)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    with trainmon_warnings() as warned:
        monitor = TrainerMon(make_config(format=["csv", "wandb"], wg_distribution=True, ops=["norm"]))
        monitor.set_monitor(model, optimizer=opts[0])
        for step, batch in enumerate(synthetic_batches(cfg, 2, 6, seed=1)):
            for m, opt in zip((model, reference), opts):
                m.loss(batch).backward()
                opt.step()
                opt.zero_grad()
            if step == 2:
                assert live_sink(WandbSink).wait_idle(30)  # it logs into the user's run by now
                user.finish()  # finished under the sink
        monitor.close()
    assert [w for w in warned if "W&B" in w and "off" in w] == [warned[0]]
    assert len([w for w in warned if "W&B" in w]) == 1, warned
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)  # training unchanged
    csv = read_family(only_run_dir(output_root) / "rank0", "grad_reduced")
    assert sorted(csv["step"].unique()) == list(range(6))  # the CSV lost nothing


def live_sink(cls):
    from trainmon.sinks.base import _LIVE_SINKS

    (sink,) = [s for s in _LIVE_SINKS if isinstance(s, cls) and not s._closed]
    return sink


def _twin_models(cfg, cls, torch):
    torch.manual_seed(0)
    a = cls(cfg)
    torch.manual_seed(0)
    return a, cls(cfg)


@pytest.mark.slow
def test_trainermon_logs_grads_and_the_last_micro_steps_activations(offline, output_root, make_config):
    torch = pytest.importorskip("torch")
    from trainmon import TrainerMon
    from trainmon.testing.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches

    cfg = GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=1)
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    config = make_config(
        format=["csv", "wandb"], wg_distribution=True, xy_distribution=True, all_xy=True, ops=list(OPS)
    )
    monitor = TrainerMon(config)
    monitor.set_monitor(model, optimizer=opt, grad_acc_steps=2)
    data = synthetic_batches(cfg, 2, 6, seed=1)
    for _ in range(3):
        for _ in range(2):
            model.loss(next(data)).backward()
        opt.step()
        opt.zero_grad()
    monitor.close()
    run_dir = only_run_dir(output_root)
    path = offline_runs(offline)[run_dir.name]
    families = ("grad_unreduced", "grad_reduced", "actv", "actv_grad")
    expected = csv_metrics(run_dir / "rank0", families, lambda f: OPS)
    assert any(k.startswith("actv/") for k in expected[0])
    assert_same(logged_by_step(path), expected)


# -- no W&B at all -------------------------------------------------------------------------------


class _Missing(WandbSink):
    package = "trainmon_no_such_package"


def test_a_missing_package_is_one_warning_and_the_csv_is_complete(tmp_path):
    options = SinkOptions(rank_dir=tmp_path / "run" / "rank0")
    with trainmon_warnings() as warned:
        missing = _Missing(options)
        sink = create_sink("csv", options, extra_sinks=[missing])
        for step in range(3):
            sink.write(step_rows(step), step)
        sink.close()
    assert len(warned) == 1 and "not installed" in warned[0] and warned[0].startswith("trainmon: W&B")
    assert missing._thread is None  # never started a thread
    assert sorted(read_family(options.rank_dir, "grad_reduced")["step"].unique()) == [0, 1, 2]


def test_other_ranks_do_nothing_by_default(tmp_path):
    sink = WandbSink(SinkOptions(rank_dir=tmp_path / "run" / "rank3", rank=3))
    sink.write(step_rows(0), 0)
    sink.close()
    assert sink._thread is None and sink.run is None


def test_settings_are_checked_with_the_key_named():
    with pytest.raises(
        ValueError, match=r"wandb\.families: unknown family 'grad_reduce' \(did you mean 'grad_reduced'"
    ):
        WandbSettings(families=["grad_reduce"])
    with pytest.raises(ValueError, match=r"wandb\.mode: 'onlin'"):
        WandbSettings(mode="onlin")
    with pytest.raises(ValueError, match=r"wandb\.max_metrics"):
        WandbSettings(max_metrics=0)
    with pytest.raises(ValueError, match=r"wandb\.reuse_run"):
        WandbSettings(reuse_run="yes")
    with pytest.raises(ValueError, match=r"wandb\.micro_steps"):
        WandbSettings(micro_steps="first")


@pytest.mark.slow
def test_format_wandb_without_the_package_is_a_config_error_at_attach(tmp_path):
    """As for parquet without pyarrow: the user learns at set-up, with the extra to install."""
    import subprocess
    import sys

    code = (
        "import sys, json; sys.modules['wandb'] = None\n"  # what find_spec sees without the package
        "from trainmon import TrainerMon, ConfigError\n"
        f"p = {str(tmp_path / 'c.json')!r}\n"
        "json.dump({'wg_distribution': True, 'format': ['csv', 'wandb']}, open(p, 'w'))\n"
        "try:\n    TrainerMon(p)\nexcept ConfigError as e:\n    print('ERR', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "MONITOR_OUTPUT_DIR": str(tmp_path / "out")},
    )
    assert "ERR" in out.stdout and "pip install trainmon[wandb]" in out.stdout, out.stdout + out.stderr


@pytest.mark.slow
def test_an_own_run_lives_in_a_child_process_and_a_killed_one_is_one_warning(offline):
    """A run of the sink's own is built and logged in a child process (W&B's Python per key never
    holds this process's GIL; its values read back: ``test_every_logged_value_equals_the_csv_row``),
    and killing that process mid-run costs one warning while the CSV keeps every step."""
    import os
    import signal

    from trainmon.sinks.wandb_run import ChildRun

    rank_dir = offline / "run-kill" / "rank0"
    options = SinkOptions(rank_dir=rank_dir)
    tracker = WandbSink(options, patient())
    sink = create_sink("csv", options, extra_sinks=[tracker])
    with trainmon_warnings() as warned:
        for step in range(5):
            sink.write(step_rows(step), step)
            if step == 1:
                sink.flush()
                assert tracker.wait_idle(120) and tracker.failed is None
                assert isinstance(tracker.run, ChildRun) and tracker.run.pid != os.getpid()
                parent = os.getpriority(os.PRIO_PROCESS, 0)  # background work: training first
                assert os.getpriority(os.PRIO_PROCESS, tracker.run.pid) == min(19, parent + 10)
                os.kill(tracker.run.pid, signal.SIGKILL)
                tracker.run.process.wait()
        sink.close()
    mine = [w for w in warned if "W&B" in w]
    assert len(mine) == 1 and "off for the rest of this run" in mine[0], warned
    assert sorted(read_family(rank_dir, "grad_reduced")["step"].unique()) == list(range(5))
