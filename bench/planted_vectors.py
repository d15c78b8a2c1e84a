"""Generated embedding vectors with planted near-duplicates, for the vector index bench.

Originals are unit vectors around topic centres: each is half a centre and half its own random
direction (`TOPIC_WEIGHT`), so two originals of one topic are ~0.5 alike and of two topics ~0,
as real embeddings of related and unrelated pictures are, not all orthogonal. A share of the
rows are copies of a random original, at a cosine to it drawn from `SIMILARITY`, all above the
default grouping threshold: exact grouping finds every planted pair, so what an approximate
search misses is its own loss. Two copies of one original are only ~s1·s2 alike (below the
threshold for the farthest), and join through their original. Rows are shuffled, so copies
are spread through the index's insertion order. Seeded: the same arguments give the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

COPY_SHARE = 0.2  # of all rows
SIMILARITY = (0.93, 0.995)  # cosine of a copy to its original, uniform
TOPIC_SIZE = 1000  # originals per topic, on average
TOPIC_WEIGHT = 0.5  # an original's share of its topic's centre (cosine within a topic)
BLOCK = 65_536  # rows generated at once: float32 temporaries of BLOCK × dim


@dataclass(frozen=True)
class PlantedSet:
    vectors: np.ndarray  # [n, dim] float32, unit rows
    source: np.ndarray  # [n] int64: the row of each row's original (its own for an original)
    similarity: np.ndarray  # [n] float32: cosine to its original (1 for an original)

    @property
    def copies(self) -> int:
        return int((self.source != np.arange(len(self.source))).sum())

    @property
    def copied_originals(self) -> int:
        """Originals with at least one copy: the groups exact grouping should find."""
        is_copy = self.source != np.arange(len(self.source))
        return len(np.unique(self.source[is_copy]))


def unit(rows: np.ndarray) -> np.ndarray:
    scaled: np.ndarray = rows / np.linalg.norm(rows, axis=1, keepdims=True)
    return scaled.astype(np.float32, copy=False)


def near(base: np.ndarray, similarity: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Unit rows at exactly `similarity` (cosine) from the unit rows of `base`: each base row
    plus a random direction orthogonal to it."""
    noise = rng.standard_normal(base.shape, dtype=np.float32)
    noise -= np.einsum("ij,ij->i", noise, base)[:, None] * base
    sims = similarity.astype(np.float32)[:, None]
    return unit(sims * base + np.sqrt(1 - sims**2) * unit(noise))


def planted_set(
    n: int,
    dim: int = 512,
    copy_share: float = COPY_SHARE,
    similarity: tuple[float, float] = SIMILARITY,
    seed: int = 0,
) -> PlantedSet:
    if n < 2 or not 0 <= copy_share < 1:
        raise ValueError("A planted set needs n >= 2 and a copy share in [0, 1).")
    rng = np.random.default_rng(seed)
    copies = round(n * copy_share)
    rows = rng.permutation(n)
    originals, copy_rows = rows[: n - copies], rows[n - copies :]
    vectors = np.empty((n, dim), np.float32)
    _fill_originals(vectors, originals, rng)
    source = np.arange(n, dtype=np.int64)
    sims = np.ones(n, np.float32)
    source[copy_rows] = originals[rng.integers(0, len(originals), copies)]
    sims[copy_rows] = rng.uniform(*similarity, copies)
    for start in range(0, copies, BLOCK):
        at = copy_rows[start : start + BLOCK]
        vectors[at] = near(vectors[source[at]], sims[at], rng)
    return PlantedSet(vectors, source, sims)


def _fill_originals(vectors: np.ndarray, rows: np.ndarray, rng: np.random.Generator) -> None:
    dim = vectors.shape[1]
    centres = unit(rng.standard_normal((max(1, len(rows) // TOPIC_SIZE), dim), np.float32))
    for start in range(0, len(rows), BLOCK):
        at = rows[start : start + BLOCK]
        own = unit(rng.standard_normal((len(at), dim), np.float32))
        topic = centres[rng.integers(0, len(centres), len(at))]
        vectors[at] = unit(np.sqrt(TOPIC_WEIGHT) * topic + np.sqrt(1 - TOPIC_WEIGHT) * own)
