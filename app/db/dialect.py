"""What differs between the two databases Kiln runs on (PostgreSQL, and SQLite for one-host use):
which one a session is bound to, and the `INSERT … ON CONFLICT` statement, which SQLAlchemy
builds per dialect."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Text,
    any_,
    bindparam,
    func,
    literal_column,
    select,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import QueryableAttribute, Session
from sqlalchemy.sql.selectable import ScalarSelect


def on_postgres(session: Session) -> bool:
    return session.get_bind().dialect.name == "postgresql"


def insert(session: Session, table: Any) -> postgresql.Insert | sqlite.Insert:
    """An INSERT into `table` (a mapped class) that can take `on_conflict_do_…`, for the
    database `session` is bound to."""
    return postgresql.insert(table) if on_postgres(session) else sqlite.insert(table)


def among(
    session: Session, column: QueryableAttribute[int], values: Sequence[int]
) -> ColumnElement[bool]:
    """`column IN values` for a list of ids: on Postgres `= ANY(:array)`, one parameter
    however many values (an IN list renders a parameter per value on every execution)."""
    if on_postgres(session):
        return column == any_(bindparam(None, list(values), type_=postgresql.ARRAY(BigInteger)))
    # SQLite: the ids as one JSON parameter too (an IN list renders and binds each id on every
    # execution: a chunk's lease is 512 of them).
    ids: ScalarSelect[Any] = (
        select(literal_column("value", BigInteger))
        .select_from(func.json_each(bindparam(None, json.dumps([int(v) for v in values]), Text)))
        .scalar_subquery()
    )
    return column.in_(ids)


def checked(session: Session, term: ColumnElement[bool]) -> ColumnElement[bool]:
    """`term` as a check on the rows `among` finds by id, not a way to find them: on SQLite
    wrapped in `likely()`, so the planner looks the ids up by primary key rather than scan an
    index on the term's column (`job_id = ?` scanned every item of the job, per chunk: a
    chunk's lease grew with its job). Postgres plans by its statistics: the term as it is."""
    return term if on_postgres(session) else func.likely(term)


def among_text(
    session: Session, column: QueryableAttribute[str | None], values: Sequence[str]
) -> ColumnElement[bool]:
    """`column IN values` for strings, one parameter however many: `= ANY(:array)` on Postgres,
    a JSON array on SQLite, as `among` does for ids (a chunk's content cache lookup is 512
    digests)."""
    if on_postgres(session):
        return column == any_(bindparam(None, list(values), type_=postgresql.ARRAY(Text)))
    strings: ScalarSelect[Any] = (
        select(literal_column("value", Text))
        .select_from(func.json_each(bindparam(None, json.dumps(list(values)), Text)))
        .scalar_subquery()
    )
    return column.in_(strings)


def open_transaction(session: Session) -> None:
    """Make sure a write that opens with `WITH` runs inside the session's transaction on
    SQLite: Python's sqlite3 begins a transaction by itself only before INSERT, UPDATE,
    DELETE and REPLACE, so a CTE-led UPDATE as a unit's first write would commit on its own,
    apart from what the unit writes after it. Postgres needs nothing."""
    if on_postgres(session):
        return
    driver = session.connection().connection.driver_connection
    if driver is not None and not driver.in_transaction:
        driver.execute("BEGIN")
