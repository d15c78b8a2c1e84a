"""Results in object storage: one Parquet shard per chunk, a manifest, and their union."""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from kiln.app.sources import parse_s3_uri
from kiln.app.storage import ObjectStore
from kiln.app.storage.base import S3Factory
from kiln.app.video import split_key

BASE_FIELDS = [
    pa.field("key", pa.string(), nullable=False),
    pa.field("status", pa.string(), nullable=False),
    pa.field("error", pa.string()),
    pa.field("duration_ms", pa.float32()),
    pa.field("sha256", pa.string()),  # of the input's bytes (a text's UTF-8); null if unread
    pa.field("answered_by", pa.string()),  # the model ref whose outputs these are; null: failed
    # why the job's model did not answer, where the job's fallback model took the item
    pa.field("fallback_reason", pa.string()),
    # the file the row came from: the key, less a video frame's `#t=` (GROUP BY a video)
    pa.field("source", pa.string()),
    pa.field("frame_index", pa.int32()),  # a video frame's index in its video; else null
    pa.field("frame_time_s", pa.float64()),  # the moment a video frame stands for (seconds)
]


class Result(Protocol):
    """What a results row is made of: an `Item`, or a `ResultRow` not yet written to the DB."""

    @property
    def key(self) -> str: ...
    @property
    def status(self) -> str: ...
    @property
    def error(self) -> str | None: ...
    @property
    def duration_ms(self) -> float | None: ...
    @property
    def outputs(self) -> dict[str, Any] | None: ...
    @property
    def sha256(self) -> str | None: ...
    @property
    def answered_by(self) -> str | None: ...
    @property
    def fallback_reason(self) -> str | None: ...
    @property
    def frame_index(self) -> int | None: ...
    @property
    def frame_time_s(self) -> float | None: ...


@dataclass(frozen=True)
class ResultRow:
    key: str
    status: str
    error: str | None
    duration_ms: float | None
    outputs: dict[str, Any] | None
    sha256: str | None = None
    answered_by: str | None = None
    fallback_reason: str | None = None
    stages_ms: dict[str, float] | None = None  # interactive items: ms per worker stage
    frame_index: int | None = None
    frame_time_s: float | None = None


@dataclass(frozen=True)
class Place:
    """Where a job's results live: a store and a folder in it (ends with "/")."""

    store: ObjectStore
    prefix: str

    def key(self, name: str) -> str:
        return f"{self.prefix}{name}"

    def describe(self) -> str:
        return self.store.describe(self.prefix)


def results_prefix(job_id: str) -> str:
    return f"results/{job_id}/"


def place_for(store: ObjectStore, job_id: str, output: str | None, s3: S3Factory) -> Place:
    """Kiln's own `results/<job>/`, or `<output>/<job>/` in the user's bucket."""
    if not output:
        return Place(store, results_prefix(job_id))
    from kiln.app.storage.s3 import S3Store  # boto3: only for a job whose results go to S3

    bucket, prefix = parse_s3_uri(output)
    folder = f"{prefix.strip('/')}/{job_id}/".lstrip("/")
    return Place(S3Store(s3(), bucket, output=output), folder)


def library_place(store: ObjectStore, pipeline_id: int, model_ref: str) -> Place:
    """A pipeline's library for one model version (`workers/models/library.py` keeps it up to date;
    search reads its vector index): `pipelines/<id>/<ref, ':' written '@'>/`."""
    return Place(store, f"pipelines/{pipeline_id}/{model_ref.replace(':', '@')}/")


def shard_key(place: Place, chunk: int) -> str:
    return place.key(f"part-{chunk:06d}.parquet")


def manifest_key(place: Place) -> str:
    return place.key("manifest.json")


# A shard's columns worth a dictionary: the base strings that repeat from row to row. The
# others (keys, digests, scores, a family's outputs) are left plain: pyarrow would build a
# dictionary of a 512-row chunk's unique keys before writing them anyway, and zstd takes
# what repeats (a null8 chunk's shard: 640 -> ~500 us of CPU, 32.6 -> 29.7 KB).
SHARD_DICTIONARY = ["status", "error", "answered_by", "fallback_reason"]


def to_parquet(table: pa.Table, dictionary: bool | list[str] = True) -> bytes:
    """The table as Parquet (zstd); `dictionary`: the columns dictionary-encoded (all: True)."""
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd", use_dictionary=dictionary)
    return sink.getvalue()


