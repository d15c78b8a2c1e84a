"""Kiln's Alembic migrations (`versions/`), run by `kiln db upgrade` (kiln.app.db.migrate)."""

# The newest revision in versions/. `upgrade` compares a database with it to skip Alembic when
# there is nothing to do; tests/app/db/test_migrate.py holds it to Alembic's own head.
HEAD = "0018_retention"
