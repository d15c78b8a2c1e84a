"""Embedding job options (`embed`, `text-embed`): near-duplicate groups by cosine similarity."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from kiln.app.families.options import Options

# Where the field settled (docs/architecture.md cites them): clip-retrieval de-duplicates at
# cosine 0.9–0.94, imagededup at 0.9; the photo de-dup system Kiln learned from grouped OpenCLIP
# vectors the same way. Below 0.5 "alike" means little for any embedder.
DEFAULT_THRESHOLD = 0.92
MIN_THRESHOLD = 0.5


class GroupOptions(Options):
    threshold: float = Field(DEFAULT_THRESHOLD, ge=MIN_THRESHOLD, le=1.0)

    hints: ClassVar[dict[str, str]] = {
        "threshold": (
            f"must be a cosine similarity from {MIN_THRESHOLD} to 1 (default "
            f"{DEFAULT_THRESHOLD}); below that, unrelated items join the same group"
        )
    }


class EmbedOptions(Options):
    group: GroupOptions | None = None  # {} for the default threshold; absent: no groups

    hints: ClassVar[dict[str, str]] = {
        "group": 'must be an object such as {"threshold": 0.92}',
        "group.threshold": GroupOptions.hints["threshold"],
    }
