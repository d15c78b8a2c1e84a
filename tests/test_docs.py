"""The repository's Markdown links resolve inside the repository, and the `kiln` commands it
shows are commands Kiln has.

A relative link must name a file or folder that exists, and must not leave the repository (a
clone has nothing beside it); a `#fragment` must name a heading of the linked Markdown file.
Links to the web are not followed: no network here. A `kiln …` line in a README or docs code
block, a `kiln …` code span, and a `<code>kiln …</code>` hint of the console must name an
existing command, with options it has and no more arguments than it takes.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer

from kiln.app.cli.commands import app

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
        "[ok](https://example.com) [out](../outside/DESIGN.md) `[code](nowhere.md)`\n"
        "```\n[fenced](nowhere.md)\n```\n[ref]: missing.md\n![img](pic.png 'title')\n"
    )
    found = ["https://example.com", "../outside/DESIGN.md", "pic.png", "missing.md"]
    assert list(links(text)) == found
    assert broken(ROOT / "README.md", "../outside/DESIGN.md") == (
        "../outside/DESIGN.md leaves the repository"
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


_SHELL = re.compile(r"^```(?:bash|sh|shell|console)?\n(.*?)^```", re.M | re.S)
_KILN_SPAN = re.compile(r"`(kiln [^`\n]*)`")
_KILN_HINT = re.compile(r"<code>(kiln [^<]*)</code>")
_KILN_SUBSHELL = re.compile(r"\$\((kiln [^)]*)\)")  # export KILN_API_KEY=$(kiln keys create …)
TEMPLATES = ROOT / "app" / "console" / "templates"


def kiln_commands() -> list[tuple[str, str]]:
    """(where, command) for every `kiln …` the README, docs and console templates show."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for block in _SHELL.findall(text):
            for line in block.replace("\\\n", " ").splitlines():
                if line.strip().startswith("kiln "):
                    found.append((path.name, line.strip()))
                found += [(path.name, inner) for inner in _KILN_SUBSHELL.findall(line)]
        found += [(path.name, span) for span in _KILN_SPAN.findall(_FENCE.sub("", text))]
    for path in sorted(TEMPLATES.glob("*.html")):
        found += [(path.name, hint) for hint in _KILN_HINT.findall(path.read_text())]
    return found


def command_problem(line: str) -> str | None:
    """Why `line` is not a `kiln` command Kiln has; or None."""
    try:
        words = shlex.split(line, comments=True)[1:]
    except ValueError as error:
        return f"{line!r} does not parse: {error}"
    command: Any = typer.main.get_command(app)
    path = ["kiln"]
    while hasattr(command, "list_commands") and words:
        sub = command.get_command(command.context_class(command), words[0])
        if sub is None:
            return f"there is no command {' '.join([*path, words[0]])}"
        path.append(words.pop(0))
        command = sub
    if hasattr(command, "list_commands"):
        return f"{' '.join(path)} needs a subcommand"
    return _arguments_problem(command, " ".join(path), words)


def _arguments_problem(command: Any, name: str, words: list[str]) -> str | None:
    options = {
        flag: p
        for p in command.params
        if p.param_type_name == "option"
        for flag in (*p.opts, *p.secondary_opts)
    }
    takes = [p.nargs for p in command.params if p.param_type_name == "argument"]
    given = 0
    while words:
        word = words.pop(0)
        if word in ("&", "…", "..."):  # run in the background; "and the rest" elided
            continue
        if not word.startswith("-") or len(word) == 1:
            given += 1
            continue
        option = options.get(word.partition("=")[0])
        if option is None:
            return f"{name} has no option {word.partition('=')[0]}"
        if not option.is_flag and "=" not in word and words:
            words.pop(0)  # its value
    if -1 not in takes and given > sum(takes):
        return f"{name} takes {sum(takes)} argument(s), not {given}"
    return None


@pytest.mark.parametrize(("where", "line"), kiln_commands(), ids=lambda v: str(v)[:60])
def test_every_kiln_command_shown_is_one_kiln_has(where: str, line: str) -> None:
    assert command_problem(line) is None, where


def test_the_command_checker_finds_what_it_should() -> None:
    assert ("login.html", "kiln keys create --tenant NAME") in kiln_commands()
    assert ("README.md", "kiln keys create --tenant acme --bucket photos") in kiln_commands()
    assert command_problem("kiln keys create --tenant acme --bucket photos  # a note") is None
    assert command_problem("kiln api --host 0.0.0.0 --port 8000 &") is None
    assert command_problem("kiln keys create TENANT") == (
        "kiln keys create takes 0 argument(s), not 1"
    )
    assert command_problem("kiln schedules add") == "there is no command kiln schedules"
    assert command_problem("kiln storage check --make") == "kiln storage check has no option --make"
    assert command_problem("kiln db") == "kiln db needs a subcommand"
