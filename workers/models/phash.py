"""Perceptual hashes (`imagehash.phash`, 64 bits) per image, and near-duplicate groups per job.

The job option `max_distance` and its measured default are declared in `kiln.app.families.phash`.

Grouping joins, with union-find, every pair of hashes within `max_distance` bits; the pairs come
from `hamming.close_pairs`, which does not compare all of them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import imagehash
import numpy as np
import pyarrow as pa
from PIL import Image

from kiln.app import results
from kiln.app.core.errors import InputError
from kiln.app.families.phash import DEFAULT_MAX_DISTANCE, MAX_DISTANCE_LIMIT, PhashOptions
from kiln.workers.grouping import components, groups_of
from kiln.workers.models.base import ClosedJob, Prepared
from kiln.workers.models.hamming import close_pairs
from kiln.workers.preprocess import decode_image

FIELDS = [pa.field("phash", pa.string())]

HASH_SIDE = 32  # imagehash.phash: an 8×8 hash from the DCT of a 32×32 greyscale image
# JPEGs decode at a reduced DCT scale that still has 8× the hash's input size, which keeps the
# hash within a bit or two of a full decode at a fraction of its cost.
DRAFT_SIDE = 8 * HASH_SIDE

_HEX = re.compile(r"[0-9a-fA-F]{16}")


class PhashPipeline:
    name = "phash"
    backend = "imagehash (CPU)"
    max_batch = 32
    max_runners = 64  # hashing shares no state between threads

    def __init__(self, *, max_pixels: int) -> None:
        self.max_pixels = max_pixels

    def prepare(self, data: bytes | str) -> Prepared:
        if isinstance(data, str):
            raise InputError("This model takes images, not text.")
        decoded = decode_image(data, max_pixels=self.max_pixels, draft_to=DRAFT_SIDE)
        # What imagehash.phash does first; doing it here keeps large pixels off the runners.
        small = decoded.image.convert("L").resize((HASH_SIDE, HASH_SIDE), Image.Resampling.LANCZOS)
        return Prepared(np.asarray(small))

    def infer(self, rows: Sequence[Prepared]) -> list[Any]:
        # The image is already 32×32 greyscale, so phash's own convert and resize are no-ops.
        return [str(imagehash.phash(Image.fromarray(row.pixels))) for row in rows]

    def finish(self, row: Prepared, raw: Any) -> dict[str, Any]:
        return {"phash": raw}

    def close(self) -> None:
        """Nothing to release."""


def close_job(closed: ClosedJob) -> dict[str, Any]:
    """The job-closed step: near-duplicate groups over all the job's items, written beside the
    shards (`groups.parquet`); their summary goes into the manifest."""
    distance = PhashOptions.stored(closed.job.options).max_distance
    hashed = _hashes(closed)
    groups = near_duplicate_groups([k for k, _h in hashed], [h for _k, h in hashed], distance)
    return {
        "groups": {
            "key": results.write_groups(closed.place, groups),
            "max_distance": distance,
            "groups": len(groups),
            "items_in_groups": sum(len(g) for g in groups),
        }
    }


def _hashes(closed: ClosedJob) -> list[tuple[str, str]]:
    """(key, phash) of the job's items, or of its pipeline's whole library."""
    if closed.library is not None:
        table = closed.library.table
        keys, hashes = table.column("key").to_pylist(), table.column("phash").to_pylist()
        return [(k, h) for k, h in zip(keys, hashes, strict=True) if h]
    return [(key, out["phash"]) for key, out in closed.outputs() if out.get("phash")]


def near_duplicate_groups(
    keys: Sequence[str], hashes: Sequence[str], max_distance: int = DEFAULT_MAX_DISTANCE
) -> list[list[str]]:
    """Groups of keys whose hashes are within `max_distance` bits, joined transitively.

    Only groups of two or more are returned (a key alone is no duplicate of anything). Each
    group lists its keys in input order, and groups are ordered by their first key's position.
    """
    if len(keys) != len(hashes):
        raise ValueError(f"{len(keys)} keys but {len(hashes)} hashes; they must pair up.")
    if not 0 <= max_distance <= MAX_DISTANCE_LIMIT:
        raise ValueError(f"max_distance must be between 0 and {MAX_DISTANCE_LIMIT} bits.")
    values, owner = np.unique(parse_hashes(hashes), return_inverse=True)
    roots = components(len(values), close_pairs(values, max_distance).tolist())
    return groups_of(keys, [roots[u] for u in owner.tolist()])


def parse_hashes(hashes: Sequence[str]) -> np.ndarray:
    """16-hex-digit strings → uint64 values."""
    bad = next((h for h in hashes if not _HEX.fullmatch(h)), None)
    if bad is not None:
        raise ValueError(f"{bad!r} is not a 64-bit hash of 16 hex digits.")
    return np.frombuffer(bytes.fromhex("".join(hashes)), dtype=">u8").astype(np.uint64)
