"""The embedded broker's transport (app/dispatch/fs_transport.py): atomic sends."""

from __future__ import annotations

from pathlib import Path
from queue import Empty

import pytest

from kiln.app.core.config import get_settings
from kiln.app.dispatch.contract import CHUNK_TASK
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
