"""A pipeline's library: every object its runs have processed, kept up to date run by run.

An incremental run processes only new and changed objects, so grouping its items alone would
never compare a new photo with last month's. When a pipeline run closes, its rows update the
library (its succeeded items replace what the library held for their keys; objects deleted
from the source, or that changed and now fail, leave it), and the run's groups are taken
over the whole library. The library lives in Kiln's own store, one per pipeline and model
version (a new version reprocesses everything, so it starts a library of its own):

    pipelines/<pipeline id>/<model ref>/library.parquet   key, sha256, the family's columns

Families whose features are too large for a table rewritten each run (embeddings) keep them
in their own file beside it (the vector index), updated with `Library.gone` and the run's rows.
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kiln.app.results import results
from kiln.app.results.results import Place
from kiln.app.results.results import (
    library_place as library_place,  # where it lives: kiln.app reads it
)

TABLE = "library.parquet"
PARQUET = "application/vnd.apache.parquet"
_BASE = ["key", "sha256"]


@dataclass(frozen=True)
class Library:
    """The library after this run: `table` holds every object the pipeline has processed
    successfully; `gone` the keys this run took out of it (before adding its own rows back)."""

    place: Place
    table: pa.Table
    gone: frozenset[str]
    added: int

    def identical(self) -> list[tuple[str, str]]:
        """(sha256, key) of library objects whose bytes another object shares."""
        digests = self.table.column("sha256").to_pylist()
        keys = self.table.column("key").to_pylist()
        counts: dict[str, int] = {}
        for digest in digests:
            if digest is not None:
                counts[digest] = counts.get(digest, 0) + 1
        shared = [(d, k) for d, k in zip(digests, keys, strict=True) if d and counts[d] > 1]
        return sorted(shared, key=lambda pair: pair[0])  # stable: library order within a digest

    def summary(self) -> dict[str, object]:
        return {"key": self.place.key(TABLE), "objects": self.table.num_rows, "added": self.added}


def update(library: Place, run: Place, columns: Sequence[str]) -> Library:
    """Fold a closed run's shards into the library (`columns`: the family's own, besides key
    and sha256) and write it back."""
    old = read(library, columns)
    ran = run_rows(run, columns)
    gone = set(ran.column("key").to_pylist()) | deleted_keys(run)
    # A video rerun or deleted takes all its old frames with it (a shorter new cut has fewer).
    files = pa.array(sorted({file_of(key) for key in gone}), pa.string())
    leaving = pc.is_in(_files(old.column("key")), files)
    kept = old.filter(pc.invert(leaving))
    succeeded = ran.filter(pc.equal(ran.column("status"), "succeeded")).drop_columns(["status"])
    table = pa.concat_tables([kept, succeeded.cast(kept.schema)])
    library.store.put(library.key(TABLE), results.to_parquet(table), PARQUET)
    taken_out = old.filter(leaving).column("key").to_pylist()
    return Library(library, table, frozenset(taken_out), succeeded.num_rows)


_FRAGMENT = r"#t=\d+\.\d{3}$"  # a video frame's key: the video's, then its moment


def file_of(key: str) -> str:
    """The object a library key came from: a video frame's video, else the key itself."""
    return re.sub(_FRAGMENT, "", key)


def _files(keys: pa.ChunkedArray | pa.Array) -> pa.Array:
    return pc.replace_substring_regex(keys, _FRAGMENT, "")


def read(library: Place, columns: Sequence[str]) -> pa.Table:
    """The library as last written (empty before the pipeline's first run closes)."""
    schema = _schema(columns)
    if not library.store.exists(library.key(TABLE)):
        return schema.empty_table()
    table = pq.read_table(io.BytesIO(library.store.get(library.key(TABLE))))
    return table.select(schema.names).cast(schema)


def run_rows(run: Place, columns: Sequence[str]) -> pa.Table:
    """key, status, sha256 and the family's columns of every row of the run's shards."""
    names = ["key", "status", "sha256", *columns]
    schema = pa.schema([_field(name) for name in names])
    tables = []
    for shard in results.shard_keys(run):
        table = pq.read_table(io.BytesIO(run.store.get(shard)))
        present = [n for n in names if n in table.column_names]
        table = table.select(present)
        for name in names:  # a shard of failed items only has no output columns
            if name not in table.column_names:
                table = table.append_column(name, pa.nulls(table.num_rows, schema.field(name).type))
        tables.append(table.select(names).cast(schema))
    return pa.concat_tables(tables) if tables else schema.empty_table()


def deleted_keys(run: Place) -> set[str]:
    """The objects the run's listing found deleted (deleted.parquet, if any)."""
    key = results.deleted_key(run)
    if not run.store.exists(key):
        return set()
    return set(pq.read_table(io.BytesIO(run.store.get(key))).column("key").to_pylist())


# The family columns a library keeps, by name: the same types the shards hold.
_COLUMN_TYPES = {"phash": pa.string()}


def _field(name: str) -> pa.Field:
    if name in ("key", "status", "sha256"):
        return pa.field(name, pa.string())
    return pa.field(name, _COLUMN_TYPES[name])


def _schema(columns: Sequence[str]) -> pa.Schema:
    return pa.schema([_field(name) for name in [*_BASE, *columns]])
