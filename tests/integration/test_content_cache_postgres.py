"""The content cache's rows on Postgres, in a database of their own (the purge trims the whole
table): the SQLite tests of tests/app/db/test_content_cache.py again, and a purge that skips
the rows another transaction holds instead of waiting for them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import select, text
from sqlalchemy.orm import Session, sessionmaker

from devstack.services import ServiceUnavailableError, create_database, drop_database
from kiln.app.core.config import get_settings
from kiln.app.db import content_cache
from kiln.app.db.migrate import upgrade
from kiln.app.db.models import ContentCache
from kiln.app.db.session import make_engine, make_session_factory, unit_of_work
from tests.app.db.test_content_cache import (  # noqa: F401 (collected here: the same tests)
    KEY,
    TTL_S,
    age,
    kept,
    test_a_lookup_finds_what_its_key_wrote_and_nothing_else,
    test_a_purge_with_nothing_to_do_deletes_nothing,
    test_a_write_replaces_an_expired_entry_but_not_a_live_one,
    test_an_expired_entry_is_not_served,
    test_entries_with_and_without_a_vector_written_together_come_back_as_written,
    test_the_purge_deletes_expired_entries_in_steps,
    test_the_purge_trims_to_the_cap_oldest_first,
    write,
)
from tests.stack import unavailable


@pytest.fixture(scope="module")
def sessions() -> Iterator[sessionmaker[Session]]:
    try:
        url = create_database()
    except ServiceUnavailableError as error:
        unavailable(str(error))
    upgrade(get_settings(database_url=url))
    engine = make_engine(url)
    try:
        yield make_session_factory(engine)
    finally:
        engine.dispose()
        drop_database(url)


@pytest.fixture
def session(sessions: sessionmaker[Session]) -> Iterator[Session]:
    with sessions() as session:
        with unit_of_work(session):
            session.execute(text("TRUNCATE content_cache"))
        yield session


def test_the_purge_skips_rows_another_transaction_holds(
    session: Session, sessions: sessionmaker[Session]
) -> None:
    write(session, KEY, ["held", "free"])
    age(session, ["held", "free"], TTL_S + 60)
    with sessions() as holder, unit_of_work(holder):
        holder.execute(
            select(ContentCache).where(ContentCache.sha256 == "held").with_for_update()
        ).one()
        with sessions() as purger, unit_of_work(purger):
            purger.execute(text("SET LOCAL lock_timeout = '5s'"))  # waiting would fail, not hang
            step = content_cache.purge(purger, TTL_S, max_entries=100)
        assert step.expired == 1
    assert kept(session) == {"held"}  # the next reconcile deletes it
