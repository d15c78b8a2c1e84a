"""Near-duplicate groups: pairs of items that are close, joined transitively (connected
components). One mechanism for every family that groups: phash pairs hashes within a Hamming
distance (`hamming.close_pairs`); embedders pair vectors above a cosine similarity
(`cosine_pairs`: exact, in blocks, for the sizes a job holds in memory); and byte-identical
inputs, for every model, join the groups a family found (`merge`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import pyarrow as pa

from kiln.app.core.errors import InputError
from kiln.app.results.vector_index import VectorIndex

BLOCK = 2048  # rows of the similarity matrix computed at once: 2048 × n float32 in memory
# Neighbours asked of the approximate index per vector when grouping a large set. Near-
# duplicate groups are small (a photo and its few copies); a larger group still joins through
# chains of neighbours. At 32, a query costs about a millisecond on two cores (bench/README.md).
NEIGHBOURS = 32
# How far below the threshold an index similarity may be and its pair still be scored exactly:
# the index stores float16 vectors (`vector_index.DTYPE`), whose cosines are off by < 1e-3.
INDEX_SLACK = 0.01


class UnionFind:
    def __init__(self, size: int) -> None:
        self.parent = list(range(size))

    def find(self, i: int) -> int:
        parent = self.parent
        while parent[i] != i:
            parent[i] = parent[parent[i]]  # path halving keeps later finds short
            i = parent[i]
        return i

    def union(self, i: int, j: int) -> None:
        a, b = self.find(i), self.find(j)
        if a != b:
            self.parent[max(a, b)] = min(a, b)


def components(size: int, pairs: Iterable[Sequence[int]]) -> list[int]:
    """Each of `size` items' component: the smallest index joined to it through `pairs`."""
    parents = UnionFind(size)
    for i, j in pairs:
        parents.union(int(i), int(j))
    return [parents.find(i) for i in range(size)]


def groups_of(keys: Sequence[str], roots: Sequence[int]) -> list[list[str]]:
    """Keys by component, groups of two or more only (a key alone is no duplicate of
    anything), each in input order, groups in the order of their first key."""
    members: dict[int, list[str]] = {}
    for key, root in zip(keys, roots, strict=True):
        members.setdefault(root, []).append(key)
    return [group for group in members.values() if len(group) > 1]


