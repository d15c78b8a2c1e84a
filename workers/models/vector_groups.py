"""The embedding families' job-closed step: the job's vector index, and near-duplicate groups
by cosine similarity when the job asked for them (`options.group`).

The vectors are read back from the job's Parquet shards (they never go to the database) into a
usearch index stored beside them (`app/results/vector_index.py`), which search loads later. Pairs at
or above the threshold are found exactly for small sets and among each vector's nearest
neighbours in the index for large ones, joined transitively (`workers/models/grouping.py`), and
`groups.parquet` is written beside the shards as phash's groups are. A pipeline run also
updates its library's index, and groups over all of it.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kiln.app.families.embed import EmbedOptions
from kiln.app.results import results, vector_index
from kiln.app.results.results import Place
from kiln.app.results.vector_index import VectorIndex
from kiln.workers.models.base import ClosedJob
from kiln.workers.models.grouping import cosine_groups
from kiln.workers.models.library import Library


def close_job(closed: ClosedJob) -> dict[str, Any]:
    """The job's vector index (always: search needs it), a pipeline library's index brought
    up to date, and near-duplicate groups over the one or the other when the job asked."""
    keys, vectors = read_vectors(closed.place)
    summary: dict[str, Any] = {}
    index = VectorIndex.build(keys, vectors) if keys else None
    if index is not None:
        summary["index"] = index.save(closed.place)
    if closed.library is not None:
        index = _library_index(closed.library, keys, vectors)
        summary["library_index"] = index.save(closed.library.place)
        keys, vectors = _all_vectors(index)
    group = EmbedOptions.stored(closed.job.options).group
    if group is not None:
        summary["groups"] = _groups(closed.place, keys, vectors, index, group.threshold)
    return summary


def _groups(
    place: Place, keys: list[str], vectors: np.ndarray, index: VectorIndex | None, threshold: float
) -> dict[str, Any]:
    labels = None if index is None else np.asarray([index.label_of(k) for k in keys], np.int64)
    groups = cosine_groups(keys, vectors, threshold, index, labels)
    key = results.write_groups(
        place,
        [[k for k, _ in members] for members in groups],
        [[s for _, s in members] for members in groups],
    )
    return {
        "key": key,
        "threshold": threshold,
        "groups": len(groups),
        "items_in_groups": sum(len(g) for g in groups),
        "exact": index is None or index.exact,
    }


def _library_index(library: Library, keys: list[str], vectors: np.ndarray) -> VectorIndex:
    """The pipeline's index with this run's changes: what left the library out, the run's
    vectors in (replacing what the index held for their keys)."""
    index = vector_index.load(library.place) if vector_index.exists(library.place) else None
    if index is None or (not len(index) and keys):
        # An empty library's index has no dimension (a first run whose objects all failed):
        # it starts again with this run's.
        index = VectorIndex.empty(int(vectors.shape[1]) if keys else 0)
    index.remove(sorted(library.gone))
    if keys:
        index.add(keys, vectors)
    return index


def _all_vectors(index: VectorIndex) -> tuple[list[str], np.ndarray]:
    labels = sorted(index.labels)
    if not labels:
        return [], np.empty((0, index.dim), np.float32)
    vectors = np.asarray(index.index.get(np.asarray(labels, np.uint64)), dtype=np.float32)
    return [index.labels[label] for label in labels], vectors.reshape(len(labels), -1)


def read_vectors(place: Place) -> tuple[list[str], np.ndarray]:
    """The succeeded items' keys and vectors, shard by shard, in row order within a shard.

    Arrow to NumPy without Python objects per value: a million 512-d vectors are 2 GiB as
    float32, and would be twenty times that as Python lists."""
    keys: list[str] = []
    blocks: list[np.ndarray] = []
    for shard in results.shard_keys(place):
        data = io.BytesIO(place.store.get(shard))
        if "embedding" not in pq.read_schema(data).names:
            continue  # a shard of failed items only
        table = pq.read_table(data, columns=["key", "status", "embedding"])
        done = pc.and_(pc.equal(table["status"], "succeeded"), pc.is_valid(table["embedding"]))
        table = table.filter(done)
        if not table.num_rows:
            continue
        flat = pc.list_flatten(table["embedding"]).to_numpy(zero_copy_only=False)
        keys += table["key"].to_pylist()
        blocks.append(flat.astype(np.float32, copy=False).reshape(table.num_rows, -1))
    return keys, np.concatenate(blocks) if blocks else np.empty((0, 0), np.float32)
