"""The bigjob case's job, written with COPY, is the job `submit_job` would record (Postgres)."""

from __future__ import annotations

import psycopg
import pytest

from bench.cases.bigjob import chunk_item_ids, create_big_job, database_dsn, seed_counters
from devstack.services import create_database, drop_database
from kiln.app.core.config import get_settings
from kiln.app.db.migrate import upgrade

pytestmark = pytest.mark.integration


def test_big_job_rows_match_what_submit_records(postgres_url: str) -> None:
    upgrade(get_settings(database_url=postgres_url))
    dsn = database_dsn(postgres_url)
    job_id = create_big_job(
        dsn, tenant="t", model_ref="null:1", total=100, chunk_size=32, inputs=["store:a", "store:b"]
    )
    with psycopg.connect(dsn) as conn:
        job = conn.execute(
            "SELECT status, chunk_count, queue, options::text FROM jobs WHERE id = %s", (job_id,)
        ).fetchone()
        chunks = conn.execute(
            "SELECT chunk, count(*), count(DISTINCT source), count(queued_at) FROM items"
            " WHERE job_id = %s AND status = 'pending' AND attempts = 0"
            " GROUP BY chunk ORDER BY chunk",
            (job_id,),
        ).fetchall()
        counters = conn.execute("SELECT to_regclass('job_counters') IS NOT NULL").fetchone()
        assert counters is not None
        if counters[0]:  # the schema keeps counters: the job's total is there from the start
            total = conn.execute(
                "SELECT sum(total) FROM job_counters WHERE job_id = %s", (job_id,)
            ).fetchone()
            assert total == (100,)
    assert job == ("queued", 4, "bulk", "{}")
    assert chunks == [(0, 32, 2, 32), (1, 32, 2, 32), (2, 32, 2, 32), (3, 4, 2, 4)]
    first = chunk_item_ids(dsn, job_id, 2)
    assert sorted(first) == [0, 1]
    assert [len(ids) for ids in first.values()] == [32, 32]
    assert first[0] == sorted(first[0]) and first[0][-1] < first[1][0]


def test_seed_counters_does_nothing_without_the_table(postgres_url: str) -> None:
    url = create_database(prefix="kiln_test")  # beside the fixture's (which says if PG is up)
    try:
        with psycopg.connect(database_dsn(url)) as conn:
            seed_counters(conn, "no-such-job", 5)  # an empty database: no table, no error
    finally:
        drop_database(url)