def unit_rows(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to length 1 (float32), for cosine similarity as a dot product. A row with
    NaN or infinity, or of length 0, has no direction: refused with a sentence."""
    rows = np.asarray(vectors, dtype=np.float32)
    if rows.ndim != 2:
        raise ValueError(f"Vectors must be a 2-D array, not {rows.ndim}-D.")
    bad = ~np.isfinite(rows).all(axis=1)
    if bad.any():
        raise InputError(
            f"{int(bad.sum())} vector(s) hold NaN or infinity; they have no direction."
        )
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    if (norms == 0).any():
        raise InputError("A vector of length 0 has no direction to compare.")
    unit: np.ndarray = rows / norms
    return unit


def cosine_pairs(vectors: np.ndarray, threshold: float, block: int = BLOCK) -> np.ndarray:
    """Every pair (i < j) whose cosine similarity is at least `threshold`, as an [m, 2] int64
    array, computed exactly a block of rows at a time (memory: block × n floats)."""
    if not -1.0 <= threshold <= 1.0:
        raise ValueError("A cosine threshold lies between -1 and 1.")
    rows = unit_rows(vectors)
    found: list[np.ndarray] = []
    for start in range(0, len(rows), block):
        sims = rows[start : start + block] @ rows.T
        i, j = np.nonzero(sims >= threshold - 1e-6)  # float32 rounding at the threshold
        i += start
        keep = i < j
        found.append(np.stack([i[keep], j[keep]], axis=1))
    return np.concatenate(found).astype(np.int64) if found else np.empty((0, 2), np.int64)


def cosine_groups(
    keys: Sequence[str],
    vectors: np.ndarray,
    threshold: float,
    index: VectorIndex | None = None,
    labels: np.ndarray | None = None,
) -> list[list[tuple[str, float]]]:
    """Groups of keys whose vectors are at least `threshold` alike, joined transitively; each
    member with its cosine similarity to the group's first member (1.0 for that one).

    Pairs are found exactly when the set is small (or no `index` is given), else among each
    vector's `NEIGHBOURS` nearest in `index` (which holds these vectors under `labels`)."""
    if len(keys) != len(vectors):
        raise ValueError(f"{len(keys)} keys but {len(vectors)} vectors; they must pair up.")
    if not keys:
        return []
    rows = unit_rows(vectors)
    if index is None or index.exact:
        pairs = cosine_pairs(rows, threshold)
    else:
        where = np.arange(len(rows)) if labels is None else labels
        pairs = neighbour_pairs(index, rows, where, threshold)
    return _members(keys, rows, components(len(keys), pairs.tolist()))


def neighbour_pairs(
    index: VectorIndex,
    rows: np.ndarray,
    labels: np.ndarray,
    threshold: float,
    k: int = NEIGHBOURS,
    block: int = BLOCK * 4,
) -> np.ndarray:
    """Pairs (i < j) of `rows` at least `threshold` alike among each row's `k` nearest in
    `index`; `labels[i]` is row i's label there. [m, 2] int64."""
    order = np.argsort(labels)
    sorted_labels = np.asarray(labels, dtype=np.int64)[order]
    found: list[np.ndarray] = []
    for start in range(0, len(rows), block):
        near, sims = index.neighbours(rows[start : start + block], k + 1)  # +1: itself
        i, col = np.nonzero((near >= 0) & (sims >= threshold - INDEX_SLACK))
        at = np.searchsorted(sorted_labels, near[i, col])
        known = at < len(sorted_labels)
        known[known] = sorted_labels[at[known]] == near[i, col][known]
        j = order[at[known]]
        i = i[known] + start
        keep = i != j
        i, j = i[keep], j[keep]
        # the index's similarity is at half precision: a pair is decided on the rows themselves
        alike = np.einsum("ij,ij->i", rows[i], rows[j]) >= threshold - 1e-6
        low, high = np.minimum(i[alike], j[alike]), np.maximum(i[alike], j[alike])
        found.append(np.stack([low, high], axis=1))
    if not found:
        return np.empty((0, 2), np.int64)
    return np.unique(np.concatenate(found).astype(np.int64), axis=0)


def _members(
    keys: Sequence[str], rows: np.ndarray, roots: Sequence[int]
) -> list[list[tuple[str, float]]]:
    members: dict[int, list[int]] = {}
    for index, root in enumerate(roots):
        members.setdefault(root, []).append(index)
    groups = []
    for indices in members.values():
        if len(indices) < 2:
            continue
        first = rows[indices[0]]
        sims = rows[indices] @ first
        groups.append([(keys[i], round(float(s), 6)) for i, s in zip(indices, sims, strict=True)])
    return groups


@dataclass(frozen=True)
class Groups:
    """Groups as groups.parquet holds them: members in order, each with its similarity to
    the group's first member (None where the grouping has no such measure)."""

    members: list[list[str]]
    similarities: list[list[float | None]]


def groups_in(table: pa.Table | None) -> Groups:
    """The groups a groups.parquet table holds (none without one)."""
    found = Groups([], [])
    if table is None:
        return found
    rows = table.select(["group", "key", "similarity"]).to_pydict()
    last = None
    for group, key, similarity in zip(rows["group"], rows["key"], rows["similarity"], strict=True):
        if group != last:
            found.members.append([])
            found.similarities.append([])
            last = group
        found.members[-1].append(key)
        found.similarities[-1].append(similarity)
    return found


def merge(found: Groups, identical: Sequence[tuple[str, str]]) -> Groups:
    """`found` with every set of byte-identical items joined (transitively) into one group.

    The family's order is kept (its groups' first members stay first); an item only the digest
    brought in comes after, with its identical twin's similarity — 1.0 in a group of identical
    items alone, as no measure can tell identical bytes apart.
    """
    similarity = {
        k: s for keys, sims in zip(found.members, found.similarities, strict=True)
        for k, s in zip(keys, sims, strict=True)
    }  # fmt: skip
    keys = [k for group in found.members for k in group]
    keys += [k for _, k in identical if k not in similarity]
    position = {k: i for i, k in enumerate(keys)}
    roots = components(len(keys), _pairs(found.members, identical, position))
    members: dict[int, list[str]] = {}
    for key, root in zip(keys, roots, strict=True):
        members.setdefault(root, []).append(key)
    twin = _first_twin(identical)
    grouped = [group for group in members.values() if len(group) > 1]
    sims = [[_similarity(k, group, similarity, twin) for k in group] for group in grouped]
    return Groups(grouped, sims)


def _pairs(
    groups: Sequence[Sequence[str]],
    identical: Sequence[tuple[str, str]],
    position: dict[str, int],
) -> list[tuple[int, int]]:
    """Each member joined to the one before it: within a family group, and within a digest."""
    pairs = [(position[a], position[b]) for group in groups for a, b in pairwise(group)]
    for (digest_a, a), (digest_b, b) in pairwise(identical):
        if digest_a == digest_b:
            pairs.append((position[a], position[b]))
    return pairs


def _first_twin(identical: Sequence[tuple[str, str]]) -> dict[str, str]:
    """Each key → the first key with its digest."""
    first: dict[str, str] = {}
    twin: dict[str, str] = {}
    for digest, key in identical:
        twin[key] = first.setdefault(digest, key)
    return twin


def _similarity(
    key: str, group: list[str], known: dict[str, float | None], twin: dict[str, str]
) -> float | None:
    if key in known:
        return known[key]
    if not any(k in known for k in group):
        return 1.0  # a group of identical items alone
    return known.get(twin.get(key, key))
