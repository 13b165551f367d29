"""The MLflow sink against a real tracking server started here (``mlflow server`` with a SQLite
store on a free port), read back with ``MlflowClient.get_metric_history``; the truth is the CSV
the same rows were written to."""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests._support.runs import only_run_dir, read_family, trainmon_warnings
from trainmon.sinks import SinkOptions, create_sink
from trainmon.sinks.metrics import MetricKeys, MetricSettings, mlflow_key
from trainmon.stats.rows import StatRow, StepRows

OPS = ("norm", "mean", "max", "nans")
SPECIAL = (0.1 + 0.2, 1e-300, math.nan, math.inf, -math.inf, -0.0, 1 / 3)
FLOAT64_MAX = 1.7976931348623157e308  # what MLflow's SQL store keeps for +-inf


def patient(**kw):
    """MLflow settings with a close deadline for tests about what gets stored: a loaded 2-core CI
    machine took over the default 30 s to start MLflow's client and store in the sink's child
    process (imports, schema migrations), and the wait then ends with a warning before the run is
    finished. Tests of the deadline itself set their own."""
    from trainmon.sinks.mlflow import MlflowSettings

    return MlflowSettings(**{"timeout_s": 180, **kw})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``mlflow server`` in a process of its own (its own session, so that stopping it stops its
    workers too), answering on ``uri`` once started."""

    def __init__(self, root: Path):
        self.root = root
        self._start()

    def ensure(self) -> Server:
        """Started again (on a new port) if a test stopped it."""
        if self.proc.poll() is not None:
            self._start()
        return self

    def _start(self) -> None:
        root = self.root
        port = _free_port()
        self.uri = f"http://127.0.0.1:{port}"
        cmd = [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            f"sqlite:///{root / 'mlflow.db'}",
            "--default-artifact-root",
            str(root / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ]
        self.log = open(root / "server.log", "wb")  # noqa: SIM115 - open while the server runs
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )
        deadline = time.monotonic() + 120
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mlflow server did not start: {(root / 'server.log').read_text()[-2000:]}")
            time.sleep(0.2)

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.uri + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the group of the server this test started
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def server_process(tmp_path_factory):
    pytest.importorskip("mlflow")
    srv = Server(tmp_path_factory.mktemp("mlflow"))
    yield srv
    srv.stop()


@pytest.fixture
def server(server_process):
    """The module's server (a start takes 15-25 s on a loaded machine), started again if a test
    stopped it."""
    return server_process.ensure()


@pytest.fixture
def fast_failures(monkeypatch):
    """The user's environment for a quick verdict on a dead server (MLflow retries for minutes by
    default, on the sink's own thread)."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")


def step_rows(step: int) -> StepRows:
    rows = []
    for k, name in enumerate(["layers.0.weight", "layers.1.bias"]):
        stats = {op: SPECIAL[(k + j + step) % len(SPECIAL)] * (step + 1) for j, op in enumerate(OPS)}
        stats["nans"] = k + step
        rows.append(StatRow("grad_reduced", name, step, stats, (4, 2), "torch.float32", vpp_stage=k))
    for micro in (0, 1):
        stats = {op: (micro + 1) * 0.1 + step + j / 7 for j, op in enumerate(OPS)}
        rows.append(StatRow("actv", "layers.0.mlp.output", step, stats, (8,), "torch.float32", micro_step=micro))
    return StepRows.of(rows)


def csv_metrics(rank_dir: Path, families, ops) -> dict[str, dict[int, float]]:
    """key -> step -> value, from the CSV alone (last micro-step for per-micro-batch families)."""
    out: dict[str, dict[int, float]] = {}
    for family in families:
        df = read_family(rank_dir, family)
        if "micro_step" in df.columns:
            df = df.sort_values("micro_step", kind="stable")
        for row in df.to_dict("records"):
            vp = f":vp{row['vpp_stage']}" if row["vpp_stage"] else ""
            for op in ops:
                out.setdefault(f"{family}/{op}/{row['name']}{vp}", {})[int(row["step"])] = float(row[op])
    return out


def assert_logged(client, run_id: str, expected: dict[str, dict[int, float]]) -> None:
    logged = client.get_run(run_id).data.metrics
    assert set(logged) == set(expected)
    for key, by_step in expected.items():
        got = {m.step: m.value for m in client.get_metric_history(run_id, key)}
        assert set(got) == set(by_step), key
        for step, want in by_step.items():
            if math.isnan(want):
                assert math.isnan(got[step]), (key, step)
            elif math.isinf(want):
                assert got[step] == math.copysign(FLOAT64_MAX, want), (key, step)
            else:
                assert got[step] == pytest.approx(want, rel=1e-12, abs=0.0), (key, step)


