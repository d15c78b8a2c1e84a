"""Similarity search over a closed embedding job: its items nearest to an image, a text, or one
of its own items, by cosine similarity in the job's vector index (`app/results/vector_index.py`).

An image or a text is embedded by the job's own model version through the normal queue: a
one-item interactive job whose item is named `search:<job id>` (recognisable among the
tenant's jobs and items), so a worker — a GPU one where there is one — answers it as any job,
and the content cache answers a query image it has seen. Its vector is read back from that
job's shard. The API waits for it (`routes/search.py`); these functions never wait.

A pipeline's library (`pipelines/<id>/<model ref>/`, every object its runs processed) keeps a
vector index too, updated by each run: it is searched the same way, with the model version of
the pipeline's newest closed run.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pyarrow.parquet as pq
from sqlalchemy.orm import Session

from kiln.app.catalog.catalog import ModelInfo, get_model
from kiln.app.core.config import Settings
from kiln.app.core.errors import ConflictError, InputError, NotFoundError, TransientError
from kiln.app.db import pipelines, queries
from kiln.app.db.models import ItemStatus, Job, Pipeline
from kiln.app.dispatch.contract import Dispatcher
from kiln.app.families import FAMILIES
from kiln.app.jobs import jobs, retention
from kiln.app.results import results, vector_index
from kiln.app.results.index_cache import IndexCache
from kiln.app.results.results import Place
from kiln.app.results.vector_index import VectorIndex
from kiln.app.storage import ObjectStore
from kiln.app.storage.base import S3Factory

DEFAULT_K, MAX_K = 10, 100  # a page of look-alikes; past 100 a results download serves better
# a query job's one item is named `search:<searched job id>` (`search:pipeline/<name>`)
QUERY_PREFIX = "search:"


@dataclass(frozen=True)
class SearchQuery:
    """Exactly one of: an image's bytes, a text, or the key of an item of the searched job."""

    image: bytes | None = None
    text: str | None = None
    key: str | None = None

    def __post_init__(self) -> None:
        if sum(part is not None for part in (self.image, self.text, self.key)) != 1:
            raise InputError('Search with exactly one of an image file, "text" or "key".')

    @property
    def kind(self) -> Literal["image", "text", "key"]:
        return "image" if self.image is not None else "text" if self.text is not None else "key"


@dataclass(frozen=True)
class Target:
    """A closed embedding job that can be searched, and where its index is; or a pipeline's
    library, as its newest closed run (`job`) left it."""

    job: Job
    model: ModelInfo
    place: Place  # the job's results, where its index is; or the pipeline's library
    succeeded: int
    pipeline: Pipeline | None = None
    run: Place | None = None  # a pipeline's: where its newest closed run's results are

    @property
    def label(self) -> str:
        """What is searched, as a sentence names it: "job <id>", "pipeline '<name>'"."""
        return f"job {self.job.id}" if self.pipeline is None else f"pipeline {self.pipeline.name!r}"

    @property
    def subject(self) -> str:
        """The label starting a sentence."""
        return self.label[:1].upper() + self.label[1:]

    @property
    def cache_name(self) -> str:
        """The index's name in the API's cache. A library's index changes with every run, so
        its name holds the run that wrote it last: after a new run it is a new entry."""
        if self.pipeline is None:
            return self.job.id
        return f"pipeline-{self.pipeline.id}-{self.job.id}"


@dataclass(frozen=True)
class Hit:
    key: str
    similarity: float


def check_k(k: int) -> int:
    if not 1 <= k <= MAX_K:
        raise InputError(f"k is how many items to answer: a whole number from 1 to {MAX_K}.")
    return k


def find_target(
    session: Session,
    store: ObjectStore,
    s3: S3Factory,
    tenant: str,
    job_id: str,
    query: SearchQuery,
) -> Target:
    """The tenant's closed embedding job, checked against the kind of query: 404, then what
    no wait would change (422), then 409 while it runs."""
    job = jobs.get_job(session, tenant, job_id)
    model = get_model(session, job.model, tenant)
    _check_kind(f"Job {job.id}", model, query)
    if queries.is_open(job):
        raise ConflictError(
            f"Job {job.id} is still {job.status}; it can be searched once it closes "
            "(its vector index is built then)."
        )
    retention.check_not_expired(job)  # its index went with its results
    counts = queries.job_counts(session, job.id, bulk=job.source is not None)
    return Target(job, model, results.place_for(store, job.id, job.output, s3), counts.succeeded)


def find_pipeline_target(
    session: Session,
    store: ObjectStore,
    s3: S3Factory,
    tenant: str,
    name: str,
    query: SearchQuery,
) -> Target:
    """The tenant's pipeline `name`: its library, searched with the model version of its newest
    closed run (the library of that version). 404 for a pipeline of another tenant."""
    pipeline = pipelines.tenant_pipeline(session, tenant, name)
    if pipeline is None:
        raise NotFoundError(f"There is no pipeline {name!r}.")
    run = pipelines.latest_closed_run(session, pipeline.id)
    model = get_model(session, run.model if run else pipeline.model, tenant)
    _check_kind(f"Pipeline {name!r}", model, query)  # what no wait would change comes first
    if run is None:
        raise ConflictError(
            f"Pipeline {name!r} has no finished run yet; it can be searched once one closes "
            "(its library's vector index is built then)."
        )
    library = results.library_place(store, pipeline.id, run.model)
    counts = queries.job_counts(session, run.id, bulk=True)
    run_place = results.place_for(store, run.id, run.output, s3)
    return Target(run, model, library, counts.succeeded, pipeline, run_place)


