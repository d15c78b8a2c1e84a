"""The content cache's rows: a result by (scope, model version, input sha256), where the scope
is a tenant or "shared" and is part of `model_key` (kiln.workers.chunk.content_cache.scope_key).

Entries are used for `ttl_s` after they were written, then ignored, and `purge` deletes them —
and the oldest beyond a cap — in small steps, so it never holds many row locks for long. Like
every query helper here, nothing commits: the caller owns the transaction (one per step).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import DateTime, bindparam, delete, func, select, text, tuple_
from sqlalchemy.orm import Session

from kiln.app.db import dialect
from kiln.app.db.models import ContentCache, utcnow

Entry = tuple[dict[str, Any], bytes | None, str | None]  # outputs, vector bytes, vector dtype

PURGE_BATCH = 1000  # rows deleted per step (one short transaction each)


@dataclass(frozen=True)
class Purged:
    expired: int = 0  # older than the time to live
    evicted: int = 0  # the oldest, above the cap on entries

    @property
    def total(self) -> int:
        return self.expired + self.evicted


def _cutoff(ttl_s: float) -> datetime:
    return utcnow() - timedelta(seconds=ttl_s)


def cached_results(
    session: Session, model_key: str, digests: Sequence[str], ttl_s: float
) -> dict[str, Entry]:
    """Stored results of `model_key` for these input digests (the ones it has, written less
    than `ttl_s` ago)."""
    if not digests:
        return {}
    rows = session.execute(
        select(
            ContentCache.sha256,
            ContentCache.outputs,
            ContentCache.vector,
            ContentCache.vector_dtype,
        ).where(
            ContentCache.model_key == model_key,
            dialect.among_text(session, ContentCache.sha256, sorted(set(digests))),
            ContentCache.created_at >= _cutoff(ttl_s),
        )
    )
    return {sha: (outputs, vector, dtype) for sha, outputs, vector, dtype in rows}


def cache_results(
    session: Session, model_key: str, entries: Mapping[str, Entry], ttl_s: float
) -> None:
    """Remember results by input digest; the first writer of a digest wins (same result), but
    an expired entry not purged yet is replaced, so the input is cached again at once.

    Entries without a vector (every family's but an embedding's) travel as one JSON document
    in one statement whose text never changes: many parameter sets (an executemany) cost the
    driver and SQLAlchemy a round of bind processing per row — ~40 µs a row on Postgres, where
    psycopg sends each set as a statement of its own. A vector's raw bytes cannot travel in
    JSON on SQLite 3.40 (no `unhex`), so those entries keep the executemany."""
    plain = sorted((sha, e[0]) for sha, e in entries.items() if e[1] is None)  # one lock order
    vectors = {sha: entry for sha, entry in entries.items() if entry[1] is not None}
    now, cutoff = utcnow(), _cutoff(ttl_s)
    if plain:
        postgres = dialect.on_postgres(session)
        statement = _INSERT_POSTGRES if postgres else _INSERT_SQLITE
        dialect.open_transaction(session)
        params = {"model_key": model_key, "now": now, "cutoff": cutoff}
        session.execute(statement, params | _documents(plain, postgres))
    if vectors:
        _cache_vectors(session, model_key, vectors, now, cutoff)


def _documents(plain: list[tuple[str, dict[str, Any]]], postgres: bool) -> dict[str, str]:
    """The statement's JSON parameters. SQLite: the digests and the outputs in two arrays,
    joined by position, for SQLite 3.40 parses an element's text again for each value read
    out of it (as the results' statement does: `queries.upsert_results`)."""
    if postgres:
        return {"rows": _encode(plain)}
    digests = _encode([sha for sha, _outputs in plain])
    return {"digests": digests, "outputs": _encode([outputs for _sha, outputs in plain])}


# Trees built here (no cycles): not checking for them saves ~20% of the encoding.
_encode = json.JSONEncoder(check_circular=False).encode


_DATES = (
    bindparam("now", type_=DateTime(timezone=True)),
    bindparam("cutoff", type_=DateTime(timezone=True)),
)
_INSERT_POSTGRES = text(
    """
    INSERT INTO content_cache (model_key, sha256, outputs, vector, vector_dtype, created_at)
    SELECT :model_key, e->>0, e->1, NULL, NULL, :now
    FROM json_array_elements(CAST(:rows AS json)) WITH ORDINALITY AS t(e, n)
    ORDER BY n
    ON CONFLICT (model_key, sha256) DO UPDATE SET
        outputs = excluded.outputs, vector = excluded.vector,
        vector_dtype = excluded.vector_dtype, created_at = excluded.created_at
    WHERE content_cache.created_at < :cutoff
    """
).bindparams(*_DATES)
# `WHERE true`: without it SQLite would read the ON CONFLICT as a join's ON. CROSS JOIN keeps
# the digests outside (the outputs found by position through an index), not the other way.
_INSERT_SQLITE = text(
    """
    WITH o AS MATERIALIZED (SELECT key AS i, value AS outputs FROM json_each(:outputs))
    INSERT INTO content_cache (model_key, sha256, outputs, vector, vector_dtype, created_at)
    SELECT :model_key, d.value, o.outputs, NULL, NULL, :now
    FROM json_each(:digests) AS d CROSS JOIN o ON o.i = d.key WHERE true
    ON CONFLICT (model_key, sha256) DO UPDATE SET
        outputs = excluded.outputs, vector = excluded.vector,
        vector_dtype = excluded.vector_dtype, created_at = excluded.created_at
    WHERE content_cache.created_at < :cutoff
    """
).bindparams(*_DATES)


def _cache_vectors(
    session: Session, model_key: str, entries: Mapping[str, Entry], now: datetime, cutoff: datetime
) -> None:
    """Entries with a vector: many parameter sets for one statement (executemany), its text the
    same for every chunk, so it is compiled once."""
    rows = [
        {
            "cutoff": cutoff,
            "model_key": model_key,
            "sha256": sha,
            "outputs": outputs,
            "vector": vector,
            "vector_dtype": dtype,
            "created_at": now,
        }
        for sha, (outputs, vector, dtype) in sorted(entries.items())  # one lock order
    ]
    insert = dialect.insert(session, ContentCache)
    fresh = insert.excluded
    statement = insert.on_conflict_do_update(
        index_elements=[ContentCache.model_key, ContentCache.sha256],
        set_={
            "outputs": fresh.outputs,
            "vector": fresh.vector,
            "vector_dtype": fresh.vector_dtype,
            "created_at": fresh.created_at,
        },
        where=ContentCache.created_at < bindparam("cutoff"),
    )
    session.execute(statement, rows)


def purge(session: Session, ttl_s: float, max_entries: int, batch: int = PURGE_BATCH) -> Purged:
    """One step: delete up to `batch` entries, the expired ones first, then the oldest while
    more than `max_entries` remain. Call again (in a new transaction) while `total == batch`."""
    expired = _delete_oldest(session, batch, before=_cutoff(ttl_s))
    room = batch - expired
    if room <= 0:
        return Purged(expired=expired)
    count = session.scalar(select(func.count()).select_from(ContentCache)) or 0
    over = count - max_entries
    evicted = _delete_oldest(session, min(over, room)) if over > 0 else 0
    return Purged(expired=expired, evicted=evicted)


def _delete_oldest(session: Session, limit: int, before: datetime | None = None) -> int:
    """Delete the `limit` oldest entries (written before `before`, if given). On Postgres rows
    another transaction holds are skipped: a purge never waits on a writer or another purge,
    so it can be in no deadlock (SQLite has one writer at a time and no row locks)."""
    oldest = (
        select(ContentCache.model_key, ContentCache.sha256)
        .order_by(ContentCache.created_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    if before is not None:
        oldest = oldest.where(ContentCache.created_at < before)
    result = session.execute(
        delete(ContentCache)
        .where(tuple_(ContentCache.model_key, ContentCache.sha256).in_(oldest))
        .execution_options(synchronize_session=False)
    )
    return int(result.rowcount)  # type: ignore[attr-defined]
