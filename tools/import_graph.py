"""Print trainmon's import graph between its packages/modules and fail on a cycle.

    python tools/import_graph.py            # layer graph (trainmon.<layer>) as a Markdown list
    python tools/import_graph.py --modules  # module graph
Every import counts, function-local ones included, so a cycle cannot hide behind a lazy import
(``TYPE_CHECKING``-only imports are skipped: they never run).
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "trainmon"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    return lines


def imports_of(path: Path, modules: set[str]) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _type_checking_lines(tree)
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != me:
                found.add(name)
    return found


def graph(by_layer: bool) -> dict[str, set[str]]:
    paths = sorted(PKG.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    edges: dict[str, set[str]] = {}
    for p in paths:
        src = module_name(p)
        for dst in imports_of(p, modules):
            a, b = (_layer(src), _layer(dst)) if by_layer else (src, dst)
            if a != b:
                edges.setdefault(a, set()).add(b)
    return edges


# Front ends that live next to the stack they serve but sit above ``trainmon.monitor`` (they build a
# ``TrainerMon``): a layer of their own.  Nothing inside trainmon may import them (a cycle would show).
FRONT_ENDS = ("trainmon.integrations.hf", "trainmon.integrations.lightning")


def _layer(module: str) -> str:
    if module in FRONT_ENDS:
        return module
    return ".".join(module.split(".")[:2])


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(edges):
        if n not in state and (c := visit(n)):
            return c
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modules", action="store_true", help="module graph instead of the layer graph")
    args = ap.parse_args()
    edges = graph(by_layer=not args.modules)
    for src in sorted(edges):
        print(f"- `{src}` -> " + ", ".join(f"`{d}`" for d in sorted(edges[src])))
    for by_layer in (False, True):
        cycle = find_cycle(graph(by_layer))
        if cycle:
            print(f"import cycle ({'layers' if by_layer else 'modules'}): " + " -> ".join(cycle), file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
