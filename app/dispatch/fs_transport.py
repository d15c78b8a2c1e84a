"""kombu's filesystem transport (the embedded broker), with atomic sends.

kombu writes a message by opening its final file name and then writing into it; a consumer
listing the folder in between moves away an empty file, fails to parse it, and the message is
lost — a `kiln run` then waits forever on a chunk nobody will run. Here a message is written
under a name consumers skip and renamed into place, which POSIX makes atomic.
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


class Transport(filesystem.Transport):
    Channel = Channel
