"""The docs say what the code does: the architecture page's import graph is the real one, the
README stays a first screen whose links resolve, and every docs page is reachable from the nav."""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest

from tests._support.runs import REPO

LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.slow  # 3.0-5.6 s on a loaded 2-core VM (2026-12-06)
def test_architecture_page_shows_the_current_import_graph(monkeypatch, capsys):
    # After a change that moves an import between layers: python tools/import_graph.py, paste it there.
    spec = importlib.util.spec_from_file_location("import_graph_for_docs", REPO / "tools" / "import_graph.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    monkeypatch.setattr(sys, "argv", ["import_graph.py"])
    assert tool.main() == 0
    out = capsys.readouterr().out
    page = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert out.strip() and out.strip() in page


def test_readme_is_a_first_screen_whose_links_resolve():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    targets = [t for t in LINK.findall(readme) if "://" not in t]
    assert "docs/configuration.md" in targets and "docs/img/grad_reduced_norm.png" in targets
    missing = [t for t in targets if not (REPO / t).exists()]
    assert not missing, missing


def test_every_docs_page_is_in_the_nav():
    nav = (REPO / "mkdocs.yml").read_text(encoding="utf-8").split("\nnav:\n", 1)[1]
    listed = set(re.findall(r":\s*([\w./-]+\.md)\s*$", nav, flags=re.MULTILINE))
    pages = {p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs").rglob("*.md")}
    assert pages <= listed, sorted(pages - listed)
