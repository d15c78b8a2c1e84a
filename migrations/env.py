"""Alembic environment: the URL comes from Kiln's settings via `kiln db upgrade`."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from kiln.app.db.models import Base
from kiln.app.db.session import make_engine

config = context.config
target_metadata = Base.metadata


def run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite can't ALTER much
    )
    with context.begin_transaction():
        context.run_migrations()


def main() -> None:
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("No database URL: run migrations through `kiln db upgrade`.")
    if context.is_offline_mode():
        context.configure(url=url, target_metadata=target_metadata, literal_binds=True)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            run(connection)
    finally:
        engine.dispose()


main()
