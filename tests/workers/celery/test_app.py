"""`make_celery(settings)`: each app owns its task, however many apps a process makes."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.app.dispatch.contract import CHUNK_TASK
from kiln.app.dispatch.producer import transport_options
from kiln.workers.celery.app import make_celery
from tests.support import migrated_settings


def test_each_app_runs_its_own_chunk_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Celery shares decorated tasks with every app made later unless told not to; the second
    app's chunks would then run against the first app's runtime (its database, its store)."""
    first = make_celery(migrated_settings(tmp_path / "one", monkeypatch))
    second = make_celery(migrated_settings(tmp_path / "two", monkeypatch))
    try:
        one, two = first.tasks[CHUNK_TASK], second.tasks[CHUNK_TASK]  # finalizes both
        assert one.app is first and two.app is second
        assert one.run is not two.run
    finally:
        first.close()
        second.close()


def test_queues_and_delivery_guarantees(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app = make_celery(migrated_settings(tmp_path, monkeypatch))
    try:
        assert [q.name for q in app.conf.task_queues] == [
            "interactive",
            "ingest",
            "bulk",
            "control",
        ]  # the order workers consume them in
        redis = migrated_settings(tmp_path, monkeypatch).model_copy(
            update={"broker_url": "redis://127.0.0.1:6379/0"}
        )
        assert transport_options(redis)["queue_order_strategy"] == "priority"
        assert app.conf.task_acks_late and app.conf.task_reject_on_worker_lost
        assert app.conf.task_serializer == "json" and app.conf.accept_content == ["json"]
    finally:
        app.close()


def test_no_result_backend_is_looked_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kiln keeps no results in Celery: the disabled backend, without Celery reading every
    installed package's entry points for backends (per thread, on every run)."""
    from celery.backends.base import DisabledBackend

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the result backends' entry points were read")

    monkeypatch.setattr("celery.app.backends.load_extension_class_names", refuse)
    app = make_celery(migrated_settings(tmp_path, monkeypatch))
    try:
        assert isinstance(app.backend, DisabledBackend)
    finally:
        app.close()
