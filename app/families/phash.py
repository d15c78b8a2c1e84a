"""phash job options: how close two hashes must be to join a near-duplicate group."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from kiln.app.families.options import Options

# Measured on generated images (shapes, gradients, text; tests/workers/models/test_phash.py)
# with copies resized 0.5–1.5×, re-encoded as JPEG q50–95 and cropped 0–5% a side. Over 256
# originals: resized and JPEG copies stay within 8 bits of their original (most at 0); crops
# spread over 0–24 (median 6; 82% within 10, 91% within 12, 95% within 14). All copies: 94.1%
# within 10, 96.9% within 12. Distinct originals: 1 pair in 32,640 within 10 bits, 5 within 12,
# 8 within 14. 12 is the knee: it is the smallest distance that keeps 95% of copies. The price
# is chance matches in large jobs: among 100,000 random hashes about 1,100 pairs lie within 12
# bits, 60 within 10; a job over a huge unrelated collection may want 10.
DEFAULT_MAX_DISTANCE = 12
# At 16 bits chance matches already join nearly everything: among 100,000 random hashes, 2%
# end up in a group at 12 bits, 30% at 14 and 98% at 16 (in 2 s, 4 s and 9 s on 2 cores).
MAX_DISTANCE_LIMIT = 16


class PhashOptions(Options):
    max_distance: int = Field(DEFAULT_MAX_DISTANCE, ge=0, le=MAX_DISTANCE_LIMIT)

    hints: ClassVar[dict[str, str]] = {
        "max_distance": (
            f"must be a whole number of bits from 0 to {MAX_DISTANCE_LIMIT}; beyond that almost "
            "every image is a near-duplicate of every other"
        )
    }
