"""Adding a job's items: one statement however many, their counters in the same transaction;
and ending those a locked select names (`end_items`: a cancel, a give-up, a failed job).

Never commits: the caller owns the transaction.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Select, TextClause, bindparam, text, update
from sqlalchemy.orm import Session

from kiln.app.db import counters, dialect
from kiln.app.db.models import Item, utcnow


@dataclass(frozen=True)
class NewItem:
    key: str
    chunk: int
    source: str | None = None
    text: str | None = None
    etag: str | None = None  # of a listed object (bulk jobs)
    frame_index: int | None = None  # a video's sampled frame
    frame_time_s: float | None = None


# Postgres takes the items as one JSON document: the statement text never changes (parsed
# and planned once per connection), and one C-encoded string carries every row.
_COLUMNS = (
    "(job_id, key, source, text, etag, chunk, frame_index, frame_time_s, status, attempts,"
    " queued_at)"
)
_FROM_JSON = """
    SELECT :job_id, v.key, v.source, v.text, v.etag, v.chunk, v.frame_index, v.frame_time_s,
           'pending', 0, :now
    FROM json_to_recordset(CAST(:items AS json))
         AS v(key text, source text, text text, etag text, chunk integer, frame_index integer,
              frame_time_s double precision)
"""
_INSERT = text(f"INSERT INTO items {_COLUMNS} {_FROM_JSON} RETURNING id, chunk")
_INSERT_NEW = text(
    f"INSERT INTO items {_COLUMNS} {_FROM_JSON}"
    " ON CONFLICT (job_id, key) DO NOTHING RETURNING id, chunk"
)


def insert_items(
    session: Session, job_id: str, items: Sequence[NewItem], *, skip_existing: bool = False
) -> dict[int, list[int]]:
    """Add pending items to the job (with `skip_existing`, keys it has already are left as
    they are) and count them; returns the ids of those added, by chunk, in order."""
    if not items:
        return {}
    if dialect.on_postgres(session):
        rows = _insert_postgres(session, job_id, items, skip_existing)
    else:
        rows = _insert_sqlite(session, job_id, items, skip_existing)
    chunks: dict[int, list[int]] = {}
    for item_id, chunk in sorted(rows):
        chunks.setdefault(chunk, []).append(item_id)
    added = counters.Tally(total=len(rows))
    counters.add(session, job_id, counters.slot_of(items[0].chunk), added)
    return chunks


def _values(item: NewItem) -> dict[str, Any]:
    """An item's own columns, as both dialects' statements take them."""
    return {
        "key": item.key,
        "source": item.source,
        "text": item.text,
        "etag": item.etag,
        "chunk": item.chunk,
        "frame_index": item.frame_index,
        "frame_time_s": item.frame_time_s,
    }


def _insert_postgres(
    session: Session, job_id: str, items: Sequence[NewItem], skip_existing: bool
) -> list[tuple[int, int]]:
    rows = [_values(i) for i in items]
    params = {"job_id": job_id, "now": utcnow(), "items": json.dumps(rows)}
    statement = _INSERT_NEW if skip_existing else _INSERT
    return [(int(a), int(b)) for a, b in session.execute(statement, params)]


# SQLite likewise, through json_each: one statement and one bound string however many items
# (no per-row parameters for SQLAlchemy to process), inserted in the array's order.
_FROM_JSON_SQLITE = """
    SELECT :job_id, v.value ->> 'key', v.value ->> 'source', v.value ->> 'text',
           v.value ->> 'etag', v.value ->> 'chunk', v.value ->> 'frame_index',
           v.value ->> 'frame_time_s', 'pending', 0, :now
    FROM json_each(:items) AS v WHERE true ORDER BY v.key
"""


def _sqlite_insert(on_conflict: str) -> TextClause:
    return text(
        f"INSERT INTO items {_COLUMNS} {_FROM_JSON_SQLITE} {on_conflict} RETURNING id, chunk"
    ).bindparams(bindparam("now", type_=Item.__table__.c.queued_at.type))


_INSERT_SQLITE = _sqlite_insert("")
_INSERT_NEW_SQLITE = _sqlite_insert("ON CONFLICT (job_id, key) DO NOTHING")


def _insert_sqlite(
    session: Session, job_id: str, items: Sequence[NewItem], skip_existing: bool
) -> list[tuple[int, int]]:
    # not ASCII-escaped: a name Python cannot encode fails here, as a bound string would
    params = {
        "job_id": job_id,
        "now": utcnow(),
        "items": json.dumps([_values(i) for i in items], ensure_ascii=False),
    }
    statement = _INSERT_NEW_SQLITE if skip_existing else _INSERT_SQLITE
    return [(int(a), int(b)) for a, b in session.execute(statement, params)]


def end_items(
    session: Session,
    chosen: Select[Any],
    status: str,
    error: str | ColumnElement[str],
    now: datetime,
) -> int:
    """End the items `chosen` names (their ids, locked in id order, as a lease takes them, so
    the two queue instead of deadlocking) as `status` with `error`, their lease cleared; how
    many. Not counted: the caller adds them to its counter."""
    result = session.execute(
        update(Item)
        .where(Item.id.in_(chosen))
        .values(status=status, error=error, finished_at=now, lease_owner=None,
                lease_expires_at=None)
        .execution_options(synchronize_session=False)
    )  # fmt: skip
    return int(result.rowcount)  # type: ignore[attr-defined]
