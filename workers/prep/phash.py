"""The prep half of `phash`: what `imagehash.phash` does before its DCT — greyscale, 32×32 by
Lanczos — written into the row's slot; the DCT and the bits run per batch (workers/models/phash)."""

from __future__ import annotations

import numpy as np
from PIL import Image

from kiln.workers.prep.images import images_only
from kiln.workers.prep.pixels import Decoded, decode_image

HASH_SIDE = 32  # imagehash.phash: an 8×8 hash from the DCT of a 32×32 greyscale image
# JPEGs decode at a reduced DCT scale that still has 8× the hash's input size, which keeps the
# hash within a bit or two of a full decode at a fraction of its cost.
DRAFT_SIDE = 8 * HASH_SIDE


class PhashPrep:
    def __init__(self, max_pixels: int) -> None:
        self.max_pixels = max_pixels

    def prepare(self, data: bytes | str, slot: np.ndarray | None, meta: np.ndarray) -> None:
        decoded = decode_image(images_only(data), max_pixels=self.max_pixels, draft_to=DRAFT_SIDE)
        self.prepare_decoded(decoded, slot, meta)

    # A video frame's grey comes from its decoder's luma, no RGB made (`FrameModePrep`): less
    # work per frame, and hashes within two bits of the RGB path's (bench/README.md, Video).
    frame_mode = "L"

    def frame_size(self, width: int, height: int) -> tuple[int, int]:
        return DRAFT_SIDE, DRAFT_SIDE

    def prepare_decoded(self, decoded: Decoded, slot: np.ndarray | None, meta: np.ndarray) -> None:
        small = decoded.image.convert("L").resize((HASH_SIDE, HASH_SIDE), Image.Resampling.LANCZOS)
        assert slot is not None
        slot[...] = np.asarray(small)
