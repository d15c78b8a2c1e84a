"""The producer's side of the contract (app/dispatch/producer.py): the API's Celery app holds
no task code, and `CeleryDispatcher` sends ids as JSON by task name to the contract's queues."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from kiln.app.core.config import Settings
from kiln.app.dispatch.contract import BULK, CHUNK_TASK, INGEST, INGEST_TASK, INTERACTIVE, QUEUES
from kiln.app.dispatch.producer import CeleryDispatcher, make_producer, transport_options
from tests.support import migrated_settings


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    return migrated_settings(tmp_path, monkeypatch)


@pytest.fixture
def producer(settings: Settings) -> Iterator[Celery]:
    app = make_producer(settings)
    yield app
    app.close()


class Outbox:
    """Stands in for a Celery app: keeps what is sent."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send_task(self, name: str, args: list[Any], **options: Any) -> None:
        self.sent.append({"name": name, "args": args, **options})


def test_the_producer_holds_no_task_code(producer: Celery) -> None:
    assert not [name for name in producer.tasks if name.startswith("kiln.")]


def test_the_producer_agrees_with_the_workers_on_queues_and_delivery(producer: Celery) -> None:
    conf = producer.conf
    assert [q.name for q in conf.task_queues] == list(QUEUES)
    assert conf.task_default_queue == INTERACTIVE and not conf.task_create_missing_queues
    assert conf.task_serializer == "json" and conf.accept_content == ["json"]
    assert conf.task_acks_late and conf.task_reject_on_worker_lost
    assert conf.worker_prefetch_multiplier == 1
    assert conf.broker_transport == "kiln.app.dispatch.fs_transport:Transport"  # embedded


def test_a_redis_broker_is_read_in_priority_order(settings: Settings) -> None:
    redis = settings.model_copy(
        update={"broker_url": "redis://127.0.0.1:6379/0", "visibility_timeout_s": 600}
    )
    assert transport_options(redis) == {
        "visibility_timeout": 600,
        "queue_order_strategy": "priority",
    }
    app = make_producer(redis)
    assert app.conf.broker_transport is None  # kombu's own Redis transport
    app.close()


def test_the_embedded_broker_gets_its_folders(settings: Settings) -> None:
    options = transport_options(settings)
    assert Path(options["data_folder_in"]) == settings.broker_dir / "queue"
    assert options["data_folder_in"] == options["data_folder_out"]
    assert (settings.broker_dir / "queue").is_dir() and (settings.broker_dir / "control").is_dir()
    assert options["polling_interval"] == settings.filesystem_polling_ms / 1000


def test_a_chunk_is_sent_by_name_with_its_ids_to_its_queue() -> None:
    outbox = Outbox()
    CeleryDispatcher(outbox).enqueue_chunk("job-1", 3, [7, 8], BULK)  # type: ignore[arg-type]

    [message] = outbox.sent
    assert (message["name"], message["args"]) == (CHUNK_TASK, ["job-1", 3, [7, 8]])
    assert message["queue"] == message["routing_key"] == BULK
    assert json.loads(json.dumps(message["args"])) == message["args"]  # ids only, as JSON


def test_an_ingest_step_goes_to_the_ingest_queue_with_its_owner_and_pause() -> None:
    outbox = Outbox()
    dispatcher = CeleryDispatcher(outbox)  # type: ignore[arg-type]
    dispatcher.enqueue_ingest("job-1")
    dispatcher.enqueue_ingest("job-1", "step-1", countdown=2.0)

    first, second = outbox.sent
    assert (first["name"], first["args"], first["countdown"]) == (
        INGEST_TASK,
        ["job-1", None],
        None,
    )
    assert (second["args"], second["countdown"]) == (["job-1", "step-1"], 2.0)
    assert {m["queue"] for m in outbox.sent} == {m["routing_key"] for m in outbox.sent} == {INGEST}