def items_table(items: Sequence[Result], output_fields: Sequence[pa.Field]) -> pa.Table:
    """Rows for finished items: the base columns, then the model's own output columns."""
    names = [f.name for f in output_fields]
    rows: list[dict[str, Any]] = []
    for item in items:
        outputs = item.outputs or {}
        row: dict[str, Any] = {
            "key": item.key,
            "status": item.status,
            "error": item.error,
            "duration_ms": item.duration_ms,
            "sha256": item.sha256,
            "answered_by": item.answered_by,
            "fallback_reason": item.fallback_reason,
            "source": split_key(item.key, item.frame_time_s),
            "frame_index": item.frame_index,
            "frame_time_s": item.frame_time_s,
        }
        row.update({name: outputs.get(name) for name in names})
        rows.append(row)
    return pa.Table.from_pylist(rows, schema=pa.schema([*BASE_FIELDS, *output_fields]))


def write_table(place: Place, chunk: int, table: pa.Table) -> str:
    """Write (or overwrite, on redelivery) the chunk's shard from its table; returns its key."""
    key = shard_key(place, chunk)
    place.store.put(key, to_parquet(table, SHARD_DICTIONARY), "application/vnd.apache.parquet")
    return key


def write_shard(
    place: Place,
    chunk: int,
    items: Sequence[Result],
    output_fields: Sequence[pa.Field],
) -> str:
    """Write (or overwrite, on redelivery) the chunk's shard of these rows; returns its key."""
    return write_table(place, chunk, items_table(items, output_fields))


def groups_key(place: Place) -> str:
    return place.key("groups.parquet")


def deleted_key(place: Place) -> str:
    return place.key("deleted.parquet")


GROUP_FIELDS = [
    pa.field("group", pa.int32(), nullable=False),
    pa.field("key", pa.string(), nullable=False),
    # cosine similarity to the group's first member (embeddings); null for phash's groups
    pa.field("similarity", pa.float32()),
    # set only where another item of the job has the same bytes (byte-identical inputs)
    pa.field("sha256", pa.string()),
]


def shard_keys(place: Place) -> list[str]:
    return sorted(k for k in place.store.list(place.key("part-")) if k.endswith(".parquet"))


def shards_by_chunk(place: Place) -> dict[int, str]:
    """The job's shards, one listing, by the chunk each holds (`shard_key`'s name read back)."""
    start = place.key("part-")
    named = ((k.removeprefix(start).removesuffix(".parquet"), k) for k in shard_keys(place))
    return {int(number): key for number, key in named if number.isdigit()}


def write_keys(place: Place, name: str, keys: Sequence[str]) -> str:
    """A one-column Parquet file of keys (e.g. the objects a pipeline found deleted)."""
    table = pa.Table.from_pylist([{"key": k} for k in keys], schema=pa.schema([BASE_FIELDS[0]]))
    key = place.key(name)
    place.store.put(key, to_parquet(table), "application/vnd.apache.parquet")
    return key


def write_groups(
    place: Place,
    groups: Sequence[Sequence[str]],
    similarities: Sequence[Sequence[float | None]] | None = None,
    identical: Mapping[str, str] | None = None,
) -> str:
    """Near-duplicate groups of a job: one row per member, groups numbered from 0, with each
    member's similarity to its group's first member when the grouping has one, and the sha256
    of members whose bytes another item shares (`identical`: key → sha256)."""
    sims = similarities or [[None] * len(keys) for keys in groups]
    same = identical or {}
    rows = [
        {"group": number, "key": key, "similarity": sim, "sha256": same.get(key)}
        for number, (keys, scores) in enumerate(zip(groups, sims, strict=True))
        for key, sim in zip(keys, scores, strict=True)
    ]
    table = pa.Table.from_pylist(rows, schema=pa.schema(GROUP_FIELDS))
    key = groups_key(place)
    place.store.put(key, to_parquet(table), "application/vnd.apache.parquet")
    return key


def combined_table(place: Place) -> pa.Table:
    """Every shard as one table in memory (`kiln run`'s local folder), as `stream_parquet`'s
    file reads back — one chunk per shard — but joined in memory, not encoded and decoded
    again (~10 µs a row); the API streams instead (`stream_parquet`)."""
    schema, tables = _shard_tables(place)
    conformed = [_conform(table, schema) for table in tables]
    return pa.concat_tables(conformed) if conformed else schema.empty_table()


