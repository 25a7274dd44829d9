"""Shared helper of the benchmark scripts: write one section of ``benchmarks/RESULTS.md``."""

from __future__ import annotations

from pathlib import Path


def write_section(path: Path, heading: str, body: str) -> None:
    """Replace the ``heading`` section of a markdown file where it stands, or append it.

    ``heading`` is the whole heading line (``"## Speculation on the benchmark tasks"``); the
    section runs to the next heading of the same level (``"\\n## "``) or the end of the file.
    A missing file is created with a ``# Benchmark results`` title.
    """
    path = Path(path)
    old = path.read_text() if path.exists() else "# Benchmark results\n"
    section = f"{heading}\n\n{body.strip()}\n"
    start = old.find(heading + "\n")
    if start < 0:
        path.write_text(old.rstrip() + "\n\n" + section)
        return
    nxt = old.find("\n## ", start + len(heading))  # the section is replaced where it stands
    rest = "\n" + old[nxt + 1:] if nxt >= 0 else ""
    path.write_text(old[:start] + section + rest)
