"""AsyncSink / FanoutSink / create_sink with real inner sinks, real threads and real processes."""

from __future__ import annotations

import io
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

from trainmon.sinks import NullSink, Sink, SinkOptions, available_formats, create_sink
from trainmon.sinks.async_writer import AsyncSink, FanoutSink
from trainmon.sinks.csv import CsvSink
from trainmon.stats.rows import StatRow, StepRows

REPO = Path(__file__).resolve().parents[2]
LOGGER = "trainmon.sinks.async_writer"


class ListSink(Sink):
    """A real sink that keeps what it is given in memory, optionally gated by an Event."""

    def __init__(self, gate: threading.Event | None = None, fail_steps=(), delay=0.0):
        super().__init__(SinkOptions(rank_dir=Path(".")))
        self.gate, self.fail_steps, self.delay = gate, set(fail_steps), delay
        self.events: list = []
        self.entered = threading.Semaphore(0)  # released each time write() starts
        self.thread_names: set[str] = set()

    def write(self, rows, step):
        self.thread_names.add(threading.current_thread().name)
        self.entered.release()
        if self.gate is not None:
            self.gate.wait()
        if self.delay:
            time.sleep(self.delay)
        if step in self.fail_steps:
            raise RuntimeError(f"inner sink broke at step {step}")
        self.events.append(("write", step, [r.name for r in rows]))

    def flush(self):
        self.events.append(("flush",))

    def close(self):
        self.events.append(("close",))

    def steps(self):
        return [e[1] for e in self.events if e[0] == "write"]


def _rows(step, n=3):
    return [
        StatRow("grad_reduced", f"p{i}", step, {"norm": float(step * 10 + i)}, (2,), "torch.float32") for i in range(n)
    ]


def _in_thread(fn, *args) -> threading.Thread:
    t = threading.Thread(target=fn, args=args, daemon=True)
    t.start()
    return t


def test_order_preserved_and_off_thread():
    inner = ListSink(delay=0.001)
    sink = AsyncSink(inner, max_pending_steps=4)
    for step in range(50):
        sink.write(StepRows.of(_rows(step)), step)
    sink.close()
    assert inner.steps() == list(range(50))
    assert inner.events[1][2] == ["p0", "p1", "p2"]
    assert inner.thread_names == {"trainmon-writer"}
    assert inner.events[-1] == ("close",)


def test_write_returns_while_inner_is_stuck():
    gate = threading.Event()
    inner = ListSink(gate=gate)
    sink = AsyncSink(inner, max_pending_steps=16)
    producer = _in_thread(lambda: [sink.write(StepRows.of(_rows(s)), s) for s in range(10)])
    producer.join(timeout=5)
    assert not producer.is_alive()  # all ten writes returned although inner has written none
    assert inner.steps() == []
    gate.set()
    sink.flush()
    assert inner.steps() == list(range(10))
    sink.close()


def test_backpressure_blocks_instead_of_dropping(caplog):
    gate = threading.Event()
    inner = ListSink(gate=gate)
    sink = AsyncSink(inner, max_pending_steps=2)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        producer = _in_thread(lambda: [sink.write(StepRows.of(_rows(s)), s) for s in range(10)])
        assert inner.entered.acquire(timeout=5)  # the writer holds step 0
        producer.join(timeout=0.3)
        assert producer.is_alive()  # queue of 2 is full: write() waits
        assert sink.pending_steps == 2
        gate.set()
        producer.join(timeout=5)
        assert not producer.is_alive()
    sink.flush()
    assert inner.steps() == list(range(10))  # nothing dropped
    assert sum("behind" in r.getMessage() for r in caplog.records) == 1
    sink.close()


def test_flush_waits_for_queued_writes_then_flushes_inner():
    inner = ListSink(delay=0.02)
    sink = AsyncSink(inner)
    for step in range(5):
        sink.write(StepRows.of(_rows(step)), step)
    sink.flush()
    assert [e[0] for e in inner.events] == ["write"] * 5 + ["flush"]
    sink.write(StepRows.of(_rows(5)), 5)
    sink.flush()
    assert inner.steps() == list(range(6)) and inner.events[-1] == ("flush",)
    sink.close()


