"""The repository's Markdown links resolve inside the repository.

A relative link must name a file or folder that exists, and must not leave the repository (a
clone has nothing beside it); a `#fragment` must name a heading of the linked Markdown file.
Links to the web are not followed: no network here.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Generated or third-party trees that are not the repository's own documents.
SKIP_FOLDERS = {"node_modules", "build"}

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_CODE = re.compile(r"`[^`\n]*`")
_TITLE = r"""(?:\s+(?:"[^"]*"|'[^']*'|\([^)]*\)))?"""  # [text](target "a title")
_INLINE = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?" + _TITLE + r"\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]\n]+\]:\s*<?(\S+?)>?" + _TITLE + r"\s*$", re.M)
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, …


def markdown_files() -> list[Path]:
    found = []
    for path in sorted(ROOT.rglob("*.md")):
        parts = path.relative_to(ROOT).parts[:-1]
        if any(p.startswith(".") or p.endswith(".egg-info") or p in SKIP_FOLDERS for p in parts):
            continue
        found.append(path)
    return found


def links(text: str) -> Iterator[str]:
    """Link targets outside code blocks and code spans."""
    prose = _CODE.sub("", _FENCE.sub("", text))
    yield from _INLINE.findall(prose)
    yield from _REFERENCE.findall(prose)


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces → '-'."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = _FENCE.sub("", path.read_text())
    found: set[str] = set()
    for heading in _HEADING.findall(text):
        base = anchor = slug(heading)
        count = 0
        while anchor in found:  # GitHub numbers repeated headings
            count += 1
            anchor = f"{base}-{count}"
        found.add(anchor)
    return found


def broken(source: Path, target: str) -> str | None:
    """Why `target`, linked from `source`, does not resolve inside the repository; or None."""
    if _EXTERNAL.match(target):
        return None
    where, _, fragment = target.partition("#")
    resolved = (source.parent / where).resolve() if where else source
    if not resolved.is_relative_to(ROOT):
        return f"{target} leaves the repository"
    if not resolved.exists():
        return f"{target} does not exist"
    if fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
        return f"{target}: {resolved.name} has no heading #{fragment}"
    return None


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_inside_the_repository(path: Path) -> None:
    problems = [why for target in links(path.read_text()) if (why := broken(path, target))]
    assert problems == []


def test_the_checker_finds_what_it_should() -> None:
    text = (
        "[ok](https://example.com) [out](../shared/DESIGN.md) `[code](nowhere.md)`\n"
        "```\n[fenced](nowhere.md)\n```\n[ref]: missing.md\n![img](pic.png 'title')\n"
    )
    found = ["https://example.com", "../shared/DESIGN.md", "pic.png", "missing.md"]
    assert list(links(text)) == found
    assert broken(ROOT / "README.md", "../shared/DESIGN.md") == (
        "../shared/DESIGN.md leaves the repository"
    )
    assert broken(ROOT / "README.md", "docs/no-such-page.md") == (
        "docs/no-such-page.md does not exist"
    )
    assert broken(ROOT / "README.md", "docs/architecture.md#no-such-heading") is not None
    assert broken(ROOT / "README.md", "docs/architecture.md#the-data-model") is None
    assert slug("Built-in models (`--cases builtin`)") == "built-in-models---cases-builtin"
    assert slug("Figures after the structure change (issue 14)") == (
        "figures-after-the-structure-change-issue-14"
    )
