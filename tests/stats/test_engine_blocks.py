"""The engine's step buffer and columnar blocks: growth, merging of consecutive captures, order."""
from __future__ import annotations

import threading

import pytest
import torch

from tests._support.runs import reference_stats
from trainmon.stats.rows import StepRows
from trainmon.stats.engine import StatsEngine, Tracked

OPS = ["norm", "mean", "min", "max"]


@pytest.fixture(params=["1", "0"], ids=["fused", "eager"])
def engine(request, monkeypatch):
    monkeypatch.setenv("TRAINMON_FUSED_CPU", request.param)
    return StatsEngine(OPS)


def test_thousands_of_rows_grow_the_step_buffer_without_losing_any(engine):
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(int(n), generator=g) for n in torch.randint(1, 50, (3000,), generator=g)]
    for k in range(0, 3000, 700):  # several captures, the buffer grows between them
        engine.capture("x", [Tracked(f"t{i}", t) for i, t in enumerate(tensors[k:k + 700], k)])
    rows = engine.finish_step(3)
    assert [r.name for r in rows] == [f"t{i}" for i in range(3000)]
    for r, t in zip(rows, tensors):
        want = reference_stats(t)
        assert all(r.stats[op] == pytest.approx(want[op], rel=1e-5, abs=1e-6) for op in OPS), r.name
    # the buffer is reused: the next step starts empty and is right too
    engine.capture("x", [Tracked("again", tensors[5])])
    (row,) = engine.finish_step(4)
    assert row.stats["max"] == pytest.approx(reference_stats(tensors[5])["max"])


def test_consecutive_captures_with_one_layout_are_one_block(engine):
    a, b, c = torch.ones(3), torch.arange(4.0), torch.full((2,), -2.0)
    engine.capture_tensors("actv", 0, ["m.input", "m.output"], [a, b], engine.partials([a, b]), micro_step=0)
    engine.capture_tensors("actv", 0, ["n.output"], [c], engine.partials([c]), micro_step=0)
    engine.capture_tensors("actv", 0, ["m.input"], [a], engine.partials([a]), micro_step=1)
    engine.capture("grad_reduced", [Tracked("w", b)])
    lazy = engine.finish_step(7)
    assert isinstance(lazy, StepRows) and "unbuilt" in repr(lazy)
    blocks = lazy.blocks()
    assert [(bl.family, bl.micro_step, bl.names) for bl in blocks] == [
        ("actv", 0, ["m.input", "m.output", "n.output"]), ("actv", 1, ["m.input"]), ("grad_reduced", None, ["w"])]
    rows = list(lazy)
    assert [(r.name, r.micro_step, r.step) for r in rows] == [
        ("m.input", 0, 7), ("m.output", 0, 7), ("n.output", 0, 7), ("m.input", 1, 7), ("w", None, 7)]
    assert rows[2].stats == {"norm": pytest.approx(8 ** 0.5), "mean": -2.0, "min": -2.0, "max": -2.0}


def test_captures_from_two_threads_keep_their_own_rows(engine):
    """Autograd runs accelerator work on device threads: CPU rows captured there must not
    collide with the main thread's in the shared step buffer."""
    def capture(prefix: str, value: float) -> None:
        for i in range(300):
            engine.capture("x", [Tracked(f"{prefix}{i}", torch.full((64,), value))])

    threads = [threading.Thread(target=capture, args=(p, v)) for p, v in (("a", 1.0), ("b", 2.0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows = engine.finish_step(0)
    assert len(rows) == 600
    assert all(r.stats["max"] == (1.0 if r.name[0] == "a" else 2.0) for r in rows)
