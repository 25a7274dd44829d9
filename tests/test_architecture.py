"""The package's folders are its layers: no import points up a layer, and no import circle.

Every import counts, the ones inside functions and under ``TYPE_CHECKING`` too: a function-level
import that closes a circle still ties the two modules together, it only hides it. The layers
are those of docs/design.md, lowest first; a module may import its own layer and the ones
below. The walk reads the source (``ast``), imports nothing, and runs in well under a second.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "constrained_spec"

#: (layer, module prefixes), lowest first. A module belongs to the layer of its longest prefix.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("constrained_spec.errors", "constrained_spec.settings", "constrained_spec.config",
              "constrained_spec.cache", "constrained_spec.plan_syntax",
              "constrained_spec.json_limits", "constrained_spec.child")),
    ("kernels and schemas", ("constrained_spec.kernels", "constrained_spec.schemas")),
    ("grammar", ("constrained_spec.grammar",)),
    ("model", ("constrained_spec.model",)),
    ("generation", ("constrained_spec.generation", "constrained_spec.drafters")),
    ("request frontend", ("constrained_spec.frontend", "constrained_spec.api", "constrained_spec")),
    ("edges", ("constrained_spec.cli", "constrained_spec.server", "constrained_spec.training",
               "constrained_spec.__main__")),
)


def modules(root: Path, package: str) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` under ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if "__pycache__" in parts:
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join((package, *parts))] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """The modules of ``known`` that ``name`` (the file ``path``) imports, with the line of each
    import: ``from a.b import c`` imports ``a.b.c`` when that is a module, else ``a.b``."""
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_package else name.split(".")[:-1]
                here = here[:len(here) - node.level + 1]
                base = ".".join([*here, base] if base else here)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out += [(t, node.lineno) for t in targets if t in known and t != name]
    return out


def layer_of(module: str) -> int:
    best, rank = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    return rank


def import_graph(root: Path, package: str) -> dict[str, dict[str, int]]:
    mods = modules(root, package)
    known = set(mods)
    return {m: dict(imports(m, p, known)) for m, p in mods.items()}


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Each import circle (a strongly connected component of two or more modules), as one
    closed path through it: ``[a, b, ..., a]``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the graphs here are a few hundred modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(_closed_path(graph, set(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _closed_path(graph: dict[str, dict[str, int]], component: set[str]) -> list[str]:
    """A shortest circle through the component's first module (breadth-first)."""
    start = min(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
                if w in component and w not in previous:
                    previous[w] = v
                    nxt.append(w)
        frontier = nxt
    return sorted(component)


def describe(graph: dict[str, dict[str, int]], path: list[str]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(path, path[1:])) + f" -> {path[-1]}"


def upward(graph: dict[str, dict[str, int]]) -> list[str]:
    out = []
    for a, targets in sorted(graph.items()):
        for b, line in sorted(targets.items()):
            if layer_of(b) > layer_of(a):
                out.append(f"{a} (line {line}, layer {LAYERS[layer_of(a)][0]!r}) imports {b} "
                           f"(layer {LAYERS[layer_of(b)][0]!r})")
    return out


# -- the checker, on small made-up packages ------------------------------------------------------

def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_a_circle_through_a_function_level_import_is_found_and_named(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "a.py": "from pkg.b import x\n",
        "b.py": "def f():\n    from pkg import a\n",
        "c.py": "from . import a\n",
    })
    graph = import_graph(root, "pkg")
    assert graph["pkg.b"] == {"pkg.a": 2} and graph["pkg.c"] == {"pkg.a": 1}
    found = cycles(graph)
    assert found == [["pkg.a", "pkg.b", "pkg.a"]]
    assert describe(graph, found[0]) == "pkg.a (line 1) -> pkg.b (line 2) -> pkg.a"


def test_no_circle_in_a_layered_package(tmp_path):
    root = _package(tmp_path, {"__init__.py": "from pkg import a\n", "a.py": "from pkg import b\n",
                               "b.py": "import os\n"})
    assert cycles(import_graph(root, "pkg")) == []


def test_an_upward_import_is_named_with_both_layers():
    graph = {"constrained_spec.model.runner": {"constrained_spec.generation.engine": 7},
             "constrained_spec.generation.engine": {"constrained_spec.model.protocols": 3},
             "constrained_spec.model.protocols": {}}
    [found] = upward(graph)
    assert found.startswith("constrained_spec.model.runner (line 7, layer 'model') imports "
                            "constrained_spec.generation.engine (layer 'generation')")


# -- the package -------------------------------------------------------------------------------

def test_every_module_of_the_package_has_a_layer():
    graph = import_graph(ROOT / PACKAGE, PACKAGE)
    assert len(graph) > 80 and "constrained_spec.grammar.compile" in graph  # links followed
    assert all(layer_of(m) >= 0 for m in graph)
    assert layer_of("constrained_spec.model.runner") < layer_of("constrained_spec.generation.engine")


def test_no_import_circle_in_the_package():
    graph = import_graph(ROOT / PACKAGE, PACKAGE)
    found = [describe(graph, c) for c in cycles(graph)]
    assert found == [], "import circles (cut each, docs/extending.md):\n" + "\n".join(found)


def test_no_import_points_up_a_layer():
    found = upward(import_graph(ROOT / PACKAGE, PACKAGE))
    assert found == [], "imports that point up a layer (docs/design.md):\n" + "\n".join(found)


def test_no_import_circle_in_the_benchmarks():
    graph = import_graph(ROOT / "benchmarks", "benchmarks")
    found = [describe(graph, c) for c in cycles(graph)]
    assert found == [], "import circles among the benchmarks:\n" + "\n".join(found)
