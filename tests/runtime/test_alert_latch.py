"""The alert latch lives in runtime/, and the alert sink knows it only through a Protocol: the
sinks and runtime layers do not depend on diagnosis (tools/import_graph.py)."""

from __future__ import annotations

import importlib.util
import sys
import threading

from tests._support.runs import REPO
from trainmon.runtime.alert_latch import AlertLatch, Trigger


def _layers() -> dict[str, set[str]]:
    spec = importlib.util.spec_from_file_location("import_graph_for_latch", REPO / "tools" / "import_graph.py")
    tool = importlib.util.module_from_spec(spec)
    sys.modules["import_graph_for_latch"] = tool
    spec.loader.exec_module(tool)
    return tool.graph(by_layer=True)


def test_sinks_and_runtime_do_not_depend_on_diagnosis():
    layers = _layers()
    assert "trainmon.diagnosis" not in layers["trainmon.sinks"]
    assert "trainmon.diagnosis" not in layers["trainmon.runtime"]
    assert "trainmon.runtime" not in layers["trainmon.sinks"]  # the sink sees the latch as a Protocol


def test_the_latch_keeps_the_first_fire_as_a_trigger_and_wakes_a_waiter_from_another_thread():
    latch = AlertLatch()
    assert latch.fire(step=3, rank=1, rule="spike", kind="grad_reduced", name="w", op="norm") is True
    assert latch.fire(step=4, rank=1, rule="nonfinite", kind="actv", name="x", op="nans") is False
    assert latch.first == Trigger(step=3, rank=1, rule="spike", kind="grad_reduced", name="w", op="norm")
    assert latch.first.to_json() == {
        "step": 3,
        "rank": 1,
        "rule": "spike",
        "kind": "grad_reduced",
        "name": "w",
        "op": "norm",
    }
    writer = threading.Timer(0.05, latch.checked, args=(7,))
    writer.start()
    assert latch.wait_checked(7, 30)
    writer.join()
    latch.checked(5)  # an older step never moves the mark back
    assert latch.wait_checked(7, 0) and not latch.wait_checked(8, 0.01)
    latch.clear()
    assert latch.first is None
    assert latch.fire(step=9, rank=0, rule="spike", kind="actv", name="y", op="max") is True
