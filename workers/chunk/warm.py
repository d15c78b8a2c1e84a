"""What a process's first chunk would pay once, paid while its model loads (`kiln run` warms
the model on a thread while it lists the folder): NumPy's `ma` and Arrow's and Parquet's first
shard table, and the first compile of each statement the chunk path runs.

Nothing is written: the statements run on a job and a run that do not exist, and each is
rolled back.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy.orm import Session

from kiln.app.catalog.catalog import ModelInfo
from kiln.app.db import chunk_runs, content_cache, leases, queries
from kiln.app.db.session import unit_of_work
from kiln.app.results import results
from kiln.workers.chunk.content_cache import scope_key
from kiln.workers.chunk.rows import ChunkRows
from kiln.workers.close.fallback import shard_fields
from kiln.workers.runtime import WorkerRuntime

log = logging.getLogger(__name__)

NO_JOB = ""  # job ids are UUIDs: matches no job
NO_RUN = "warm-up"  # a run's lease token is a UUID: holds no item


def warm(runtime: WorkerRuntime, model: ModelInfo) -> None:
    """Never fails: a chunk pays what the warm-up could not."""
    try:
        warm_arrow(model)
        warm_statements(runtime, model)
    except Exception as error:
        log.info("the chunk path did not warm up: %s", error)


def warm_arrow(model: ModelInfo) -> None:
    """NumPy's `ma` (imported lazily the first time pyarrow converts an array: ~30 ms), and
    Arrow's and Parquet's first shard table, in the model's own columns."""
    import numpy.ma  # noqa: F401  (what pyarrow would import mid-chunk)

    results.to_parquet(ChunkRows([]).table(shard_fields(model, None)))


def warm_statements(runtime: WorkerRuntime, model: ModelInfo) -> None:
    """SQLAlchemy compiles a statement the first time a process runs it: the take's UPDATE
    alone took ~24 ms, the chunk path's statements ~40 ms in all. The reads first, then each
    write in a transaction of its own (on SQLite a write locks the database until its
    rollback: only for its own run, not its compile)."""
    settings = runtime.settings
    with runtime.sessions() as session:
        with _rolled_back(session):
            leases.job_facts(session, NO_JOB)
            leases.holds_any(session, NO_JOB, NO_RUN, [0])
            queries.nothing_open(session, NO_JOB)
            if settings.content_cache:
                scope = scope_key(settings, NO_RUN, model)
                content_cache.cached_results(session, scope, [""], settings.content_cache_ttl_s)
        with _rolled_back(session):
            leases.take_chunk(
                session, NO_JOB, 0, [], NO_RUN, settings.lease_s, settings.max_attempts
            )
        with _rolled_back(session):
            chunk_runs.forget(session, [NO_RUN])


class _Undone(Exception):
    """Ends a warm-up block: the unit of work rolls back what it ran."""


@contextmanager
def _rolled_back(session: Session) -> Iterator[Session]:
    """A block whose transaction is rolled back however it ends (through `unit_of_work`, the
    one place that commits or rolls back: app/__init__.py's rule)."""
    try:
        with unit_of_work(session):
            yield session
            raise _Undone
    except _Undone:
        pass
