"""Reading chunk messages back out of a real Redis broker, as the reconciler does."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from devstack.services import claim_redis_db, release_redis_db
from kiln.app.core.config import get_settings
from kiln.app.dispatch.contract import CHUNK_TASK, QUEUES
from kiln.app.dispatch.producer import CeleryDispatcher
from kiln.workers.celery.app import KilnCelery, make_celery
from kiln.workers.celery.inflight import chunks_in_flight


@pytest.fixture
def celery(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnCelery]:
    broker = claim_redis_db()  # no worker listens here: messages stay queued
    app = make_celery(get_settings(broker_url=broker, data_dir=tmp_path_factory.mktemp("d")))
    try:
        yield app
    finally:
        app.close()
        release_redis_db(broker)


def test_queued_chunks_are_in_flight_and_nothing_else_is(celery: KilnCelery) -> None:
    dispatcher = CeleryDispatcher(celery)
    dispatcher.enqueue_chunk("job-a", 0, [1, 2], "interactive")
    dispatcher.enqueue_chunk("job-a", 3, [7], "bulk")
    dispatcher.enqueue_ingest("job-b")  # another task: not a chunk

    assert chunks_in_flight(celery, QUEUES, CHUNK_TASK, 60) == {("job-a", 0), ("job-a", 3)}
    assert chunks_in_flight(celery, ["ingest"], CHUNK_TASK, 60) == set()


def test_a_delivered_unacked_chunk_counts_only_while_recent(celery: KilnCelery) -> None:
    CeleryDispatcher(celery).enqueue_chunk("job-c", 1, [5], "interactive")
    with celery.connection_for_read() as connection:
        queue = connection.SimpleQueue("interactive", no_ack=False)
        message = queue.get(timeout=5)  # delivered to us, unacknowledged: as a worker holds it
        assert chunks_in_flight(celery, QUEUES, CHUNK_TASK, 60) == {("job-c", 1)}
        assert chunks_in_flight(celery, QUEUES, CHUNK_TASK, -1) == set()  # delivered "long ago"
        message.ack()
        queue.close()


def test_an_unreadable_broker_is_unknown(tmp_path_factory: pytest.TempPathFactory) -> None:
    embedded = make_celery(get_settings(data_dir=tmp_path_factory.mktemp("e")))
    assert chunks_in_flight(embedded, QUEUES, CHUNK_TASK, 60) is None
    down = make_celery(get_settings(broker_url="redis://127.0.0.1:1/0"))
    down.conf.broker_connection_retry = False
    down.conf.broker_connection_max_retries = 0
    assert chunks_in_flight(down, QUEUES, CHUNK_TASK, 60) is None
