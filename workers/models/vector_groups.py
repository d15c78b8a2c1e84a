"""The embedding families' job-closed step: near-duplicate groups by cosine similarity over
every vector the job wrote, when the job asked for them (`options.group`).

The vectors are read back from the job's Parquet shards (they never go to the database), the
pairs at or above the threshold are found exactly (`grouping.cosine_pairs`, in blocks) and
joined transitively, and `groups.parquet` is written beside the shards as phash's groups are.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from kiln.app import results
from kiln.app.families.embed import EmbedOptions
from kiln.app.results import Place
from kiln.workers.grouping import cosine_groups
from kiln.workers.models.base import ClosedJob

# Exact grouping compares every pair (n² dot products, in blocks): 50,000 vectors of 512
# dimensions is ~1.3·10^12 multiply-adds, seconds to a minute on two cores. Beyond it a job
# needs an approximate index, which is not built yet: the manifest says so instead of a worker
# spending hours in the job-closed step.
MAX_EXACT = 50_000


def close_job(closed: ClosedJob) -> dict[str, Any]:
    group = EmbedOptions.stored(closed.job.options).group
    if group is None:
        return {}
    keys, vectors = read_vectors(closed.place)
    if len(keys) > MAX_EXACT:
        return {
            "groups": {
                "skipped": f"{len(keys):,} vectors is more than exact grouping takes "
                f"({MAX_EXACT:,}); grouping by an approximate index is not built yet",
                "threshold": group.threshold,
            }
        }
    groups = cosine_groups(keys, vectors, group.threshold)
    key = results.write_groups(
        closed.place,
        [[k for k, _ in members] for members in groups],
        [[s for _, s in members] for members in groups],
    )
    return {
        "groups": {
            "key": key,
            "threshold": group.threshold,
            "groups": len(groups),
            "items_in_groups": sum(len(g) for g in groups),
        }
    }


def read_vectors(place: Place) -> tuple[list[str], np.ndarray]:
    """The succeeded items' keys and vectors, shard by shard, in key order within a shard."""
    keys: list[str] = []
    blocks: list[np.ndarray] = []
    for shard in results.shard_keys(place):
        table = pq.read_table(io.BytesIO(place.store.get(shard)))
        if "embedding" not in table.column_names:
            continue  # a shard of failed items only
        rows = table.to_pydict()
        for key, status, vector in zip(rows["key"], rows["status"], rows["embedding"], strict=True):
            if status == "succeeded" and vector is not None:
                keys.append(key)
                blocks.append(np.asarray(vector, dtype=np.float32))
    return keys, np.stack(blocks) if blocks else np.empty((0, 0), np.float32)
