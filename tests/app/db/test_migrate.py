"""`kiln.migrations.HEAD`, which `upgrade` compares a database with to skip Alembic, is the
head Alembic finds in versions/: a new migration must move it."""

from __future__ import annotations

from kiln import migrations
from kiln.app.db import migrate


def test_head_is_alembic_s_head() -> None:
    assert migrate.head() == migrations.HEAD, "set kiln/migrations/__init__.py's HEAD to it"
