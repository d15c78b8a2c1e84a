"""The content cache's rows (kiln.app.db.content_cache): lookups ignore expired entries, a write
replaces an expired entry but never a live one, and the purge deletes the expired ones and
trims to the cap, oldest first, a bounded step at a time. On SQLite here; the same tests run
on Postgres in tests/integration/test_content_cache_postgres.py."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from kiln.app.db import content_cache
from kiln.app.db.models import ContentCache, utcnow
from kiln.app.db.session import unit_of_work

TTL_S = 3600.0
KEY = "t:acme/classify:abc"


def entry(label: str) -> content_cache.Entry:
    return {"labels": [{"label": label, "score": 0.5}]}, None, None


def write(session: Session, model_key: str, digests: list[str], label: str = "cat") -> None:
    with unit_of_work(session):
        content_cache.cache_results(session, model_key, {d: entry(label) for d in digests}, TTL_S)


def age(session: Session, digests: list[str], seconds: float) -> None:
    """The entries were written `seconds` ago."""
    with unit_of_work(session):
        session.execute(
            update(ContentCache)
            .where(ContentCache.sha256.in_(digests))
            .values(created_at=utcnow() - timedelta(seconds=seconds))
        )


def kept(session: Session) -> set[str]:
    return set(session.scalars(select(ContentCache.sha256)))


def purge_all(session: Session, max_entries: int, batch: int) -> list[content_cache.Purged]:
    """Steps until one deletes less than a batch, as the reconciler runs them."""
    steps = []
    while True:
        with unit_of_work(session):
            step = content_cache.purge(session, TTL_S, max_entries, batch)
        steps.append(step)
        if step.total < batch:
            return steps


def test_a_lookup_finds_what_its_key_wrote_and_nothing_else(session: Session) -> None:
    write(session, KEY, ["d1", "d2"])
    write(session, "t:globex/classify:abc", ["d3"])

    found = content_cache.cached_results(session, KEY, ["d1", "d3", "d9", "d1"], TTL_S)

    assert found == {"d1": entry("cat")}
    assert content_cache.cached_results(session, KEY, [], TTL_S) == {}


def test_an_expired_entry_is_not_served(session: Session) -> None:
    write(session, KEY, ["old", "new"])
    age(session, ["old"], TTL_S + 60)

    found = content_cache.cached_results(session, KEY, ["old", "new"], TTL_S)

    assert set(found) == {"new"}


def test_a_write_replaces_an_expired_entry_but_not_a_live_one(session: Session) -> None:
    write(session, KEY, ["old", "live"], label="first")
    age(session, ["old"], TTL_S + 60)

    write(session, KEY, ["old", "live"], label="second")

    found = content_cache.cached_results(session, KEY, ["old", "live"], TTL_S)
    assert found == {"old": entry("second"), "live": entry("first")}


def test_entries_with_and_without_a_vector_written_together_come_back_as_written(
    session: Session,
) -> None:
    # The two travel apart (one JSON document; the vectors' raw bytes in parameter sets).
    vector = (b"\x00\x00\x80?" * 3, "float32")
    entries: dict[str, content_cache.Entry] = {
        "plain": ({"labels": [{"label": "cat", "score": 0.25}], "n": None}, None, None),
        "embedded": ({"dims": 3}, *vector),
    }
    with unit_of_work(session):
        content_cache.cache_results(session, KEY, entries, TTL_S)

    assert content_cache.cached_results(session, KEY, ["plain", "embedded"], TTL_S) == entries


def test_the_purge_deletes_expired_entries_in_steps(session: Session) -> None:
    expired = [f"x{i}" for i in range(5)]
    write(session, KEY, [*expired, "live"])
    age(session, expired, TTL_S + 60)

    steps = purge_all(session, max_entries=100, batch=2)

    assert [s.expired for s in steps] == [2, 2, 1]
    assert sum(s.evicted for s in steps) == 0
    assert kept(session) == {"live"}


def test_the_purge_trims_to_the_cap_oldest_first(session: Session) -> None:
    digests = [f"d{i}" for i in range(7)]
    write(session, KEY, digests)
    for i, digest in enumerate(digests):  # d0 is the oldest
        age(session, [digest], 100 - i)
    age(session, ["d6"], TTL_S + 60)  # expired: goes first, whatever the cap

    steps = purge_all(session, max_entries=3, batch=2)

    assert sum(s.expired for s in steps) == 1 and sum(s.evicted for s in steps) == 3
    assert kept(session) == {"d3", "d4", "d5"}


def test_a_purge_with_nothing_to_do_deletes_nothing(session: Session) -> None:
    write(session, KEY, ["a", "b"])

    with unit_of_work(session):
        step = content_cache.purge(session, TTL_S, max_entries=2)

    assert step == content_cache.Purged()
    assert session.scalar(select(func.count()).select_from(ContentCache)) == 2


def test_the_sqlite_insert_finds_each_digests_outputs_by_position(session: Session) -> None:
    """The outputs travel apart from the digests and are looked up by position (an index),
    not scanned again per digest; each digest keeps its own outputs."""
    if session.get_bind().dialect.name != "sqlite":
        return
    params = content_cache._documents([("a", {}), ("b", {})], postgres=False)
    params |= {"model_key": "m", "now": "x", "cutoff": "x"}
    connection = session.connection().connection.driver_connection
    statement = f"EXPLAIN QUERY PLAN {content_cache._INSERT_SQLITE}"
    plan = [row[3] for row in connection.execute(statement, params)]
    assert any(step.startswith("SEARCH o USING") and "i=?" in step for step in plan), plan
    digests = [f"d{i}" for i in range(5)]
    with unit_of_work(session):
        content_cache.cache_results(session, "m", {d: entry(d) for d in digests}, 60)
    found = content_cache.cached_results(session, "m", digests, 60)
    assert {d: found[d][0] for d in digests} == {d: entry(d)[0] for d in digests}
