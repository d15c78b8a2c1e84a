"""The search service (app/results/search.py) on SQLite and a local store, with no worker: what a
worker would have written — a closed job's shard, its index, a query job's result — is written here
with the same functions the worker uses (`write_shard`, `VectorIndex.save`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import update
from sqlalchemy.orm import Session

from kiln.app.core.config import Settings
from kiln.app.core.errors import ConflictError, InputError, NotFoundError, TransientError
from kiln.app.db import counters
from kiln.app.db.models import Item, ItemStatus, Job, JobStatus
from kiln.app.dispatch.stub import RecordingDispatcher
from kiln.app.jobs import jobs
from kiln.app.results import search
from kiln.app.results.index_cache import IndexCache
from kiln.app.results.results import (
    Place,
    ResultRow,
    manifest_key,
    results_prefix,
    write_manifest,
    write_shard,
)
from kiln.app.results.search import SearchQuery, Target
from kiln.app.results.vector_index import VectorIndex
from kiln.app.storage.local import LocalStore
from kiln.workers.models import embed

VECTORS = {
    "food": [1.0, 0.0, 0.0],
    "bread": [0.9, 0.3, 0.0],
    "sky": [0.0, 0.0, 1.0],
    "sea": [0.1, 0.0, 0.95],
}
FIELDS = embed.fields({"dim": 3})


def no_s3() -> object:
    raise AssertionError("these jobs keep their results in Kiln's own store")


def submitted(
    session: Session, store: LocalStore, settings: Settings, texts: dict[str, str], tenant: str
) -> str:
    request = jobs.JobRequest(
        tenant=tenant,
        model="text-embed",
        inputs=[jobs.InputRef(text=text, key=key) for key, text in texts.items()],
    )
    return jobs.submit_job(session, store, RecordingDispatcher(), settings, request).job.id


def finish(
    session: Session, store: LocalStore, job_id: str, vectors: dict[str, list[float] | None]
) -> None:
    """What a worker leaves: the shard, the items' results, the job closed."""
    rows = [
        ResultRow(k, "succeeded", None, 1.0, {"embedding": v, "dim": 3})
        if v is not None
        else ResultRow(k, "failed", "The text is empty.", 1.0, None)
        for k, v in vectors.items()
    ]
    place = Place(store, results_prefix(job_id))
    write_shard(place, 0, rows, FIELDS)
    write_manifest(place, {"job_id": job_id})  # the close steps have run
    for row in rows:
        session.execute(
            update(Item)
            .where(Item.job_id == job_id, Item.key == row.key)
            .values(status=row.status, error=row.error)
        )
    succeeded = sum(row.status == "succeeded" for row in rows)
    counters.add(
        session, job_id, 0, counters.Tally(succeeded=succeeded, failed=len(rows) - succeeded)
    )
    session.execute(update(Job).where(Job.id == job_id).values(status=JobStatus.COMPLETED))
    session.commit()


@pytest.fixture
def closed(session: Session, store: LocalStore, settings: Settings) -> str:
    """A completed text-embed job of four items, with its index, for tenant acme."""
    job_id = submitted(session, store, settings, {k: k for k in VECTORS}, "acme")
    finish(session, store, job_id, dict(VECTORS))
    keys, vectors = list(VECTORS), np.asarray(list(VECTORS.values()), np.float32)
    VectorIndex.build(keys, vectors).save(Place(store, results_prefix(job_id)))
    return job_id


def target(session: Session, store: LocalStore, job_id: str, query: SearchQuery) -> Target:
    return search.find_target(session, store, no_s3, "acme", job_id, query)


def test_a_query_is_exactly_one_thing() -> None:
    assert SearchQuery(image=b"x").kind == "image"
    assert SearchQuery(text="x").kind == "text" and SearchQuery(key="x").kind == "key"
    for parts in ({}, {"text": "a", "key": "b"}, {"image": b"", "text": "a"}):
        with pytest.raises(InputError, match="exactly one of"):
            SearchQuery(**parts)


@pytest.mark.parametrize("k", [0, search.MAX_K + 1])
def test_k_is_bounded(k: int) -> None:
    assert search.check_k(1) == 1 and search.check_k(search.MAX_K) == search.MAX_K
    with pytest.raises(InputError, match=f"from 1 to {search.MAX_K}"):
        search.check_k(k)


def test_nearest_is_most_alike_first_and_leaves_the_searched_key_out() -> None:
    index = VectorIndex.build(list(VECTORS), np.asarray(list(VECTORS.values()), np.float32))
    query = np.asarray(VECTORS["food"], np.float32)
    hits = search.nearest(index, query, 3)
    assert [h.key for h in hits] == ["food", "bread", "sea"]
    assert hits[0].similarity == pytest.approx(1.0, abs=1e-5)
    assert [h.key for h in search.nearest(index, query, 2, exclude="food")] == ["bread", "sea"]
    assert search.nearest(None, query, 3) == []
    with pytest.raises(ConflictError, match="not made by the same model"):
        search.nearest(index, np.ones(5, np.float32), 3)


