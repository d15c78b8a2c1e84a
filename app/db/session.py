"""Engine and session factories (the caller owns them: no module-level engine), and
`unit_of_work`, the one place a transaction is committed or rolled back (the rule is in
app/__init__.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

from kiln.app.core.config import Settings


def engine_for(settings: Settings) -> Engine:
    """The process's engine, pooled as the settings say."""
    return make_engine(
        settings.database_url,
        pool_size=settings.db_pool_size,
        max_overflow=settings.db_max_overflow,
        pool_timeout=settings.db_pool_timeout_s,
    )


def make_engine(url: str, **kwargs: Any) -> Engine:
    """Create an engine tuned for Kiln's access pattern (many short transactions from threads)."""
    if url.startswith("sqlite"):
        engine = create_engine(
            url, connect_args={"check_same_thread": False, "timeout": 30}, **kwargs
        )
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(url, pool_pre_ping=True, **{"pool_size": 10, "max_overflow": 20, **kwargs})


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # WAL lets the API read while a worker writes; busy_timeout waits instead of failing.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def unit_of_work(session: Session) -> Iterator[Session]:
    """One unit of work: committed when the block ends, rolled back if it raises (the error
    goes on). A `return` inside the block commits too."""
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
