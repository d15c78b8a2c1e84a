"""kombu's filesystem transport (the embedded broker), with atomic sends.

kombu writes a message by opening its final file name and then writing into it; a consumer
listing the folder in between moves away an empty file, fails to parse it, and the message is
lost — a `kiln run` then waits forever on a chunk nobody will run. Here a message is written
under a name consumers skip and renamed into place, which POSIX makes atomic. A read lasts at
most WAKE_S, so a consumer told to stop notices at once.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from time import monotonic
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
        without a timeout still waits for a message."""
        bounded = timeout if timeout is None else min(timeout, WAKE_S)
        return super().drain_events(connection, timeout=bounded)  # type: ignore[no-untyped-call]
