"""The fleet as a tenant sees it: live workers only, other tenants' models counted but never
named; and queue lengths read from Redis (or None where they cannot be)."""

from __future__ import annotations

import time
from datetime import timedelta

from celery import Celery
from sqlalchemy import update
from sqlalchemy.orm import Session

from kiln.app.api.fleet import live_workers
from kiln.app.db import worker_facts
from kiln.app.db.models import SHARED_TENANT, WorkerFacts, utcnow
from kiln.app.db.session import unit_of_work
from kiln.app.dispatch.contract import QUEUES
from kiln.app.dispatch.depths import read_queue_lengths

FACTS = {
    "models": {
        "ocr": {"backend": "onnxruntime", "tenant": SHARED_TENANT, "batches": 3},
        "acme-secret:2": {"backend": "tensorrt", "tenant": "acme"},
        "globex-model:1": {"backend": "tensorrt", "tenant": "globex"},
    },
    "problems": [],
}


def _publish(session: Session, worker: str) -> None:
    with unit_of_work(session):
        worker_facts.publish(session, worker, "host-a", "NVIDIA L4", FACTS, utcnow())


def test_a_tenant_sees_its_own_and_shared_models_and_counts_the_rest(session: Session) -> None:
    _publish(session, "gpu0@host-a")
    [worker] = live_workers(session, "acme")
    assert sorted(worker.facts["models"]) == ["acme-secret:2", "ocr"]
    assert worker.hidden_models == 1 and worker.device == "NVIDIA L4"
    [other] = live_workers(session, "globex")
    assert sorted(other.facts["models"]) == ["globex-model:1", "ocr"]
    assert "acme-secret:2" not in str(other.facts)


def test_a_worker_that_stopped_reporting_ages_out(session: Session) -> None:
    _publish(session, "gpu0@host-a")
    _publish(session, "gpu1@host-a")
    with unit_of_work(session):
        stale = utcnow() - timedelta(seconds=45)
        session.execute(
            update(WorkerFacts).where(WorkerFacts.worker == "gpu1@host-a").values(seen_at=stale)
        )
    assert [w.worker for w in live_workers(session, "acme")] == ["gpu0@host-a"]
    assert [w.worker for w in live_workers(session, "acme", max_age_s=60)] == [
        "gpu0@host-a",
        "gpu1@host-a",
    ]
    with unit_of_work(session):
        worker_facts.forget(session, "gpu0@host-a")
    assert live_workers(session, "acme") == []


def test_queue_lengths_need_a_redis_broker() -> None:
    celery = Celery("t", broker="filesystem://", set_as_current=False)
    assert read_queue_lengths(celery, "filesystem://", QUEUES) is None


def test_a_broker_that_does_not_answer_gives_no_figure_quickly() -> None:
    url = "redis://127.0.0.1:1/0"  # nothing listens on port 1
    celery = Celery("t", broker=url, set_as_current=False)
    started = time.monotonic()
    assert read_queue_lengths(celery, url, QUEUES) is None
    assert time.monotonic() - started < 10  # one quick try, not Celery's hundred retries
