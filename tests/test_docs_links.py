"""The docs hold together: every relative link reaches a file, every anchor a heading of it.

GitHub renders the Markdown, so anchors follow its slug rules: the heading's text, lowercase,
punctuation other than hyphens and underscores dropped, spaces to hyphens, and a repeated slug
numbered (`-1`, `-2`). Links inside code (fenced blocks, inline spans) are not links. External
http(s) links are not fetched: the suite stays offline.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README_MAX_LINES = 200

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# A code span may wrap onto the next line of its paragraph, never past a blank line.
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1)(?:[^\n]|\n(?!\n)))*?\1")
# [text](target) and ![alt](target), an optional "title" after the target.
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _documents() -> list[Path]:
    return [
        ROOT / "README.md",
        *sorted(DOCS.glob("*.md")),
        ROOT / "bench" / "README.md",
        ROOT / "slurm" / "README.md",
    ]


def _prose(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (before numbering repeats)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor GitHub gives the headings of `path`."""
    seen: dict[str, int] = {}
    found = set()
    for line in _prose(path.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match[2])
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[str]:
    """Every link target in the prose of `path` (a link's text may wrap onto the next line)."""
    prose = "\n".join(_prose(path.read_text(encoding="utf-8")))
    return _LINK.findall(_CODE_SPAN.sub("", prose))


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """`path`'s relative links whose file or anchor does not exist, each with why (files named
    relative to `root`)."""
    broken = []
    for target in links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http(s), mailto: not checked
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(root.resolve())}")
    return broken


@pytest.mark.parametrize("path", _documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(path: Path) -> None:
    assert path.exists()
    assert broken_links(path) == []


def test_readme_is_short_and_links_every_docs_page() -> None:
    readme = ROOT / "README.md"
    assert len(readme.read_text(encoding="utf-8").splitlines()) <= README_MAX_LINES
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(readme)}
    pages = sorted(DOCS.glob("*.md"))
    assert len(pages) > 10
    assert [p.name for p in pages if p.resolve() not in linked] == []


def test_the_docs_index_lists_every_page_once() -> None:
    index = DOCS / "README.md"
    targets = [t.partition("#")[0] for t in links(index)]
    for page in sorted(DOCS.glob("*.md")):
        if page != index:
            assert targets.count(page.name) == 1, page.name


def test_page_names_are_lowercase_with_hyphens() -> None:
    for page in DOCS.glob("*.md"):
        assert page.name == "README.md" or re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*\.md", page.name)


def test_slugs_follow_githubs_rules() -> None:
    assert slug("Exit codes (the contract with the scheduler)") == (
        "exit-codes-the-contract-with-the-scheduler"
    )
    assert slug("Where the store runs (`--ft-store`)") == "where-the-store-runs---ft-store"
    assert slug("Re-running a step elsewhere (`ftrun.rerun`)") == (
        "re-running-a-step-elsewhere-ftrunrerun"
    )
    assert slug("snake_case & Co.") == "snake_case--co"


def test_the_checker_finds_broken_links(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text(
        "# Top\n## Top\n[ok](#top-1) [ok](b.md#b) ![img](b.md) [web](https://x.invalid/y)\n"
        "[bad](#nope) [bad](c.md) [bad, its text\nwrapped](b.md#nope)\n"
        "`[code](c.md)`, `wrapped\n[code](c.md)`\n```\n[fenced](c.md)\n```\n",
        encoding="utf-8",
    )
    (tmp_path / "b.md").write_text("# B\n", encoding="utf-8")
    assert broken_links(tmp_path / "a.md", root=tmp_path) == [
        "#nope: no heading #nope in a.md",
        "c.md: no such file",
        "b.md#nope: no heading #nope in b.md",
    ]