def write_steps(rank_dir: Path, steps, settings=None):
    from trainmon.sinks.mlflow import MlflowSink

    options = SinkOptions(rank_dir=rank_dir)
    tracker = MlflowSink(options, settings or patient())
    sink = create_sink("csv", options, extra_sinks=[tracker])
    for step in steps:
        sink.write(step_rows(step), step)
    sink.close()
    return tracker


@pytest.mark.slow
def test_every_logged_value_equals_the_csv_row(server, tmp_path):
    from mlflow import MlflowClient

    from trainmon.sinks.mlflow_store import ChildStore

    rank_dir = tmp_path / "run-ml1" / "rank0"
    sink = write_steps(rank_dir, range(4), patient(tracking_uri=server.uri, experiment="trainmon-tests"))
    assert sink.failed is None and sink.own_run
    # the client's per-metric Python (requests built and serialised) runs in a process of its own
    assert isinstance(sink.store, ChildStore) and sink.store.pid != os.getpid()
    client = MlflowClient(server.uri)
    run = client.get_run(sink.mlflow_run_id)
    assert run.info.run_name == "run-ml1" and run.data.tags["trainmon.run_id"] == "run-ml1"
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "trainmon-tests"
    assert_logged(client, sink.mlflow_run_id, csv_metrics(rank_dir, ("grad_reduced", "actv"), OPS))


@pytest.mark.slow
def test_the_users_active_run_is_reused_and_left_running(server, tmp_path, monkeypatch):
    import mlflow
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    mlflow.set_tracking_uri(server.uri)
    with mlflow.start_run(run_name="users-run") as user:
        mlflow.log_metric("loss", 1.5, step=0)
        rank_dir = tmp_path / "run-ml2" / "rank0"
        sink = write_steps(rank_dir, range(3))
        assert sink.mlflow_run_id == user.info.run_id and not sink.own_run
        client = MlflowClient(server.uri)
        assert client.get_run(user.info.run_id).info.status == "RUNNING"  # the user's to end
    expected = csv_metrics(rank_dir, ("grad_reduced", "actv"), OPS)
    expected["loss"] = {0: 1.5}
    assert_logged(client, user.info.run_id, expected)


@pytest.mark.slow
def test_a_stopped_server_is_one_warning_and_nothing_else_is_lost(
    server, tmp_path, output_root, make_config, fast_failures
):
    import torch

    from trainmon import TrainerMon
    from trainmon.sinks.base import _LIVE_SINKS
    from trainmon.sinks.mlflow import MlflowSink
    from trainmon.testing.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches

    cfg = GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=1)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(TinyGPT(cfg))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    config = make_config(
        format=["csv", "mlflow"], wg_distribution=True, ops=list(OPS), mlflow={"tracking_uri": server.uri}
    )
    try:
        with trainmon_warnings() as warned:
            monitor = TrainerMon(config)
            monitor.set_monitor(models[0], optimizer=opts[0])
            for step, batch in enumerate(synthetic_batches(cfg, 2, 6, seed=1)):
                for m, opt in zip(models, opts):
                    m.loss(batch).backward()
                    opt.step()
                    opt.zero_grad()
                if step == 2:
                    (sink,) = [s for s in _LIVE_SINKS if isinstance(s, MlflowSink) and not s._closed]
                    assert sink.wait_idle(60) and sink.failed is None  # steps 0-2 are in MLflow
                    server.stop()
            monitor.close()
    finally:
        server.stop()
    mine = [w for w in warned if "MLflow" in w]
    assert len(mine) == 1 and "off for the rest of this run" in mine[0], warned
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)  # training unchanged
    csv = read_family(only_run_dir(output_root) / "rank0", "grad_reduced")
    assert sorted(csv["step"].unique()) == list(range(6))  # the CSV lost nothing


# -- keys (no server) ----------------------------------------------------------------------------


def test_mlflow_keys_keep_only_the_characters_it_accepts():
    assert mlflow_key("grad_reduced/norm/layers.0.weight") == "grad_reduced/norm/layers.0.weight"
    assert mlflow_key("grad_probe/(-inf, -1.0]/w") == "grad_probe/_-inf_ -1.0_/w"
    assert mlflow_key("comm/norm/x:call=all_reduce") == "comm/norm/x:call_all_reduce"
    assert mlflow_key("actv/norm//a/./b") == "actv/norm/_/a/_/b"  # no segment MLflow would normalise
    long = mlflow_key("grad/norm/" + "x" * 400)
    assert len(long) == 250 and long != mlflow_key("grad/norm/" + "x" * 399 + "y")


