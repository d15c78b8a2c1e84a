"""Results in object storage: one Parquet shard per chunk, a manifest, and their union."""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from kiln.app.storage import ObjectStore
from kiln.app.storage.s3 import S3Store, parse_s3_uri

S3Factory = Callable[[], Any]  # returns a boto3 S3 client, made only when needed

BASE_FIELDS = [
    pa.field("key", pa.string(), nullable=False),
    pa.field("status", pa.string(), nullable=False),
    pa.field("error", pa.string()),
    pa.field("duration_ms", pa.float32()),
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


@dataclass(frozen=True)
class ResultRow:
    key: str
    status: str
    error: str | None
    duration_ms: float | None
    outputs: dict[str, Any] | None


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
    bucket, prefix = parse_s3_uri(output)
    folder = f"{prefix.strip('/')}/{job_id}/".lstrip("/")
    return Place(S3Store(s3(), bucket), folder)


def shard_key(place: Place, chunk: int) -> str:
    return place.key(f"part-{chunk:06d}.parquet")


def manifest_key(place: Place) -> str:
    return place.key("manifest.json")


def to_parquet(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
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
        }
        row.update({name: outputs.get(name) for name in names})
        rows.append(row)
    return pa.Table.from_pylist(rows, schema=pa.schema([*BASE_FIELDS, *output_fields]))


def write_shard(
    place: Place,
    chunk: int,
    items: Sequence[Result],
    output_fields: Sequence[pa.Field],
) -> str:
    """Write (or overwrite, on redelivery) the chunk's shard; returns its key."""
    key = shard_key(place, chunk)
    place.store.put(
        key, to_parquet(items_table(items, output_fields)), "application/vnd.apache.parquet"
    )
    return key


def groups_key(place: Place) -> str:
    return place.key("groups.parquet")


def deleted_key(place: Place) -> str:
    return place.key("deleted.parquet")


GROUP_FIELDS = [
    pa.field("group", pa.int32(), nullable=False),
    pa.field("key", pa.string(), nullable=False),
]


def shard_keys(place: Place) -> list[str]:
    return sorted(k for k in place.store.list(place.key("part-")) if k.endswith(".parquet"))


def write_keys(place: Place, name: str, keys: Sequence[str]) -> str:
    """A one-column Parquet file of keys (e.g. the objects a pipeline found deleted)."""
    table = pa.Table.from_pylist([{"key": k} for k in keys], schema=pa.schema([BASE_FIELDS[0]]))
    key = place.key(name)
    place.store.put(key, to_parquet(table), "application/vnd.apache.parquet")
    return key


def write_groups(place: Place, groups: Sequence[Sequence[str]]) -> str:
    """Near-duplicate groups of a job: one row per member, groups numbered from 0."""
    rows = [{"group": number, "key": key} for number, keys in enumerate(groups) for key in keys]
    table = pa.Table.from_pylist(rows, schema=pa.schema(GROUP_FIELDS))
    key = groups_key(place)
    place.store.put(key, to_parquet(table), "application/vnd.apache.parquet")
    return key


def combined_table(place: Place) -> pa.Table:
    """Every shard as one table; with a `group` column when the job found near-duplicates."""
    store = place.store
    tables = [pq.read_table(io.BytesIO(store.get(key))) for key in shard_keys(place)]
    if not tables:
        return pa.schema(BASE_FIELDS).empty_table()
    table = pa.concat_tables(tables, promote_options="permissive")
    if store.exists(groups_key(place)):
        groups = pq.read_table(io.BytesIO(store.get(groups_key(place)))).to_pydict()
        group_of = dict(zip(groups["key"], groups["group"], strict=True))
        column = pa.array([group_of.get(k) for k in table.column("key").to_pylist()], pa.int32())
        table = table.append_column("group", column)  # (Arrow's join refuses list columns)
    return table


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
