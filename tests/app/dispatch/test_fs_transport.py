"""The embedded broker's transport (app/dispatch/fs_transport.py): atomic sends, short reads."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from queue import Empty

import pytest

from kiln.app.core.config import get_settings
from kiln.app.dispatch.contract import CHUNK_TASK
from kiln.app.dispatch.fs_transport import WAKE_S
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
