"""Nearest neighbours by cosine similarity over a job's (or a pipeline library's) vectors.

One usearch index (HNSW, metric `cos`, vectors stored as float16) per job, built when an
embedding job closes and stored beside its shards; the API loads it to answer searches, a
pipeline run updates its library's in place (`add`, `remove`). usearch labels are integers:
`labels` maps each to the item key it stands for, so a removal leaves no hole that a later
key could be confused with.

Small sets are searched exactly (usearch's brute force over the same stored vectors): below
`EXACT_MAX` that costs less than a millisecond per query on two cores and gives the true
neighbours, so grouping small jobs approximately would only lose pairs for nothing.

Stored as two objects under a prefix: `index.usearch` (usearch's own format) and
`index-keys.parquet` (`label`, `key`).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from usearch.index import BatchMatches, Index

from kiln.app.results.results import Place, to_parquet

INDEX = "index.usearch"
KEYS = "index-keys.parquet"
EXACT_MAX = 20_000  # vectors searched by brute force: ~10 M multiply-adds per query at 512-d
# Candidates a graph search keeps (usearch's default is 64): grouping asks for 33 neighbours of
# every vector, and a pair the search misses can split a group; 128 costs ~1.5x per query.
EXPANSION = 128
# Vectors are stored at half precision: it halves the index and builds and groups ~1.5x
# faster at the same recall (bench/README.md, "vector index"); a cosine moves by ~1e-3 at
# most, which grouping takes back by scoring its candidate pairs on the job's own float32
# vectors (`workers.models.grouping.neighbour_pairs`); a pipeline library, which keeps no
# other copy, groups on the stored ones (a pair within ~1e-3 of the threshold may fall either
# side).
# Candidates a graph insertion keeps: usearch's
# default; 64 builds ~1.8x faster but loses 0.5% of pairs and 2.5% of search recall@10.
DTYPE = "f16"
EXPANSION_ADD = 128
_KEY_FIELDS = [pa.field("label", pa.int64(), nullable=False), pa.field("key", pa.string())]


@dataclass(frozen=True)
class Neighbour:
    key: str
    similarity: float


class VectorIndex:
    """A usearch index and the item key behind each of its labels."""

    def __init__(self, index: Index, labels: dict[int, str]) -> None:
        self.index = index
        self.labels = labels
        self._label_of = {key: label for label, key in labels.items()}

    @classmethod
    def empty(cls, dim: int) -> VectorIndex:
        index = Index(
            ndim=dim,
            metric="cos",
            dtype=DTYPE,
            expansion_add=EXPANSION_ADD,
            expansion_search=EXPANSION,
        )
        return cls(index, {})

    @classmethod
    def build(cls, keys: Sequence[str], vectors: np.ndarray) -> VectorIndex:
        built = cls.empty(int(vectors.shape[1]) if vectors.ndim == 2 else 0)
        built.add(keys, vectors)
        return built

    @property
    def dim(self) -> int:
        return int(self.index.ndim)

    def __len__(self) -> int:
        return len(self.labels)

    def __contains__(self, key: object) -> bool:
        return key in self._label_of

    @property
    def exact(self) -> bool:
        return len(self) <= EXACT_MAX

    def add(self, keys: Sequence[str], vectors: np.ndarray) -> None:
        """Add (or replace) items; a key already present is removed first."""
        if not len(keys):
            return
        self.remove([k for k in keys if k in self._label_of])
        start = max(self.labels, default=-1) + 1
        labels = np.arange(start, start + len(keys), dtype=np.uint64)
        self.index.add(labels, np.ascontiguousarray(vectors, dtype=np.float32))
        for label, key in zip(labels.tolist(), keys, strict=True):
            self.labels[label], self._label_of[key] = key, label

    def remove(self, keys: Sequence[str]) -> int:
        """Remove the items of these keys that the index holds; returns how many."""
        labels = [self._label_of.pop(k) for k in keys if k in self._label_of]
        if labels:
            self.index.remove(np.asarray(labels, dtype=np.uint64))
            for label in labels:
                del self.labels[label]
        return len(labels)

    def label_of(self, key: str) -> int:
        return self._label_of[key]

    def vector_of(self, key: str) -> np.ndarray | None:
        label = self._label_of.get(key)
        if label is None:
            return None
        vector: np.ndarray = np.asarray(self.index.get(np.uint64(label)), dtype=np.float32)
        return vector.reshape(-1)

    def search(self, queries: np.ndarray, k: int) -> list[list[Neighbour]]:
        """The `k` nearest items to each query row, nearest first."""
        labels, sims = self.neighbours(queries, k)
        return [
            [
                Neighbour(self.labels[int(lab)], float(sim))
                for lab, sim in zip(row, srow, strict=True)
                if lab >= 0
            ]
            for row, srow in zip(labels, sims, strict=True)
        ]

    def neighbours(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Labels [n, k] (int64, -1 where the index holds fewer than k) and cosine similarities
        [n, k] (float32) of the `k` nearest items to each query row, nearest first."""
        rows = np.ascontiguousarray(np.atleast_2d(queries), dtype=np.float32)
        count = min(k, len(self))
        if not count or not len(rows):
            return np.full((len(rows), 0), -1, np.int64), np.empty((len(rows), 0), np.float32)
        found = self.index.search(rows, count, exact=self.exact)
        # usearch answers one query row with `Matches`, several with `BatchMatches`
        counts = found.counts if isinstance(found, BatchMatches) else [len(found.keys)]
        labels = np.asarray(found.keys, dtype=np.uint64).astype(np.int64).reshape(len(rows), -1)
        sims = (1.0 - np.asarray(found.distances, dtype=np.float32)).reshape(len(rows), -1)
        missing = np.arange(labels.shape[1])[None, :] >= np.asarray(counts)[:, None]
        labels[missing] = -1
        return labels, sims

    def nbytes(self) -> int:
        return int(self.index.memory_usage)

    def save(self, place: Place) -> dict[str, object]:
        """Write the index and its keys under `place`; what the manifest says of it."""
        saved = self.index.save()  # no path: usearch answers the serialised index
        assert saved is not None
        data = bytes(saved)
        place.store.put(place.key(INDEX), data, "application/octet-stream")
        rows = [{"label": label, "key": key} for label, key in self.labels.items()]
        meta = {"dim": str(self.dim), "bytes": str(len(data))}
        table = pa.Table.from_pylist(rows, schema=pa.schema(_KEY_FIELDS, metadata=meta))
        place.store.put(place.key(KEYS), to_parquet(table), "application/vnd.apache.parquet")
        return {"key": place.key(INDEX), "vectors": len(self), "dim": self.dim, "bytes": len(data)}


