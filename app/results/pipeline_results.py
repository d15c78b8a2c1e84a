"""A pipeline's current results: one row per live object — the row of the newest run that
processed it — as one Parquet file (`GET /v1/pipelines/{name}/results`, `kiln results
--pipeline`).

Computed from the runs' shards, not from the pipeline's library: a shard holds every column its
run wrote (the model's outputs, errors, timings, `answered_by`) and its failures, where the
library keeps only what grouping and search need (key, sha256, the family's small columns) of
the objects that succeeded. Runs are read newest first, and a run *claims* every live object it
has a finished row of (succeeded or failed; a cancelled item was never processed): an object's
rows are those of the newest run that processed it — every frame of a video from that run, the
older run's frames gone with it — so a changed object shows its new row, a known failure its
latest sentence, and an object that left the source (not live: its pipeline object was
forgotten when a listing no longer found it) none. Reading stops once every live object is
claimed; a live object no run has finished yet (new, or its run not that far) has no row.
"""

from __future__ import annotations

import io
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kiln.app.core.errors import ConflictError, InputError, NotFoundError
from kiln.app.results import results
from kiln.app.results.results import Place

FINISHED = ("succeeded", "failed")  # what an object's processing ends as; cancelled is not
JOB_ID = pa.field("job_id", pa.string())  # the run a row comes from, added to its columns
_READ = ("key", "status", "source")  # what claiming reads of a shard


def objects_of(table: pa.Table) -> pa.ChunkedArray:
    """The object each row belongs to: `source` (a video frame's video), else its key (shards
    written before `source` existed)."""
    keys = table.column("key")
    if "source" not in table.column_names:
        return keys
    return pc.coalesce(table.column("source"), keys)


def _finished(table: pa.Table) -> pa.ChunkedArray:
    return pc.is_in(table.column("status"), pa.array(FINISHED, pa.string()))


def finished_objects(table: pa.Table) -> set[str]:
    """The objects a shard has a finished row of."""
    return set(objects_of(table).filter(_finished(table)).to_pylist())


def keep(table: pa.Table, objects: Collection[str]) -> pa.Table:
    """A shard's finished rows of `objects` (the ones its run claimed)."""
    claimed = pc.is_in(objects_of(table), pa.array(list(objects), pa.string()))
    return table.filter(pc.and_(claimed, _finished(table)))


class Claims:
    """Which run's rows stand for each live object: offered runs newest first, each claims
    the live objects no newer run has claimed."""

    def __init__(self, live: Iterable[str]) -> None:
        self._unclaimed = set(live)

    @property
    def settled(self) -> bool:
        """Every live object is claimed: older runs have nothing left to give."""
        return not self._unclaimed

    def claim(self, shards: Sequence[set[str]]) -> list[frozenset[str]]:
        """One run's shards, each as the objects it has finished rows of: per shard, those it
        claims. An object is taken out only after the whole run, so a video whose frames
        span several of its shards keeps them all."""
        won = [frozenset(objects & self._unclaimed) for objects in shards]
        for objects in won:
            self._unclaimed -= objects
        return won


def latest_rows(runs: Sequence[tuple[str, Sequence[pa.Table]]], live: Iterable[str]) -> pa.Table:
    """In memory: the current rows of runs given newest first as (job id, shard tables), with
    their `job_id`, oldest run first — what `plan` and `stream` produce shard by shard."""
    claims = Claims(live)
    taken: list[tuple[str, pa.Table]] = []
    for job_id, shards in runs:
        won = claims.claim([finished_objects(shard) for shard in shards])
        kept = [keep(shard, objects) for shard, objects in zip(shards, won, strict=True)]
        taken[:0] = [(job_id, table) for table in kept if table.num_rows]
    schema = _schema([table.schema for _, table in taken])
    written = results.stream_tables(schema, (_with_job(t, job_id) for job_id, t in taken))
    return pq.read_table(io.BytesIO(b"".join(written)))


def _with_job(table: pa.Table, job_id: str) -> pa.Table:
    return table.append_column(JOB_ID, pa.array([job_id] * table.num_rows, pa.string()))


def _schema(shards: Sequence[pa.Schema]) -> pa.Schema:
    return results.unified_schema(shards).append(JOB_ID)


@dataclass(frozen=True)
class Run:
    """A run of the pipeline and where its shards are."""

    job_id: str
    place: Place


@dataclass(frozen=True)
class Take:
    """The rows one shard gives: those of the objects its run claimed."""

    job_id: str
    place: Place
    shard: str
    objects: frozenset[str]


@dataclass(frozen=True)
class Current:
    """What the current results are made of: the shards that give rows, oldest run first, and
    the schema of them all (with `job_id`)."""

    takes: list[Take]
    schema: pa.Schema


def plan(runs: Sequence[Run], live: Iterable[str]) -> Current:
    """Read the runs' shards (newest run first, one shard in memory at a time) for what each
    run claims; stop at the first run with nothing left to claim. A run whose shards cannot
    be read is a ConflictError before anything is written (a store unreachable now, the
    store's TransientError)."""
    claims = Claims(live)
    by_run: list[list[Take]] = []
    schemas: list[pa.Schema] = []
    for run in runs:
        if claims.settled:
            break
        shards, read = _read_run(run)
        won = claims.claim([objects for objects, _ in read])
        takes = [Take(run.job_id, run.place, s, o) for s, o in zip(shards, won, strict=True) if o]
        schemas += [schema for (_, schema), objects in zip(read, won, strict=True) if objects]
        by_run.append(takes)
    return Current([take for takes in reversed(by_run) for take in takes], _schema(schemas))


def _read_run(run: Run) -> tuple[list[str], list[tuple[set[str], pa.Schema]]]:
    """The run's shards, and for each the objects it has finished rows of and its schema. A
    run whose results are gone (its output bucket removed) or damaged is a sentence naming
    it: the current results are not exact without it."""
    try:
        shards = results.shard_keys(run.place)
        return shards, [_claimable(run.place, shard) for shard in shards]
    except (InputError, NotFoundError, pa.ArrowInvalid) as error:
        raise ConflictError(
            f"The results of run {run.job_id} cannot be read: "
            f"{str(error).rstrip('.')}. The pipeline's current results need them."
        ) from None


def _claimable(place: Place, shard: str) -> tuple[set[str], pa.Schema]:
    parquet = pq.ParquetFile(io.BytesIO(place.store.get(shard)))
    schema = parquet.schema_arrow
    table = parquet.read(columns=[name for name in _READ if name in schema.names])
    return finished_objects(table), schema


def stream(current: Current) -> Iterator[bytes]:
    """The planned rows as one Parquet file, produced shard by shard (each read again)."""

    def tables() -> Iterator[pa.Table]:
        for take in current.takes:
            table = pq.read_table(io.BytesIO(take.place.store.get(take.shard)))
            yield _with_job(keep(table, take.objects), take.job_id)

    return results.stream_tables(current.schema, tables())
