"""The tree reads as the architecture (docs/architecture.md): these rules keep it so.

- everything imports Kiln as `kiln.…`, never the folders' own names (`app`, `workers`);
- `kiln.app` (what a job is, the API) never imports `kiln.workers` (what does the work), except
  in the CLI, the composition root whose `worker`/`run` commands build both sides;
- no import circles inside `kiln`, counting imports inside functions and for type checking;
- Kiln imports neither its tests nor its benchmarks; the benchmarks do not import the tests;
- `kiln.workers` builds no SQL: it takes only a session's types and errors from SQLAlchemy.
"""

from __future__ import annotations

import ast
import graphlib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_FOLDERS = ("app", "workers", "migrations")
COMPOSITION_ROOT = "kiln.app.cli"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["kiln", *parts] if parts[0] in PACKAGE_FOLDERS else parts)


def _sources(*folders: str) -> dict[str, Path]:
    return {
        _module_name(path): path
        for folder in folders
        for path in sorted((ROOT / folder).rglob("*.py"))
    }


def _imported_names(path: Path) -> Iterator[str]:
    """Every name an `import` statement in the file reaches, at any depth."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


KILN = _sources(*PACKAGE_FOLDERS)


def _edges() -> dict[str, set[str]]:
    """Module → the Kiln modules it imports (a name resolves to its longest module prefix)."""

    def resolve(name: str) -> str | None:
        while name and name not in KILN:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {}
    for module, path in KILN.items():
        targets = {resolve(name) for name in _imported_names(path)}
        edges[module] = {t for t in targets if t and t != module and not module.startswith(f"{t}.")}
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str]:
    """One import circle, as graphlib finds it, or [] when there is none."""
    try:
        graphlib.TopologicalSorter(edges).prepare()
    except graphlib.CycleError as error:
        return list(error.args[1])
    return []


@pytest.mark.parametrize("folder", [*PACKAGE_FOLDERS, "bench", "devstack", "tests"])
def test_kiln_is_imported_by_its_one_name(folder: str) -> None:
    bare = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / folder).rglob("*.py"))
        for name in _imported_names(path)
        if name.split(".")[0] in PACKAGE_FOLDERS
    ]
    assert bare == []


def test_the_app_side_never_imports_the_workers() -> None:
    crossings = [
        f"{module} imports {target}"
        for module, targets in _edges().items()
        if module.startswith("kiln.app.") and not module.startswith(COMPOSITION_ROOT)
        for target in sorted(targets)
        if target.startswith("kiln.workers")
    ]
    assert crossings == []


def test_no_import_circles() -> None:
    assert _cycle(_edges()) == []


def test_the_cycle_finder_finds_one() -> None:
    assert sorted(set(_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}))) == ["a", "b", "c"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize(
    ("folders", "forbidden"),
    [(PACKAGE_FOLDERS, ("tests", "bench", "devstack")), (("bench", "devstack"), ("tests",))],
)
def test_what_may_not_be_imported(folders: tuple[str, ...], forbidden: tuple[str, ...]) -> None:
    found = [
        f"{path.relative_to(ROOT)} imports {name}"
        for folder in folders
        for path in sorted((ROOT / folder).rglob("*.py"))
        for name in _imported_names(path)
        if name.split(".")[0] in forbidden
    ]
    assert found == []


# What `kiln.workers` may take from SQLAlchemy: a session's types for its signatures and the
# errors it catches. Statements are built in `kiln.app.db` only, so a chunk's stages reach the
# database through its functions at their boundaries.
WORKER_SQLALCHEMY = {
    "sqlalchemy.Engine",
    "sqlalchemy.exc.OperationalError",
    "sqlalchemy.exc.SQLAlchemyError",
    "sqlalchemy.orm.Session",
    "sqlalchemy.orm.sessionmaker",
}


def test_workers_build_no_sql() -> None:
    found = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / "workers").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for name in _sqlalchemy_names(node)
        if name not in WORKER_SQLALCHEMY
    ]
    assert found == []


def _sqlalchemy_names(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "sqlalchemy"]
    module = node.module or ""
    if module.split(".")[0] != "sqlalchemy":
        return []
    return [f"{module}.{alias.name}" for alias in node.names]
