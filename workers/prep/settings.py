"""What the prep side reads of the worker's settings, as plain values.

A prep process is spawned: every module it imports is paid again in each of them. This copy
crosses into it in place of `Settings`, so it imports neither pydantic nor the settings module.
"""

from __future__ import annotations

from dataclasses import dataclass
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
        return cls(
            storage_url=settings.storage_url,
            s3_endpoint_url=settings.s3_endpoint_url,
            s3_region=settings.s3_region,
            local_inputs=settings.local_inputs,
            max_video_frames=settings.max_video_frames,
            max_video_duration_s=settings.max_video_duration_s,
        )
