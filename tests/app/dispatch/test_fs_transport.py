"""The embedded broker's transport (app/dispatch/fs_transport.py): atomic sends, short reads."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from queue import Empty
from typing import Any

import pytest

from kiln.app.core.config import get_settings
from kiln.app.dispatch.contract import CHUNK_TASK, QUEUES
from kiln.app.dispatch.fs_transport import WAKE_S, Channel
from kiln.app.dispatch.producer import CeleryDispatcher, make_producer


def test_the_embedded_broker_never_shows_a_half_written_message(tmp_path: Path) -> None:
    """kombu's filesystem transport lets a consumer take a message file before its bytes are
    written (the message is then lost); Kiln's writes it aside and renames it into place."""
    app = make_producer(get_settings(data_dir=tmp_path))
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


def test_a_read_ends_soon_so_a_stopping_worker_is_not_kept_waiting(tmp_path: Path) -> None:
    """Celery's consumer reads for 2 s and looks for a stop between reads: a read here gives
    up within WAKE_S, so `kiln run` stops its worker at once."""
    app = make_producer(get_settings(data_dir=tmp_path))
    with app.connection_for_read() as connection:
        connection.default_channel.basic_consume("interactive", True, lambda _m: None, "test")
        started = time.monotonic()
        with pytest.raises(socket.timeout):
            connection.drain_events(timeout=2.0)
        assert time.monotonic() - started < 10 * WAKE_S
    app.close()


def test_an_empty_folder_is_listed_once_a_poll_and_a_message_is_still_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While no message waits, a read lists the folder once a poll: kombu's per-queue read
    (a listing and a sort each) runs only once a message file is there."""
    app = make_producer(get_settings(data_dir=tmp_path))
    reads: list[str] = []
    real_get = Channel._get

    def counted(channel: Channel, queue: str) -> Any:
        reads.append(queue)
        return real_get(channel, queue)  # type: ignore[no-untyped-call]

    monkeypatch.setattr(Channel, "_get", counted)
    with app.connection_for_read() as connection:
        got: list[Any] = []
        for queue in QUEUES:
            connection.default_channel.basic_consume(queue, True, got.append, queue)
        with pytest.raises(socket.timeout):
            connection.drain_events(timeout=2.0)
        assert reads == []  # nothing waited: no queue was read
        CeleryDispatcher(app).enqueue_chunk("job", 0, [1], "bulk")
        connection.drain_events(timeout=2.0)
        assert [m.headers["task"] for m in got] == [CHUNK_TASK]
    app.close()
