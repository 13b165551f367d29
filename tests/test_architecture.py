"""The layers stay layers: no import cycle between modules or between packages."""
from __future__ import annotations

import importlib.util
import sys

from tests._support.runs import REPO


def _tool():
    spec = importlib.util.spec_from_file_location("import_graph", REPO / "tools" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["import_graph"] = module
    spec.loader.exec_module(module)
    return module


def test_no_import_cycle_between_modules_or_layers():
    tool = _tool()
    modules, layers = tool.graph(by_layer=False), tool.graph(by_layer=True)
    assert "trainmon.runtime.session" in modules and "trainmon.core" in layers["trainmon.stats"]
    assert tool.find_cycle(modules) is None
    assert tool.find_cycle(layers) is None


def test_the_cycle_finder_finds_a_cycle():
    tool = _tool()
    assert tool.find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert tool.find_cycle({"a": {"b"}, "b": set()}) is None
