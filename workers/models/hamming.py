"""All pairs of 64-bit hashes within a Hamming distance, without comparing every pair.

Multi-index hashing (Norouzi, Punjani & Fleet, 2012). The 64 bits are split into `m` bands; if
two hashes differ in at most d = m·r + a bits, then one of the first a + 1 bands differs in at
most r bits, or one of the others in at most r − 1 (else the total would exceed d). So per band
each hash only looks into the buckets whose band value lies within that radius of its own, and
the candidates found there are checked on all 64 bits. `m` is chosen by the expected work for
uniformly spread hashes; hashes that crowd into few buckets cost more, up to all pairs.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import combinations
from math import comb

import numpy as np

HASH_BITS = 64
_MAX_BAND_BITS = 22  # a band's bucket table: 2^22 int32 counts = 16 MiB at most
_PROBES = 1 << 21  # probes per vectorised step
_CANDIDATES = 1 << 22  # candidate pairs per vectorised step: bounds memory on crowded buckets


def close_pairs(values: np.ndarray, max_distance: int) -> np.ndarray:
    """Index pairs (i < j) of distinct uint64 `values` within `max_distance` bits: [P, 2],
    sorted."""
    found = [np.empty((0, 2), dtype=np.int32)]
    for band in Bands.choose(len(values), max_distance).each():
        found.extend(_band_pairs(values, band, max_distance))
    pairs = np.sort(np.concatenate(found).astype(np.int64), axis=1)
    return np.unique(pairs, axis=0)  # a pair close in several bands is found in each


@dataclass(frozen=True)
class Band:
    positions: tuple[int, ...]  # the hash bits this band reads
    radius: int  # search radius within the band

    @property
    def bits(self) -> int:
        return len(self.positions)

    def keys(self, values: np.ndarray) -> np.ndarray:
        """Each hash's band value."""
        keys = np.zeros(len(values), dtype=np.int32)
        for j, position in enumerate(self.positions):
            bit = (values >> np.uint64(position)) & np.uint64(1)
            keys |= bit.astype(np.int32) << j
        return keys


@dataclass(frozen=True)
class Bands:
    count: int
    max_distance: int

    @classmethod
    def choose(cls, n: int, max_distance: int) -> Bands:
        """The split with the least expected work for n uniformly spread hashes."""
        fewest = -(-HASH_BITS // _MAX_BAND_BITS)
        options = [cls(m, max_distance) for m in range(fewest, HASH_BITS + 1)]
        return min(options, key=lambda bands: bands.cost(n))

    def each(self) -> Iterator[Band]:
        r, a = divmod(self.max_distance, self.count)
        for k in range(self.count):
            radius = r if k <= a else r - 1
            if radius >= 0:
                # Strided bits: each band mixes low and high DCT frequencies, whose bits are
                # not equally spread, so no band's buckets crowd more than another's.
                yield Band(tuple(range(k, HASH_BITS, self.count)), radius)

    def cost(self, n: int) -> float:
        """Probes plus expected candidates."""
        return float(sum(n * _ball(b.bits, b.radius) * (1 + n / 2**b.bits) for b in self.each()))


def _ball(bits: int, radius: int) -> int:
    return sum(comb(bits, k) for k in range(radius + 1))


def _flip_masks(bits: int, radius: int) -> np.ndarray:
    """Every non-zero mask of at most `radius` set bits among `bits`."""
    masks = [
        sum(1 << b for b in chosen)
        for k in range(1, radius + 1)
        for chosen in combinations(range(bits), k)
    ]
    return np.asarray(masks, dtype=np.int32)


def _band_pairs(values: np.ndarray, band: Band, max_distance: int) -> Iterator[np.ndarray]:
    table = _Table.build(values, band)
    yield from table.same_bucket(max_distance)
    flips = _flip_masks(band.bits, band.radius)
    top_bits = np.floor(np.log2(np.maximum(flips, 1))).astype(np.int32)
    for top in range(band.bits):
        # Each unordered pair of buckets once: probed from the bucket whose value is the
        # smaller one, which is the one with a 0 where the flip's highest bit is.
        rows = np.flatnonzero((table.keys >> top) & 1 == 0).astype(np.int32)
        group = flips[top_bits == top]
        step = max(1, _PROBES // max(1, len(group)))
        for first in range(0, len(rows) if len(group) else 0, step):
            yield from table.probe(rows[first : first + step], group, max_distance)


@dataclass(frozen=True)
class _Table:
    """One band: each hash's band value, and the hashes sorted by it into buckets."""

    values: np.ndarray  # uint64 hashes
    keys: np.ndarray  # each hash's band value
    order: np.ndarray  # sorted position → index into `values`
    sorted_values: np.ndarray  # values[order]
    counts: np.ndarray  # bucket size per band value
    starts: np.ndarray  # first sorted position per band value

    @classmethod
    def build(cls, values: np.ndarray, band: Band) -> _Table:
        keys = band.keys(values)
        counts = np.bincount(keys, minlength=1 << band.bits).astype(np.int32)
        starts = (np.cumsum(counts) - counts).astype(np.int32)
        order = np.argsort(keys, kind="stable").astype(np.int32)
        return cls(values, keys, order, values[order], counts, starts)

    def same_bucket(self, max_distance: int) -> Iterator[np.ndarray]:
        """Pairs with equal band values: each sorted position with the rest of its bucket."""
        positions = np.arange(len(self.keys), dtype=np.int32)
        bucket = self.keys[self.order]
        rest = self.starts[bucket] + self.counts[bucket] - positions - 1
        for a, b in _spans(rest):
            mine = self.order[np.repeat(positions[a:b], rest[a:b])]
            yield self._close(mine, _ranges(positions[a:b] + 1, rest[a:b]), max_distance)

    def probe(self, rows: np.ndarray, flips: np.ndarray, max_distance: int) -> Iterator[np.ndarray]:
        """Pairs of these hashes with the hashes in buckets `flips` away from theirs."""
        near = self.keys[rows, None] ^ flips[None, :]
        hits = self.counts[near]
        totals = hits.sum(axis=1)
        for a, b in _spans(totals):
            mine = np.repeat(rows[a:b], totals[a:b])
            theirs = _ranges(self.starts[near[a:b]].ravel(), hits[a:b].ravel())
            yield self._close(mine, theirs, max_distance)

    def _close(self, mine: np.ndarray, theirs: np.ndarray, max_distance: int) -> np.ndarray:
        """The pairs (index, sorted position) within `max_distance` on all 64 bits."""
        keep = np.bitwise_count(self.values[mine] ^ self.sorted_values[theirs]) <= max_distance
        return np.stack([mine[keep], self.order[theirs[keep]]], axis=1)


def _spans(totals: np.ndarray) -> Iterator[tuple[int, int]]:
    """Consecutive row ranges with about `_CANDIDATES` candidates each (one row may exceed)."""
    ends = np.cumsum(totals, dtype=np.int64)
    if not len(ends) or ends[-1] == 0:
        return
    cuts = np.searchsorted(ends, np.arange(_CANDIDATES, ends[-1], _CANDIDATES), side="right")
    bounds = np.unique(np.concatenate([[0], cuts, [len(totals)]]))
    yield from zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The concatenation of range(s, s + c) for each (s, c), vectorised."""
    ends = np.cumsum(counts, dtype=np.int32)
    offsets = np.repeat(starts - (ends - counts), counts)
    return offsets + np.arange(int(ends[-1]) if len(ends) else 0, dtype=np.int32)
