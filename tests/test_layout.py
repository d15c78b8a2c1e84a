"""The tree reads as the architecture (docs/architecture.md): these rules keep it so.

- everything imports Kiln as `kiln.…`, never the folders' own names (`app`, `workers`);
- `kiln.app` (what a job is, the API) never imports `kiln.workers` (what does the work), except
  in the CLI, the composition root whose `worker`/`run` commands build both sides;
- no import circles inside `kiln`, counting imports inside functions and for type checking;
- `kiln.workers`' rooms (its folders and loose modules) are ranked once, in `WORKER_ROOMS`, and
  a room imports only rooms ranked below it, counted the same way (`AGAINST_THE_ORDER` names at
  most two exceptions, each with its reason); `kiln.app`'s rooms likewise, in `APP_ROOMS`
  (exceptions in `APP_AGAINST_THE_ORDER`);
- Kiln imports neither its tests nor its benchmarks; the benchmarks do not import the tests;
- `kiln.workers` builds no SQL: it takes only a session's types and errors from SQLAlchemy.
"""

from __future__ import annotations

import ast
import graphlib
from collections.abc import Iterator, Sequence
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


# kiln.workers' rooms, lowest first: data and dependencies flow up this list, so a room imports
# only rooms before it (a value two rooms share lives in the lower one). docs/architecture.md
# ("The worker's rooms") draws them in this order; a new room is placed here before it lands.
WORKER_ROOMS = (
    "prep",  # the prep processes: decode, fetch, slots; imports no other room
    "batching",  # the generic Batcher
    "ops",  # the process's services: health, the lease keeper, chunk totals, metrics, devices
    "device",  # the device path of image models (it declares what it needs of an engine)
    "engines",  # an Engine per backend, the stand-in among them
    "models",  # each family: its batch half, its prep half where it needs the family, grouping
    "runners",  # the loaded models and their Batchers
    "runtime",  # WorkerRuntime: the process's resources
    "close",  # the job's close, and what a chunk run hands it (Lease, fallback)
    "chunk",  # one chunk's trip
    "jobs",  # per job, outside its chunks: ingest, the reconciler
    "webhooks",  # completion webhooks: the courier that claims, signs and sends deliveries
    "celery",  # the glue
    "embedded",  # kiln run's whole stack in one process
)
# Imports against the order that stay, each with its reason: at most two (none today).
AGAINST_THE_ORDER: dict[tuple[str, str], str] = {}

# kiln.app's rooms, lowest first, ranked the same way (docs/architecture.md, "The app's rooms").
APP_ROOMS = (
    "core",  # settings, errors, digests; imports no other room
    "observability",  # logs and tracing
    "sources",  # an item's source: `store:` keys and s3:// URIs
    "video",  # containers, sampling, the frame index, the reader
    "families",  # each model family's options
    "storage",  # the object stores
    "dispatch",  # the queue contract and its producers
    "db",  # tables, sessions, the query helpers
    "tenants",  # keys, bucket allow-lists, limits
    "catalog",  # the models a job can name
    "jobs",  # what a job is and how it goes: submit, cancel, progress, bulk, schedules
    "results",  # what a job leaves and how it is read: shards, search, thumbnails, pipelines
    "api",  # the HTTP API
    "console",  # the web UI, built on the API's dependencies
    "client",  # the public Python client (kiln.Client): the API's schemas over httpx
    "cli",  # the composition root
)
APP_AGAINST_THE_ORDER: dict[tuple[str, str], str] = {
    ("db", "jobs"): "db's run queries hand back jobs.throughput's Span, a plain value",
    ("api", "console"): "api/app.py mounts the console, which is built on the API's deps",
}
RANKINGS = {
    "workers": (WORKER_ROOMS, AGAINST_THE_ORDER),
    "app": (APP_ROOMS, APP_AGAINST_THE_ORDER),
}


def _room(module: str, package: str = "workers") -> str | None:
    """A kiln.<package> module's room: its folder, or a loose module's own name."""
    parts = module.split(".")
    return parts[2] if parts[:2] == ["kiln", package] and len(parts) > 2 else None


def _upward(
    edges: dict[str, set[str]], order: Sequence[str], package: str = "workers"
) -> list[tuple[str, str, str]]:
    """(room, the room above it, "module imports target") for each import up the order."""
    rank = {room: i for i, room in enumerate(order)}
    return sorted(
        (a, b, f"{module} imports {target}")
        for module, targets in edges.items()
        for target in targets
        if (a := _room(module, package)) in rank
        and (b := _room(target, package)) in rank
        and rank[a] < rank[b]
    )


@pytest.mark.parametrize("package", RANKINGS)
def test_every_room_is_ranked_once(package: str) -> None:
    rooms, _ = RANKINGS[package]
    folder = ROOT / package
    folders = {path.parent.name for path in folder.glob("*/__init__.py")}
    loose = {path.stem for path in folder.glob("*.py")} - {"__init__"}
    assert len(set(rooms)) == len(rooms)
    assert sorted(rooms) == sorted(folders | loose)


@pytest.mark.parametrize("package", RANKINGS)
def test_rooms_import_only_rooms_below(package: str) -> None:
    rooms, exceptions = RANKINGS[package]
    found = [line for a, b, line in _upward(_edges(), rooms, package) if (a, b) not in exceptions]
    assert found == []


@pytest.mark.parametrize("package", RANKINGS)
def test_exceptions_are_few_reasoned_and_still_needed(package: str) -> None:
    rooms, exceptions = RANKINGS[package]
    used = {(a, b) for a, b, _ in _upward(_edges(), rooms, package)}
    assert len(exceptions) <= 2
    assert all(reason.strip() for reason in exceptions.values())
    assert set(exceptions) <= used  # a stale exception is deleted, not kept


def test_the_order_check_finds_one() -> None:
    edges = {
        "kiln.workers.a.x": {"kiln.workers.b.y", "kiln.workers.a.z"},
        "kiln.workers.b.y": {"kiln.workers.a.z", "kiln.app.core"},
        "kiln.workers.b": {"kiln.workers.c"},  # a loose module is a room of its own
    }
    assert _upward(edges, ("a", "b", "c")) == [
        ("a", "b", "kiln.workers.a.x imports kiln.workers.b.y"),
        ("b", "c", "kiln.workers.b imports kiln.workers.c"),
    ]
    assert _upward(edges, ("c", "b", "a")) == [
        ("b", "a", "kiln.workers.b.y imports kiln.workers.a.z"),
    ]
    assert _room("kiln.workers.runtime") == "runtime" and _room("kiln.workers") is None
    assert _room("kiln.app.jobs.jobs", "app") == "jobs"
    assert _room("kiln.workers.chunk", "app") is None


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
