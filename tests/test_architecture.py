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


def _tree_in_the_page() -> set[str]:
    """Module paths listed in docs/architecture.md's tree (``trainmon/...py``)."""
    import re

    text = (REPO / "docs" / "architecture.md").read_text()
    block = text.split("## The tree", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    listed: set[str] = set()
    folders: list[tuple[int, str]] = []  # (indent, folder) of the enclosing folders
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        entry = r"(?:[\w.]+\.py|[\w.]+/)"
        match = re.match(rf"({entry}(?:,\s*{entry})*)(?:\s|$)", line.strip())
        if match is None:
            continue  # a description's continuation line
        names = [n.strip() for n in match.group(1).split(",")]
        while folders and folders[-1][0] >= indent:
            folders.pop()
        base = "/".join(f for _, f in folders)
        for name in names:
            if name.endswith("/"):
                folders.append((indent, name.rstrip("/")))
            elif base.startswith("trainmon"):
                listed.add(f"{base}/{name}")
    return listed


def test_the_architecture_page_lists_every_module_of_the_package():
    """docs/architecture.md's tree is the package: a module added or removed without the page
    saying so fails here."""
    actual = {
        str(p.relative_to(REPO)).replace("\\", "/")
        for p in (REPO / "trainmon").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    listed = _tree_in_the_page()
    assert not actual - listed, f"modules missing from docs/architecture.md: {sorted(actual - listed)}"
    assert not listed - actual, f"docs/architecture.md lists modules that do not exist: {sorted(listed - actual)}"