def test_a_closed_job_is_searched_by_key(session: Session, store: LocalStore, closed: str) -> None:
    found = target(session, store, closed, SearchQuery(key="sky"))
    assert (found.succeeded, found.model.name) == (4, "text-embed")
    index = search.job_index(IndexCache(1 << 30), found)
    vector = search.key_vector(index, found, "sky")
    assert [h.key for h in search.nearest(index, vector, 1, exclude="sky")] == ["sea"]
    with pytest.raises(NotFoundError, match="no item 'moon'"):
        search.key_vector(index, found, "moon")


def test_refusals_each_with_a_sentence(
    session: Session, store: LocalStore, settings: Settings, closed: str
) -> None:
    with pytest.raises(NotFoundError, match=f"no job {closed}"):
        search.find_target(session, store, no_s3, "globex", closed, SearchQuery(key="sky"))
    with pytest.raises(InputError, match="embeds text; search it with a text, not an image"):
        target(session, store, closed, SearchQuery(image=b"\xff\xd8"))
    running = submitted(session, store, settings, {"a": "a"}, "acme")
    with pytest.raises(ConflictError, match="still queued; it can be searched once it closes"):
        target(session, store, running, SearchQuery(text="a"))
    detector = jobs.submit_job(
        session, store, RecordingDispatcher(), settings,
        jobs.JobRequest(tenant="acme", model="detector", uploads=[jobs.Upload("a.png", b"x")]),
    ).job.id  # fmt: skip
    with pytest.raises(InputError, match="a detect model; only the jobs of an embedding model"):
        target(session, store, detector, SearchQuery(key="a.png"))


def test_a_job_without_an_index_object(
    session: Session, store: LocalStore, settings: Settings
) -> None:
    old = submitted(session, store, settings, {"a": "a"}, "acme")
    finish(session, store, old, {"a": [1.0, 0.0, 0.0]})  # closed, but no index was built
    with pytest.raises(ConflictError, match="closed before Kiln built one"):
        search.job_index(IndexCache(1 << 30), target(session, store, old, SearchQuery(text="a")))
    store.delete(manifest_key(Place(store, results_prefix(old))))  # its close steps still run
    with pytest.raises(TransientError, match="just closed and its vector index is still being"):
        search.job_index(IndexCache(1 << 30), target(session, store, old, SearchQuery(text="a")))
    failed = submitted(session, store, settings, {"b": ""}, "acme")
    finish(session, store, failed, {"b": None})  # nothing succeeded: nothing to find
    empty = target(session, store, failed, SearchQuery(text="b"))
    assert search.job_index(IndexCache(1 << 30), empty) is None


def test_a_query_job_runs_the_same_model_and_gives_its_vector(
    session: Session, store: LocalStore, settings: Settings, closed: str
) -> None:
    query = SearchQuery(text="a loaf")
    found = target(session, store, closed, query)
    query_job = search.submit_query(session, store, RecordingDispatcher(), settings, found, query)
    job = session.get(Job, query_job)
    assert job is not None and job.model == "text-embed" and job.queue == "interactive"
    assert search.query_vector(session, store, query_job) is None  # still queued
    finish(session, store, query_job, {f"search:{closed}": [0.8, 0.2, 0.0]})
    vector = search.query_vector(session, store, query_job)
    assert vector is not None and vector.tolist() == pytest.approx([0.8, 0.2, 0.0])


def test_a_query_that_could_not_be_embedded(
    session: Session, store: LocalStore, settings: Settings, closed: str
) -> None:
    query = SearchQuery(text=" ")
    found = target(session, store, closed, query)
    query_job = search.submit_query(session, store, RecordingDispatcher(), settings, found, query)
    finish(session, store, query_job, {f"search:{closed}": None})
    with pytest.raises(InputError, match=r"could not be embedded: The text is empty\."):
        search.query_vector(session, store, query_job)


def test_giving_up_cancels_the_query_job(
    session: Session, store: LocalStore, settings: Settings, closed: str
) -> None:
    query = SearchQuery(text="rain")
    found = target(session, store, closed, query)
    query_job = search.submit_query(session, store, RecordingDispatcher(), settings, found, query)
    search.give_up(session, "acme", query_job)
    with pytest.raises(TransientError, match="was cancelled; search again"):
        search.query_vector(session, store, query_job)
    search.give_up(session, "acme", query_job)  # already closed: nothing to do


def test_read_vector_finds_the_row_in_any_shard(tmp_path: Path) -> None:
    place = Place(LocalStore(tmp_path), "results/q/")
    write_shard(place, 0, [ResultRow("x", "failed", "Bad.", 1.0, None)], [])
    row = ResultRow("y", ItemStatus.SUCCEEDED, None, 1.0, {"embedding": [0.0, 1.0, 0.0], "dim": 3})
    write_shard(place, 1, [row], FIELDS)
    assert search.read_vector(place, "y").tolist() == [0.0, 1.0, 0.0]
    with pytest.raises(TransientError, match="not in its results yet"):
        search.read_vector(place, "x")