def stream_parquet(place: Place) -> Iterator[bytes]:
    """Every shard as one Parquet file, produced shard by shard: memory holds one shard (and,
    for a near-duplicate job, the key → group map), however many shards the job has."""
    yield from stream_tables(*_shard_tables(place))


def _shard_tables(place: Place) -> tuple[pa.Schema, Iterator[pa.Table]]:
    """The shards' one schema and their tables, read one at a time. Shards are read twice:
    once for their schemas (columns a shard lacks are null), then their rows. A `group`
    column is added when the job found near-duplicates."""
    store = place.store
    keys = shard_keys(place)
    group_of = _groups(place)
    schema = unified_schema([pq.read_schema(io.BytesIO(store.get(k))) for k in keys])
    if group_of is not None:
        schema = schema.append(pa.field("group", pa.int32()))

    def tables() -> Iterator[pa.Table]:
        for key in keys:
            table = pq.read_table(io.BytesIO(store.get(key)))
            if group_of is not None:
                groups = [group_of.get(k) for k in table.column("key").to_pylist()]
                table = table.append_column("group", pa.array(groups, pa.int32()))
            yield table

    return schema, tables()


def stream_tables(schema: pa.Schema, tables: Iterable[pa.Table]) -> Iterator[bytes]:
    """`tables` as one Parquet file of `schema` (columns a table lacks are null), handed over
    table by table, then the footer: memory holds what one table makes."""
    sink = _Pieces()
    with pq.ParquetWriter(sink, schema, compression="zstd") as writer:
        for table in tables:
            writer.write_table(_conform(table, schema))
            yield sink.take()
    yield sink.take()  # the footer


def unified_schema(schemas: Sequence[pa.Schema]) -> pa.Schema:
    """One schema for shards written at different times (with a fallback's columns or not)."""
    if not schemas:
        return pa.schema(BASE_FIELDS)
    return pa.unify_schemas(list(schemas), promote_options="permissive")


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """The shard with every column of `schema`, in its order (null where the shard has none)."""
    columns = [
        table.column(f.name).cast(f.type)
        if f.name in table.column_names
        else pa.nulls(table.num_rows, f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(columns, schema=schema)


def groups_parquet(place: Place) -> bytes:
    """The job's groups.parquet, or an empty one with its columns (a closed job that found
    no duplicates, or that closed before groups existed)."""
    if place.store.exists(groups_key(place)):
        return place.store.get(groups_key(place))
    return to_parquet(pa.schema(GROUP_FIELDS).empty_table())


def read_groups(place: Place) -> pa.Table | None:
    """The job's groups.parquet, if it has one."""
    if not place.store.exists(groups_key(place)):
        return None
    return pq.read_table(io.BytesIO(place.store.get(groups_key(place))))


def _groups(place: Place) -> dict[str, int] | None:
    if not place.store.exists(groups_key(place)):
        return None
    groups = pq.read_table(io.BytesIO(place.store.get(groups_key(place)))).to_pydict()
    return dict(zip(groups["key"], groups["group"], strict=True))


class _Pieces(io.RawIOBase):
    """A write-only file that hands over what was written so far (`take`), while `tell` keeps
    counting from the start: what a Parquet writer needs to stream."""

    def __init__(self) -> None:
        self._pieces: list[bytes] = []
        self._written = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        piece = bytes(data)
        self._pieces.append(piece)
        self._written += len(piece)
        return len(piece)

    def tell(self) -> int:
        return self._written

    def take(self) -> bytes:
        taken = b"".join(self._pieces)
        self._pieces.clear()
        return taken


@dataclass(frozen=True)
class SignedObject:
    key: str
    url: str


def presign_results(place: Place, seconds: int) -> tuple[SignedObject | None, list[SignedObject]]:
    """The manifest (None until the job has ended) and every shard so far, each with a GET URL
    valid for `seconds`. ConflictError, before anything is listed, on a store that cannot sign."""
    manifest = SignedObject(manifest_key(place), place.store.presign(manifest_key(place), seconds))
    shards = [SignedObject(k, place.store.presign(k, seconds)) for k in shard_keys(place)]
    return (manifest if place.store.exists(manifest.key) else None), shards


def write_manifest(
    place: Place, manifest: dict[str, Any], shards: Sequence[str] | None = None
) -> None:
    """The job's summary; `shards` when the caller knows them, else listed from storage."""
    manifest = {
        **manifest,
        "shards": sorted(shards) if shards is not None else shard_keys(place),
    }
    body = json.dumps(manifest, indent=2).encode()
    place.store.put(manifest_key(place), body, "application/json")
