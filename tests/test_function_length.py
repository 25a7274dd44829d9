"""No function in the package runs past 80 lines: a longer one is split into named steps."""

from __future__ import annotations

import ast
from pathlib import Path

MAX_LINES = 80
ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("constrained_spec",)


def long_functions(source: str, filename: str, limit: int = MAX_LINES) -> list[str]:
    """``file:line name (N lines)`` for every function (nested ones too) longer than ``limit``
    lines, counted from its ``def`` line (not its decorators) to the last line of its body."""
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > limit:
                out.append(f"{filename}:{node.lineno} {node.name} ({lines} lines)")
    return out


def test_the_counter_flags_a_long_function_and_passes_a_short_one():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    long_one = f"@decorator\ndef long_one():\n{body}\n"  # def + 80 body lines: 81
    short_one = "def short_one():\n" + "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES - 1))
    assert long_functions(long_one, "m.py") == ["m.py:2 long_one (81 lines)"]
    assert long_functions(short_one, "m.py") == []
    nested = f"def outer():\n    def inner():\n{body.replace('    ', '        ')}\n    return inner\n"
    assert [s.split()[1] for s in long_functions(nested, "m.py")] == ["outer", "inner"]


def test_no_function_in_the_package_is_longer_than_80_lines():
    files = sorted(p for d in PACKAGE_DIRS for p in (ROOT / d).rglob("*.py"))
    assert len(files) > 20  # the walk found the package
    found = [s for p in files for s in long_functions(p.read_text(), str(p.relative_to(ROOT)))]
    assert found == [], "split these into named steps:\n" + "\n".join(found)
