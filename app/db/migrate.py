"""Run Alembic migrations programmatically: `kiln db upgrade` is the only caller in production.

Alembic is imported by the functions that use it: `upgrade` of a database already at this
release's head (`kiln run`, every run after its first) reads its revision with one query and
imports none of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Connection, inspect, text

from kiln import migrations
from kiln.app.core.config import Settings
from kiln.app.core.errors import ConflictError
from kiln.app.db.session import make_engine

if TYPE_CHECKING:
    from alembic.config import Config
    from alembic.script import ScriptDirectory


def _config() -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    return config


def alembic_config(settings: Settings) -> Config:
    config = _config()
    config.set_main_option("sqlalchemy.url", settings.database_url.replace("%", "%%"))
    return config


@cache
def scripts() -> ScriptDirectory:
    """This release's migrations (read once: they do not change while Kiln runs)."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(_config())


def head() -> str:
    """The newest revision this release knows."""
    newest = scripts().get_current_head()
    assert newest is not None
    return newest


def known(revision: str) -> bool:
    from alembic.util import CommandError

    try:
        return scripts().get_revision(revision) is not None
    except CommandError:
        return False


def describe(revision: str | None) -> str:
    """`0013 (video frames)`, from the migration's file name; `empty` for no revision."""
    if revision is None:
        return "empty"
    if not known(revision):
        return revision
    script = scripts().get_revision(revision)
    assert script is not None and script.path
    name = Path(script.path).stem.partition("_")[2].replace("_", " ")
    return f"{revision} ({name})" if name else revision


def current_revision(connection: Connection) -> str | None:
    """The database's revision as Alembic stamps it (its one-row table), read without Alembic:
    `/readyz` asks on every call, and an Alembic context logs its setup each time it is made.
    None where it has no Kiln tables yet."""
    if not inspect(connection).has_table("alembic_version"):
        return None
    stamped = connection.scalar(text("SELECT version_num FROM alembic_version"))
    return None if stamped is None else str(stamped)


def schema_problem(connection: Connection) -> str | None:
    """Why this release cannot use the database's schema, as a sentence (`kiln db upgrade`
    fixes it), or None. A revision this release does not know is no problem here: a newer
    release has upgraded the database, as in a rolling deploy."""
    revision = current_revision(connection)
    if revision is None:
        return "The database has no Kiln tables; run `kiln db upgrade`."
    if revision == migrations.HEAD:
        return None  # the usual answer, without reading the migrations
    if known(revision) and revision != head():
        return (
            f"The database is at {describe(revision)}; this Kiln needs {describe(head())}: "
            "run `kiln db upgrade`."
        )
    return None


@dataclass(frozen=True)
class Upgraded:
    """What `upgrade` did: the revision before and after, and how many migrations ran."""

    before: str | None
    after: str | None
    applied: int


def _ensure_sqlite_folder(settings: Settings) -> None:
    if settings.database_url.startswith("sqlite:///"):
        path = Path(settings.database_url.removeprefix("sqlite:///"))
        path.parent.mkdir(parents=True, exist_ok=True)


def _revision_of(settings: Settings) -> str | None:
    """The database's revision (`current_revision`), on a connection of its own."""
    engine = make_engine(settings.database_url)
    try:
        with engine.connect() as connection:
            return current_revision(connection)
    finally:
        engine.dispose()


def upgrade(settings: Settings, revision: str = "head") -> Upgraded:
    _ensure_sqlite_folder(settings)
    before = _revision_of(settings)
    if revision == "head" and before == migrations.HEAD:
        return Upgraded(before, before, 0)  # nothing to do: no Alembic to import
    from alembic import command

    if before is not None and not known(before):
        raise ConflictError(
            f"The database is at revision {before}, which this Kiln does not know: a newer "
            "release has upgraded it. Nothing was done."
        )
    command.upgrade(alembic_config(settings), revision)
    after = _revision_of(settings)
    if after is None or after == before:
        return Upgraded(before, after, 0)
    return Upgraded(before, after, len(list(scripts().iterate_revisions(after, before or "base"))))


def revision(settings: Settings, message: str) -> None:
    from alembic import command

    _ensure_sqlite_folder(settings)
    command.revision(alembic_config(settings), message=message, autogenerate=True)
