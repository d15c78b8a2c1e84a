"""kombu's filesystem transport (the embedded broker), with atomic sends.

kombu writes a message by opening its final file name and then writing into it; a consumer
listing the folder in between moves away an empty file, fails to parse it, and the message is
lost — a `kiln run` then waits forever on a chunk nobody will run. Here a message is written
under a name consumers skip and renamed into place, which POSIX makes atomic. A read lasts at
most WAKE_S, so a consumer told to stop notices at once; while no message waits, a poll is
one listing of the folder, not kombu's one per queue consumed.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from time import monotonic, sleep
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.json import dumps


class Channel(filesystem.Channel):
    def _put(self, queue: Any, message: Any, **kwargs: Any) -> None:  # type: ignore[override]
        final = (
            Path(self.data_folder_out) / f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        )
        partial = final.with_name(final.name + ".part")  # consumers take only "*.<queue>.msg"
        try:
            partial.write_bytes(dumps(message).encode())  # type: ignore[no-untyped-call]
            partial.replace(final)
        except OSError as error:
            raise ChannelError(f"Cannot add file {final} to directory") from error


WAKE_S = 0.05  # the longest one broker read lasts (Celery's consumer asks for 2 s)


class Transport(filesystem.Transport):
    Channel = Channel

    def drain_events(self, connection: Any, timeout: float | None = None) -> Any:  # type: ignore[override]
        """Celery's consumer loop reads for up to 2 s and looks for a stop request only
        between reads: a read here ends within WAKE_S (it polls the folder every 20 ms
        anyway), so `kiln run` stops its worker at once rather than up to 2 s later. A read
        without a timeout still waits for a message.

        Until a message is in the folder, each poll lists it once (`_message_waiting`):
        kombu's own poll lists and sorts it once per queue consumed (Kiln's four and the
        worker's control queue), ~9 ms of CPU a second of an idle `kiln run`'s worker. Once
        one is there, kombu reads as before, with what is left of the read's time."""
        bounded = timeout if timeout is None else min(timeout, WAKE_S)
        started = monotonic()
        interval = self.polling_interval or 0.0
        if bounded is not None:
            interval = min(interval, bounded)
        while not self._message_waiting():
            if bounded is not None and monotonic() - started >= bounded:
                raise TimeoutError  # socket.timeout, as kombu raises it
            sleep(interval)
        left = None if bounded is None else max(0.0, bounded - (monotonic() - started))
        return super().drain_events(connection, timeout=left)  # type: ignore[no-untyped-call]

    def _message_waiting(self) -> bool:
        """Whether a message file (of any queue) is in the folder consumers read; a folder
        that cannot be listed counts as yes, so kombu's own read says what is wrong."""
        client = self.client
        assert client is not None  # a transport is made by its connection
        folder = client.transport_options.get("data_folder_in", "data_in")
        try:
            names = os.listdir(folder)  # noqa: PTH208 - names only, no Path per file
        except OSError:
            return True
        return any(name.endswith(".msg") for name in names)
