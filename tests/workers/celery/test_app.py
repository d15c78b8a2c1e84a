"""`make_celery(settings)`: each app owns its task, however many apps a process makes."""

from __future__ import annotations

from pathlib import Path
from queue import Empty

import pytest

from kiln.app.core.config import get_settings
from kiln.app.dispatch.contract import CHUNK_TASK
from kiln.app.dispatch.producer import CeleryDispatcher, transport_options
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


def test_the_embedded_broker_never_shows_a_half_written_message(tmp_path: Path) -> None:
    """kombu's filesystem transport lets a consumer take a message file before its bytes are
    written (the message is then lost); Kiln's writes it aside and renames it into place."""
    app = make_celery(get_settings(data_dir=tmp_path))
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        assert type(connection.transport).__module__ == "kiln.app.dispatch.fs_transport"
        half = Path(channel.data_folder_in) / "1_x.interactive.msg.part"
        half.write_bytes(b'{"headers": ')  # a send in progress
        CeleryDispatcher(app).enqueue_chunk("job", 0, [1], "interactive")
        assert channel._get("interactive")["headers"]["task"] == CHUNK_TASK
        with pytest.raises(Empty):
            channel._get("interactive")  # the partial file is not a message
        assert half.exists()
    app.close()