def _check_kind(label: str, model: ModelInfo, query: SearchQuery) -> None:
    if not FAMILIES[model.kind].vectors:
        raise InputError(
            f"{label} ran {model.name!r}, a {model.kind} model; only the jobs of an embedding "
            "model (embed, text-embed) can be searched, and the pipelines that run one."
        )
    if query.image is not None and model.input != "image":
        raise InputError(
            f"{label}'s model {model.name!r} embeds text; search it with a text, not an image."
        )
    if query.text is not None and model.input != "text":
        raise InputError(
            f"{label}'s model {model.name!r} embeds images; search it with an image, not a text."
        )


def job_index(indexes: IndexCache, target: Target) -> VectorIndex | None:
    """The job's (or pipeline library's) index from the cache, loaded on first use; None for
    a job with no vector at all (none of its items succeeded), which finds nothing."""
    name = target.cache_name
    if name in indexes or _ready(target):
        return indexes.get(name, target.place, target.label)
    if target.pipeline is not None:
        raise ConflictError(
            f"{target.subject} has no vector index yet for model {target.job.model}: its runs "
            "have embedded nothing since Kiln keeps one per library. It can be searched once "
            "a run embeds some of its objects."
        )
    if target.succeeded == 0:
        return None
    raise ConflictError(
        f"Job {name} has no vector index: it closed before Kiln built one for every "
        "embedding job, so it cannot be searched. Run its inputs again to search them."
    )


def _ready(target: Target) -> bool:
    """Whether the index is there to load. A job's never changes once written; a library's is
    rewritten by each run, so it is read only once the newest closed run's close steps are
    done. Those run just after some closes (and before the manifest, their last write): no
    manifest yet means they are still running."""
    exists = vector_index.exists(target.place)
    if exists and target.pipeline is None:
        return True
    run = target.run or target.place
    if not run.store.exists(results.manifest_key(run)):
        closed = "has just closed" if target.pipeline is None else "has just closed a run"
        raise TransientError(
            f"{target.subject} {closed} and its vector index is still being built; "
            "search again in a moment."
        )
    return exists


def key_vector(index: VectorIndex | None, target: Target, key: str) -> np.ndarray:
    vector = index.vector_of(key) if index is not None else None
    if vector is None:
        raise NotFoundError(
            f"{target.subject} has no item {key!r} with a vector (a failed item has none)."
        )
    return vector


def submit_query(
    session: Session,
    store: ObjectStore,
    dispatcher: Dispatcher,
    settings: Settings,
    target: Target,
    query: SearchQuery,
) -> str:
    """Queue the query as a one-item job of the searched job's exact model; its id."""
    searched = target.job.id if target.pipeline is None else f"pipeline/{target.pipeline.name}"
    name = f"{QUERY_PREFIX}{searched}"
    request = jobs.JobRequest(
        tenant=target.job.tenant,
        model=target.job.model,
        uploads=[jobs.Upload(name, query.image)] if query.image is not None else (),
        inputs=[jobs.InputRef(text=query.text, key=name)] if query.text is not None else (),
    )
    submitted = jobs.submit_job(
        session, store, dispatcher, settings, request, settings.tenant_max_open_jobs
    )
    return submitted.job.id


def query_vector(session: Session, store: ObjectStore, query_job_id: str) -> np.ndarray | None:
    """The query job's vector once it has closed; None while it is open."""
    job = session.get(Job, query_job_id, populate_existing=True)  # re-read: it changes
    if job is None:
        raise NotFoundError(f"There is no job {query_job_id}.")
    if queries.is_open(job):
        return None
    [item] = queries.list_items(session, job.id, status=None, after=0, limit=1)
    if item.status == ItemStatus.FAILED:
        raise InputError(f"The search query could not be embedded: {item.error}")
    if item.status != ItemStatus.SUCCEEDED:
        raise TransientError(f"The search query's job {job.id} was {job.status}; search again.")
    return read_vector(Place(store, results.results_prefix(job.id)), item.key)


def read_vector(place: Place, key: str) -> np.ndarray:
    """An item's vector, from the shards under `place`."""
    for shard in results.shard_keys(place):
        table = pq.read_table(io.BytesIO(place.store.get(shard)))
        if "embedding" not in table.column_names:
            continue
        rows = table.select(["key", "embedding"]).to_pylist()
        for row in rows:
            if row["key"] == key and row["embedding"] is not None:
                return np.asarray(row["embedding"], dtype=np.float32)
    raise TransientError(f"The vector of {key!r} is not in its results yet; search again.")


def give_up(session: Session, tenant: str, query_job_id: str) -> None:
    """Cancel a query job no one waits for any more (a worker that comes later skips it)."""
    with contextlib.suppress(ConflictError):  # it closed meanwhile
        jobs.cancel_job(session, tenant, query_job_id)


def nearest(
    index: VectorIndex | None, vector: np.ndarray, k: int, exclude: str | None = None
) -> list[Hit]:
    """The `k` items nearest to `vector`, most alike first; `exclude` (the key searched by)
    is left out, so a search by key answers the item's look-alikes, not the item itself."""
    if index is None or not len(index):
        return []
    if vector.size != index.dim:
        raise ConflictError(
            f"The query's vector has {vector.size} dimensions and the searched index "
            f"{index.dim}; they were not made by the same model."
        )
    [found] = index.search(vector.reshape(1, -1), k + (exclude is not None))
    hits = [Hit(n.key, round(n.similarity, 6)) for n in found if n.key != exclude]
    return hits[:k]