def test_flush_interval_flushes_when_idle():
    inner = ListSink()
    sink = AsyncSink(inner, flush_interval_s=0.02)
    sink.write(StepRows.of(_rows(0)), 0)
    deadline = time.monotonic() + 5
    while ("flush",) not in inner.events and time.monotonic() < deadline:
        time.sleep(0.01)
    assert inner.events[:2] == [("write", 0, ["p0", "p1", "p2"]), ("flush",)]
    time.sleep(0.1)
    assert inner.events.count(("flush",)) == 1  # idle and clean: no more flushes
    sink.close()


def test_inner_exception_logged_once_and_writing_goes_on(caplog):
    inner = ListSink(fail_steps={2, 4, 5})
    sink = AsyncSink(inner)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for step in range(8):
            sink.write(StepRows.of(_rows(step)), step)
        sink.flush()
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and errors[0].exc_info is not None
        assert "inner sink broke at step 2" in str(errors[0].exc_info[1])
        assert inner.steps() == [0, 1, 3, 6, 7]
        sink.close()
    assert "failed 3 time(s)" in caplog.records[-1].getMessage()


def test_close_idempotent_and_write_after_close():
    inner = ListSink()
    sink = AsyncSink(inner)
    sink.write(StepRows.of(_rows(0)), 0)
    sink.close()
    sink.close()
    assert inner.events.count(("close",)) == 1
    assert not sink._thread.is_alive()
    sink.write(StepRows.of(_rows(1)), 1)  # late rows are written directly, not lost
    assert inner.steps() == [0, 1]


def test_fanout_isolates_failing_sink(caplog):
    class Broken(ListSink):
        def write(self, rows, step):
            raise OSError("broken sink")

    good, bad = ListSink(), Broken()
    fan = FanoutSink([bad, good])
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        for step in range(3):
            fan.write(StepRows.of(_rows(step)), step)
        fan.flush()
        fan.close()
    assert good.steps() == [0, 1, 2] and good.events[-2:] == [("flush",), ("close",)]
    assert bad.events == [("flush",), ("close",)]
    assert sum(r.levelno == logging.ERROR for r in caplog.records) == 1


def test_create_sink_writes_csv(tmp_path):
    assert "csv" in available_formats()
    options = SinkOptions(rank_dir=tmp_path / "rank0", step_count_per_record=2)
    sink = create_sink(["csv"], options)
    assert isinstance(sink, AsyncSink) and isinstance(sink.inner, FanoutSink)
    assert isinstance(sink.inner.sinks[0], CsvSink)
    for step in range(4):
        sink.write(StepRows.of(_rows(step)), step)
    sink.close()
    df = pd.concat([pd.read_csv(tmp_path / "rank0" / f) for f in ("grad_reduced_0-1.csv", "grad_reduced_2-3.csv")])
    assert df["norm"].tolist() == [float(s * 10 + i) for s in range(4) for i in range(3)]
    assert isinstance(create_sink([], options), NullSink)
    assert isinstance(create_sink("csv", options, threaded=False), FanoutSink)


def test_create_sink_unknown_format(tmp_path):
    with pytest.raises(ValueError, match=r"unknown output format 'parket'.*csv"):
        create_sink(["csv", "parket"], SinkOptions(rank_dir=tmp_path))


def test_available_formats_only_lists_importable():
    import importlib

    names = available_formats()
    assert "csv" in names
    try:
        importlib.import_module("trainmon.sinks.tensorboard")
    except ImportError:
        assert "tensorboard" not in names
    else:
        assert "tensorboard" in names


def test_forked_child_never_waits_on_parent_writer():
    inner = ListSink()
    sink = AsyncSink(inner)
    sink.write(StepRows.of(_rows(0)), 0)
    pid = os.fork()
    if pid == 0:  # child: close must return at once (no writer thread here)
        try:
            sink.close()
            sink.write(StepRows.of(_rows(9)), 9)
            os._exit(0 if 9 not in inner.steps() else 3)  # the child records nothing
        finally:
            os._exit(4)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.01)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("forked child hung in close()")
    assert os.waitstatus_to_exitcode(status) == 0
    sink.close()
    assert 9 not in inner.steps()  # the child's rows went to the child's copy only


