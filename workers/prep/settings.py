"""What the prep side reads of the worker's settings, as plain values.

A prep process is spawned: every module it imports is paid again in each of them. This copy
crosses into it in place of `Settings`, so it imports neither pydantic nor the settings module.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kiln.app.core.config import Settings


@dataclass(frozen=True)
class PrepSettings:
    storage_url: str  # Kiln's own store (`store:` sources), opened as `open_store` opens it
    s3_endpoint_url: str | None
    s3_region: str
    local_inputs: bool  # `file://` sources may be read (`kiln run`)
    max_video_frames: int
    max_video_duration_s: float

    @classmethod
    def of(cls, settings: Settings) -> PrepSettings:
        """The same-named values of `settings` (every field here is one of its fields)."""
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls)})
