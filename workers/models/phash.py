"""Perceptual hashes (`imagehash.phash`, 64 bits) per image, and near-duplicate groups per job.

The job option `max_distance` and its measured default are declared in `kiln.app.families.phash`.

Grouping joins, with union-find, every pair of hashes within `max_distance` bits; the pairs come
from `hamming.close_pairs`, which does not compare all of them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from kiln.app.families.phash import DEFAULT_MAX_DISTANCE, MAX_DISTANCE_LIMIT, PhashOptions
from kiln.app.results import results
from kiln.workers.models.base import Answers, Batch, ClosedJob
from kiln.workers.models.grouping import components, groups_of
from kiln.workers.models.hamming import close_pairs
from kiln.workers.prep.phash import HASH_SIDE
from kiln.workers.prep.slots import SlotLayout
from kiln.workers.prep.spec import prep_spec

FIELDS = [pa.field("phash", pa.string())]

HASH_SIZE = 8  # bits per side of the hash: 64 in all

_HEX = re.compile(r"[0-9a-fA-F]{16}")


def phashes(pixels: np.ndarray) -> pa.Array:
    """`imagehash.phash` of a batch of 32×32 greyscale images (its steps, batched: the same
    DCTs, the median of each 8×8 corner, the bits above it) as 16-hex-digit strings."""
    import scipy.fftpack  # imagehash's own DCT: the same bits

    dct = scipy.fftpack.dct(scipy.fftpack.dct(pixels, axis=1), axis=2)
    low = dct[:, :HASH_SIZE, :HASH_SIZE].reshape(len(pixels), -1)
    bits = low > np.median(low, axis=1, keepdims=True)
    packed = np.packbits(bits, axis=1)  # 8 bytes a row, most significant bit first
    text = packed.tobytes().hex()
    return pa.array([text[i : i + 16] for i in range(0, len(text), 16)], pa.string())


class PhashPredictor:
    name = "phash"
    backend = "imagehash (CPU)"
    max_batch = 32
    max_runners = 64  # hashing shares no state between threads

    def __init__(self, *, max_pixels: int) -> None:
        self.prep = prep_spec(
            "kiln.workers.prep.phash:PhashPrep",
            {"max_pixels": max_pixels},
            layout=SlotLayout((HASH_SIDE, HASH_SIDE)),
        )

    def infer(self, batch: Batch) -> Answers:
        assert batch.pixels is not None
        return Answers(len(batch), {"phash": phashes(batch.pixels)})

    def finish(self, answers: Answers) -> Answers:
        return answers

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