def exists(place: Place) -> bool:
    return place.store.exists(place.key(INDEX)) and place.store.exists(place.key(KEYS))


def stored_bytes(place: Place) -> int:
    """The stored index's size, from its keys file (what loading it takes in memory)."""
    meta = pq.read_schema(io.BytesIO(place.store.get(place.key(KEYS)))).metadata or {}
    return int(meta.get(b"bytes", b"0"))


def load(place: Place, local: Path | None = None) -> VectorIndex:
    """The index stored under `place`: read into memory, or, given a `local` file path,
    downloaded there once and memory-mapped (read-only: for searching, not for updates)."""
    table = pq.read_table(io.BytesIO(place.store.get(place.key(KEYS))))
    labels = dict(
        zip(table.column("label").to_pylist(), table.column("key").to_pylist(), strict=True)
    )
    if local is None:
        return VectorIndex(_restored(bytearray(place.store.get(place.key(INDEX)))), labels)
    if not local.exists():
        local.parent.mkdir(parents=True, exist_ok=True)
        part = local.with_suffix(".part")
        part.write_bytes(place.store.get(place.key(INDEX)))
        part.replace(local)
    return VectorIndex(_restored(str(local), view=True), labels)


def _restored(source: bytearray | str, view: bool = False) -> Index:
    index = Index.restore(source, view=view)
    if index is None:  # usearch answers None for bytes that are not one of its indexes
        raise ValueError("The stored vector index is not a usearch index.")
    index.expansion_search = EXPANSION  # type: ignore[misc]  # has a setter; not kept in the file
    return index