_EXIT_SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    from trainmon.stats.rows import StatRow, StepRows
    from trainmon.sinks import SinkOptions, create_sink

    sink = create_sink(["csv"], SinkOptions(rank_dir=Path(sys.argv[1]), step_count_per_record=1000))
    for step in range(300):
        sink.write(StepRows.of([StatRow("actv", f"m{i}.output", step, {"norm": step + i / 7}, (2, 2),
                            "torch.float32", micro_step=0) for i in range(50)]), step)
    # no close(): the atexit hook must still write everything queued
""")


def test_atexit_writes_everything_queued(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(tmp_path)], env=env, check=True, timeout=60)
    df = pd.read_csv(tmp_path / "actv_0-999.csv")
    assert len(df) == 300 * 50
    assert df["step"].tolist() == [s for s in range(300) for _ in range(50)]
    assert df["norm"].tolist() == [s + i / 7 for s in range(300) for i in range(50)]


_KILL_SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    from trainmon.stats.rows import StatRow, StepRows
    from trainmon.sinks import SinkOptions
    from trainmon.sinks.async_writer import AsyncSink
    from trainmon.sinks.csv import CsvSink

    sink = AsyncSink(CsvSink(SinkOptions(rank_dir=Path(sys.argv[1]), step_count_per_record=5)),
                     max_pending_steps=8)
    families = ["grad_reduced", "param_updated", "exp_avg_sq", "actv"]
    step = 0
    while True:
        rows = [StatRow(f, f"decoder.layers.{i}.mlp.weight", step, {"norm": step / 3 + i, "max": 1e-30 * i},
                        (i + 1, 64), "torch.bfloat16", micro_step=0 if f == "actv" else None)
                for f in families for i in range(150)]
        sink.write(StepRows.of(rows), step)
        if step % 10 == 0:
            print(step, flush=True)
        step += 1
""")


def test_sigkill_mid_run_leaves_whole_contiguous_steps(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILL_SCRIPT, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        for line in proc.stdout:
            if int(line) >= 60:
                break
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL

    by_family: dict[str, list[int]] = {}
    for path in sorted(tmp_path.glob("*.csv")):
        data = path.read_bytes()
        # The one documented exception (docs/output_files.md): a kill that lands while the kernel
        # copies one large write can cut it, leaving a last line without its newline, which the
        # readers leave out.  Everything before the last newline is whole rows.
        cut = not data.endswith(b"\n")
        df = pd.read_csv(io.BytesIO(data[: data.rfind(b"\n") + 1]))
        assert df.notna().all().all(), path  # no partial rows
        assert list(df.columns[-2:]) == ["shape", "dtype"]
        sizes = df.groupby("step").size()
        whole = sizes.iloc[:-1] if cut else sizes  # a cut write can leave its step short
        assert (whole == 150).all() and (sizes <= 150).all(), path
        family, window = path.stem.rsplit("_", 1)
        a, b = map(int, window.split("-"))
        assert sizes.index.min() == a and sizes.index.max() <= b
        by_family.setdefault(family, []).extend(sizes.index)
    assert sorted(by_family) == ["actv", "exp_avg_sq", "grad_reduced", "param_updated"]
    tops = []
    for family, steps in by_family.items():
        assert sorted(steps) == list(range(max(steps) + 1)), family  # contiguous from step 0
        tops.append(max(steps))
    assert max(tops) - min(tops) <= 1  # the kill can split only the step being written
    assert min(tops) >= 40


def test_write_runs_one_python_frame_on_the_calling_thread():
    """The training thread's share of a step's output is ``write`` itself: the queue is C code
    (counted with ``sys.setprofile``, which sees every Python call on this thread)."""
    inner = ListSink()
    sink = AsyncSink(inner, max_pending_steps=64)
    rows = StepRows.of(_rows(0))
    calls = []

    def profile(frame, event, _arg):
        if event == "call":
            calls.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        for step in range(5):
            sink.write(rows, step)
    finally:
        sys.setprofile(None)
    sink.close()
    assert calls == ["write"] * 5
    assert inner.steps() == list(range(5))