def test_keys_that_one_spelling_would_merge_stay_apart():
    keys = MetricKeys(MetricSettings(), "MLflow", mlflow_key)
    rows = [StatRow("grad_reduced", name, 0, {"norm": float(i)}) for i, name in enumerate(["a(b)", "a[b]", "a_b_"])]
    assert keys.metrics(StepRows.of(rows).blocks()) == {
        "grad_reduced/norm/a_b_": 0.0,
        "grad_reduced/norm/a_b__2": 1.0,
        "grad_reduced/norm/a_b__3": 2.0,
    }


# -- a local store: MLflow's database work in a child process -------------------------------------


@pytest.mark.slow
def test_a_sqlite_store_is_written_from_a_child_process_with_the_csv_values(tmp_path):
    """``sqlite:///`` store: the database work runs in another process (its SQLAlchemy time never
    holds this process's GIL), and what it stored equals the CSV, read back with MLflow's client."""
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    from trainmon.sinks.mlflow_store import ChildStore

    uri = f"sqlite:///{tmp_path / 'local.db'}"
    rank_dir = tmp_path / "run-ml3" / "rank0"
    sink = write_steps(rank_dir, range(3), patient(tracking_uri=uri, experiment="local"))
    assert sink.failed is None and sink.own_run
    assert isinstance(sink.store, ChildStore) and sink.store.pid != os.getpid()
    assert sink.store.process.poll() == 0  # closed with the sink, exited cleanly
    client = MlflowClient(uri)
    assert client.get_run(sink.mlflow_run_id).info.status == "FINISHED"
    assert_logged(client, sink.mlflow_run_id, csv_metrics(rank_dir, ("grad_reduced", "actv"), OPS))


@pytest.mark.slow
def test_a_killed_store_process_is_one_warning_and_the_csv_keeps_every_step(tmp_path):
    pytest.importorskip("mlflow")
    from trainmon.sinks.mlflow import MlflowSink

    rank_dir = tmp_path / "run-ml4" / "rank0"
    options = SinkOptions(rank_dir=rank_dir)
    tracker = MlflowSink(options, patient(tracking_uri=f"sqlite:///{tmp_path / 'k.db'}"))
    sink = create_sink("csv", options, extra_sinks=[tracker])
    with trainmon_warnings() as warned:
        for step in range(5):
            sink.write(step_rows(step), step)
            if step == 1:
                sink.flush()
                assert tracker.wait_idle(120) and tracker.failed is None
                # background work: the store yields the CPU to training
                parent = os.getpriority(os.PRIO_PROCESS, 0)
                assert os.getpriority(os.PRIO_PROCESS, tracker.store.pid) == min(19, parent + 10)
                os.kill(tracker.store.pid, signal.SIGKILL)
                tracker.store.process.wait()
        sink.close()
    mine = [w for w in warned if "MLflow" in w]
    assert len(mine) == 1 and "off for the rest of this run" in mine[0], warned
    assert sorted(read_family(rank_dir, "grad_reduced")["step"].unique()) == list(range(5))


def _stored(client, run_id: str, keys) -> tuple[dict, dict]:
    """What MLflow's client reads back: each key's history and the run's latest values."""
    history = {
        k: sorted((m.step, m.timestamp, repr(m.value)) for m in client.get_metric_history(run_id, k)) for k in keys
    }
    return history, {k: repr(v) for k, v in client.get_run(run_id).data.metrics.items()}


@pytest.mark.slow
def test_the_sqlite_bulk_writer_stores_what_mlflows_own_log_batch_stores(tmp_path):
    """The same steps through ``SqliteMetricWriter`` and through ``MlflowClient.log_batch`` (the
    truth) read back the same: every value (NaN, +-inf, -0.0, tiny), the latest value per key with
    steps out of order and a key the user logged at a later step first, a step over MLflow's 1,000
    metrics per request; a repeated row and a deleted run go to MLflow's own path and its rules."""
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    from trainmon.sinks.mlflow_store import InProcessStore, SqliteMetricWriter

    keys = [f"grad_reduced/norm/layers.{i}.weight" for i in range(1200)]
    steps = [
        [(k, SPECIAL[(i + s) % len(SPECIAL)] * (s + 1), 1_700_000_000_000 + s, s) for i, k in enumerate(keys)]
        for s in (0, 3, 1, 2)  # step 1 after step 3: the latest value stays step 3's
    ]
    read = []
    for bulk in (True, False):
        uri = f"sqlite:///{tmp_path / f'bulk{bulk}.db'}"
        store = InProcessStore(uri)
        assert isinstance(store.bulk, SqliteMetricWriter)
        if not bulk:
            store.bulk = None
        client = MlflowClient(uri)
        run_id = store.create_run(store.experiment_id("e"), "r", {})
        client.log_metric(run_id, keys[7], 5.0, timestamp=1_700_000_000_099, step=99)  # the user's own later value
        for rows in steps:
            store.log_batch(run_id, rows)
        store.log_batch(run_id, steps[1][:10])  # the same rows again: MLflow skips them
        assert store.bulk is None  # MLflow's own path from the first row it had to judge
        read.append(_stored(client, run_id, keys))
    assert read[0] == read[1]
    history, latest = read[0]
    assert latest[keys[7]] == "5.0" and len(history[keys[0]]) == 4
    assert latest[keys[4]] == repr(SPECIAL[(4 + 3) % len(SPECIAL)] * 4)  # step 3's, not step 2's

    store = InProcessStore(f"sqlite:///{tmp_path / 'deleted.db'}")
    run_id = store.create_run(store.experiment_id("e"), "r", {})
    MlflowClient(f"sqlite:///{tmp_path / 'deleted.db'}").delete_run(run_id)
    assert store.bulk is not None and store.bulk.write(run_id, steps[0]) is False  # nothing stored
    with pytest.raises(Exception, match="must be in the 'active' state"):
        store.log_batch(run_id, steps[0])  # MLflow's own refusal


