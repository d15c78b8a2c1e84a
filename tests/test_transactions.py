"""The commit rule (app/__init__.py) holds: `unit_of_work` is the only code in Kiln that commits
or rolls back. So query helpers in app/db, routes, CLI commands and Celery tasks never do, and a
service's writes end in a `with unit_of_work(session):` block, not in a bare `commit()`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENDINGS = {"commit", "rollback"}
THE_UNIT = ("app/db/session.py", "unit_of_work")


class _Endings(ast.NodeVisitor):
    """Collects (innermost enclosing function, line) of every `….commit()`/`….rollback()`."""

    def __init__(self) -> None:
        self.functions = ["<module>"]
        self.found: list[tuple[str, int]] = []

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Attribute) and node.func.attr in ENDINGS:
            self.found.append((self.functions[-1], node.lineno))
        self.generic_visit(node)


def _endings(source: str) -> list[tuple[str, int]]:
    visitor = _Endings()
    visitor.visit(ast.parse(source))
    return visitor.found


def _outside_the_unit() -> list[str]:
    found = []
    for folder in ("app", "workers"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            name = str(path.relative_to(ROOT))
            for function, line in _endings(path.read_text()):
                if (name, function) != THE_UNIT:
                    found.append(f"{name}:{line} ({function})")
    return found


def test_only_unit_of_work_commits_or_rolls_back() -> None:
    assert _outside_the_unit() == []


def test_the_scan_finds_a_commit() -> None:
    source = "def save(session):\n    session.add(1)\n    session.commit()\n"
    assert _endings(source) == [("save", 3)]
    assert _endings("x.rollback()\n") == [("<module>", 1)]


def test_the_unit_itself_is_found() -> None:
    """The allowed place exists (a renamed helper must not make the rule vacuous)."""
    path, function = THE_UNIT
    assert {f for f, _ in _endings((ROOT / path).read_text())} == {function}
