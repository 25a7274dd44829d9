"""The schema and grammar packages import each other without a circle.

Every import counts, including the ones inside functions: a deferred import hides a circle
from the interpreter at start-up, not from the next refactoring. The graph is read from the
source (``ast``), so the test needs no backend and runs in milliseconds.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# package name -> source folder
PACKAGES = {"constrained_spec.schemas": ROOT / "constrained_spec" / "schemas",
            "constrained_spec.grammar": ROOT / "constrained_spec" / "grammar"}


def modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        paths = sorted(folder.glob("*.py"))
        # an empty folder (a moved package) would make every check below pass on nothing
        assert paths, f"{package}: no modules in {folder}"
        for path in paths:
            out[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of PACKAGES it imports anywhere in its source."""
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        package = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{parent}.{base}" if base else parent
                # "from . import x" / "from pkg import submodule" name modules themselves
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                           for a in node.names]
            else:
                continue
            edges.update(t for t in targets if t in known and t != name)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (as a closed path of module names), or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def test_find_cycle_reports_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_graph_sees_deferred_and_relative_imports():
    graph = import_graph()
    assert "constrained_spec.schemas.refs" in graph["constrained_spec.schemas.spec"]  # in a function
    assert "constrained_spec.schemas.patterns" in graph["constrained_spec.grammar.compile"]


def test_schema_and_grammar_packages_have_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("leaf", ["patterns", "pointers", "support", "formats"])
def test_leaf_modules_import_nothing_of_the_package(leaf):
    """The regex surgery, JSON pointers, the support tables and the format checks sit below
    everything else; a package import here is how the old backends <-> spec circle began."""
    assert import_graph()[f"constrained_spec.schemas.{leaf}"] == set()