def _commits(db: Path) -> int:
    """SQLite's file change counter (header bytes 24-27): one more per committed write transaction."""
    return int.from_bytes(db.read_bytes()[24:28], "big")


@pytest.mark.slow
def test_steps_within_send_every_s_are_one_sqlite_transaction_and_none_waits_longer(tmp_path):
    """Six steps handed over at once: six commits with ``send_every_s: 0``, one with a long
    ``send_every_s`` (the rest of the run's commits are the same), every value equal to the CSV's
    either way; and a last step with no step after it is sent once ``send_every_s`` has passed,
    without waiting for close."""
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient


    commits = {}
    for every in (0, 3600):
        db = tmp_path / f"every{every}.db"
        rank_dir = tmp_path / f"run-every{every}" / "rank0"
        sink = write_steps(rank_dir, range(6), patient(tracking_uri=f"sqlite:///{db}", send_every_s=every))
        assert sink.failed is None
        expected = csv_metrics(rank_dir, ("grad_reduced", "actv"), OPS)
        assert_logged(MlflowClient(f"sqlite:///{db}"), sink.mlflow_run_id, expected)
        commits[every] = _commits(db)
    assert commits[0] - commits[3600] == 5

    from trainmon.sinks.mlflow import MlflowSink

    db = tmp_path / "timer.db"
    options = SinkOptions(rank_dir=tmp_path / "run-timer" / "rank0")
    tracker = MlflowSink(options, patient(tracking_uri=f"sqlite:///{db}", send_every_s=0.3))
    sink = create_sink("csv", options, extra_sinks=[tracker])
    sink.write(step_rows(0), 0)
    sink.flush()
    assert tracker.wait_idle(60)  # sent by the timer: close has not been called
    client = MlflowClient(f"sqlite:///{db}")
    history = client.get_metric_history(tracker.mlflow_run_id, "grad_reduced/norm/layers.0.weight")
    assert [m.step for m in history] == [0]
    sink.close()


@pytest.mark.slow
def test_a_users_run_found_at_the_first_step_gets_the_held_steps_after_it_ended(tmp_path, monkeypatch):
    """The HF Trainer's MLflow callback ends its run at ``on_train_end``, before trainmon's
    ``close`` sends the last held steps: the run is looked up when the first step arrives, so
    every step goes into the user's run and no run of trainmon's own is made."""
    mlflow = pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    from trainmon.sinks.mlflow import MlflowSink

    uri = f"sqlite:///{tmp_path / 'user.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    rank_dir = tmp_path / "run-ml5" / "rank0"
    options = SinkOptions(rank_dir=rank_dir)
    tracker = MlflowSink(options, patient(send_every_s=3600))
    sink = create_sink("csv", options, extra_sinks=[tracker])
    with mlflow.start_run(run_name="trainer-run") as user:
        for step in range(3):
            sink.write(step_rows(step), step)
        sink.flush()
        deadline = time.monotonic() + 60
        while tracker.mlflow_run_id is None and time.monotonic() < deadline:
            time.sleep(0.05)
    sink.close()  # after the user's run ended
    assert tracker.failed is None and tracker.mlflow_run_id == user.info.run_id and not tracker.own_run
    client = MlflowClient(uri)
    assert len(client.search_runs([user.info.experiment_id])) == 1
    assert_logged(client, user.info.run_id, csv_metrics(rank_dir, ("grad_reduced", "actv"), OPS))
