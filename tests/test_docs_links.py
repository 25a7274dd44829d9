"""The README and docs/ link to pages and headings that exist (the README points to docs/ for
everything it leaves out, so a broken link loses a fact)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to -."""
    out = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return out


def broken_links(page: Path) -> list[str]:
    out = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked (no network in tests)
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            out.append(f"{page.name}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{page.name}: {target} (no such heading)")
    return out


def test_every_relative_link_in_the_readme_and_docs_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert len(pages) > 5
    assert [b for p in pages for b in broken_links(p)] == []


def test_the_link_checker_sees_a_missing_page_and_a_missing_heading(tmp_path):
    page = tmp_path / "a.md"
    page.write_text("# A title\n\n[ok](#a-title) [gone](b.md) [bad](#nope) [web](https://x.org)\n")
    assert broken_links(page) == ["a.md: b.md (no such file)", "a.md: #nope (no such heading)"]
