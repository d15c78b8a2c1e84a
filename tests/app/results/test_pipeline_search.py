"""Searching a pipeline's library (app/results/search.py, app/db/pipelines.py) on SQLite and a local
store, with no worker: the runs, their items and the library's index are written here as the
ingest and a run's close step would leave them (`library_place`, `VectorIndex.save`)."""

from __future__ import annotations

import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy.orm import Session

from kiln.app.core.errors import ConflictError, InputError, NotFoundError, TransientError
from kiln.app.db import pipelines
from kiln.app.db.models import Item, ItemStatus, Job, JobStatus, Pipeline, utcnow
from kiln.app.results import search
from kiln.app.results.index_cache import IndexCache
from kiln.app.results.results import Place, library_place, place_for, write_manifest
from kiln.app.results.search import SearchQuery, Target
from kiln.app.results.vector_index import INDEX, VectorIndex
from kiln.app.storage.local import LocalStore

FIRST = {"a": [1.0, 0.0, 0.0], "b": [0.0, 1.0, 0.0], "c": [0.0, 0.0, 1.0]}
SECOND = {"a-copy": [0.98, 0.1, 0.0]}  # what a rerun adds: a near copy of `a`
SOURCE = {"s3": "s3://photos/", "include": [], "exclude": []}


def no_s3() -> object:
    raise AssertionError("these runs keep their results in Kiln's own store")


def pipeline(session: Session, name: str = "nightly", model: str = "text-embed") -> Pipeline:
    made = Pipeline(tenant="acme", name=name, source=SOURCE, model=model)
    session.add(made)
    session.commit()
    return made


def run(
    session: Session,
    store: LocalStore,
    of: Pipeline,
    keys: dict[str, str],
    status: str = JobStatus.COMPLETED,
    age_s: int = 0,
) -> Job:
    """A run of the pipeline with items `keys` (key → status), its manifest written if closed."""
    job = Job(
        id=str(uuid.uuid4()),
        tenant=of.tenant,
        model=of.model,
        status=status,
        source=SOURCE,
        pipeline_id=of.id,
        queue="bulk",
        created_at=utcnow() - timedelta(seconds=age_s),
    )
    session.add(job)
    session.flush()  # the job's row before its items'
    session.add_all(Item(job_id=job.id, key=key, status=state) for key, state in keys.items())
    session.commit()
    if status != JobStatus.RUNNING:
        write_manifest(place_for(store, job.id, None, no_s3), {"job_id": job.id})
    return job


def library(store: LocalStore, of: Pipeline, vectors: dict[str, list[float]]) -> Place:
    where = library_place(store, of.id, of.model)
    VectorIndex.build(list(vectors), np.asarray(list(vectors.values()), np.float32)).save(where)
    return where


def target(session: Session, store: LocalStore, name: str, query: SearchQuery) -> Target:
    return search.find_pipeline_target(session, store, no_s3, "acme", name, query)


def by_key(indexes: IndexCache, found: Target, key: str, k: int = 2) -> list[Any]:
    index = search.job_index(indexes, found)
    return search.nearest(index, search.key_vector(index, found, key), k, key)


def test_a_pipeline_is_searched_in_its_whole_library(session: Session, store: LocalStore) -> None:
    nightly = pipeline(session)
    run(session, store, nightly, dict.fromkeys(FIRST, ItemStatus.SUCCEEDED), age_s=60)
    rerun = run(session, store, nightly, {"a-copy": ItemStatus.SUCCEEDED})
    library(store, nightly, FIRST | SECOND)

    found = target(session, store, "nightly", SearchQuery(key="a-copy"))
    assert (found.job.id, found.pipeline, found.place.prefix) == (
        rerun.id,
        nightly,
        f"pipelines/{nightly.id}/text-embed/",
    )
    hits = by_key(IndexCache(1 << 30), found, "a-copy")
    assert hits[0].key == "a" and hits[0].similarity > 0.99  # last run's original
    assert "a-copy" not in [hit.key for hit in hits]
    with pytest.raises(NotFoundError, match="Pipeline 'nightly' has no item 'zzz'"):
        search.key_vector(search.job_index(IndexCache(1 << 30), found), found, "zzz")


def test_a_new_run_is_a_new_cache_entry(session: Session, store: LocalStore) -> None:
    """The library's index changes with each run: the cache holds it per run, so a search
    after a rerun sees what the rerun added, and one before it is answered from memory."""
    nightly = pipeline(session)
    run(session, store, nightly, dict.fromkeys(FIRST, ItemStatus.SUCCEEDED), age_s=60)
    where = library(store, nightly, FIRST)
    indexes = IndexCache(1 << 30)
    first = target(session, store, "nightly", SearchQuery(key="a"))
    assert [hit.key for hit in by_key(indexes, first, "a", 1)] in (["b"], ["c"])

    store.delete(where.key(INDEX))  # a cached index is not read again
    assert first.cache_name in indexes and by_key(indexes, first, "a", 1)

    run(session, store, nightly, {"a-copy": ItemStatus.SUCCEEDED})
    library(store, nightly, FIRST | SECOND)
    second = target(session, store, "nightly", SearchQuery(key="a"))
    assert second.cache_name != first.cache_name
    assert [hit.key for hit in by_key(indexes, second, "a", 1)] == ["a-copy"]


def test_a_run_whose_close_steps_still_run_is_not_read_early(
    session: Session, store: LocalStore
) -> None:
    """A run closed by the reconciler or a cancel runs its close steps just after: until its
    manifest is written, the library's index may still be last run's, and is not cached as
    this run's."""
    nightly = pipeline(session)
    run(session, store, nightly, dict.fromkeys(FIRST, ItemStatus.SUCCEEDED), age_s=60)
    library(store, nightly, FIRST)
    closing = run(session, store, nightly, {"a-copy": ItemStatus.SUCCEEDED})
    store.delete(f"results/{closing.id}/manifest.json")
    found = target(session, store, "nightly", SearchQuery(key="a"))
    indexes = IndexCache(1 << 30)
    with pytest.raises(TransientError, match="'nightly' has just closed a run"):
        search.job_index(indexes, found)
    assert found.cache_name not in indexes

    library(store, nightly, FIRST | SECOND)
    write_manifest(place_for(store, closing.id, None, no_s3), {"job_id": closing.id})
    assert [hit.key for hit in by_key(indexes, found, "a", 1)] == ["a-copy"]


def test_another_tenants_pipeline_is_unknown(session: Session, store: LocalStore) -> None:
    theirs = Pipeline(tenant="globex", name="nightly", source=SOURCE, model="text-embed")
    session.add(theirs)
    session.commit()
    run(session, store, theirs, {"a": ItemStatus.SUCCEEDED})
    library(store, theirs, FIRST)
    for name in ("nightly", "nope"):  # theirs, and one no one has: the same answer
        with pytest.raises(NotFoundError) as refused:
            target(session, store, name, SearchQuery(key="a"))
        assert str(refused.value) == f"There is no pipeline {name!r}."


def test_refusals_each_with_a_sentence(session: Session, store: LocalStore) -> None:
    nightly = pipeline(session)
    running = run(session, store, nightly, {"a": ItemStatus.PENDING}, JobStatus.RUNNING)
    with pytest.raises(ConflictError, match="'nightly' has no finished run yet"):
        target(session, store, "nightly", SearchQuery(key="a"))
    with pytest.raises(InputError, match="embeds text; search it with a text, not an image"):
        # the kind of query is checked first: no wait would change it
        target(session, store, "nightly", SearchQuery(image=b"\xff\xd8"))

    session.delete(running)
    closed = run(session, store, nightly, {"a": ItemStatus.FAILED})
    found = target(session, store, "nightly", SearchQuery(key="a"))
    with pytest.raises(ConflictError, match="'nightly' has no vector index yet for model"):
        search.job_index(IndexCache(1 << 30), found)
    store.delete(f"results/{closed.id}/manifest.json")  # its close steps are still running
    with pytest.raises(TransientError, match="just closed a run"):
        search.job_index(IndexCache(1 << 30), found)

    hashes = pipeline(session, "hashes", "phash")
    run(session, store, hashes, {"a": ItemStatus.SUCCEEDED})
    with pytest.raises(InputError, match="a phash model; only the jobs of an embedding model"):
        target(session, store, "hashes", SearchQuery(key="a"))


def test_an_index_read_between_its_two_writes_is_refused(
    session: Session, store: LocalStore, tmp_path: Path
) -> None:
    """A run rewrites the library's index and its keys one after the other: a search that
    reads the new index with the old keys says so (503) instead of mislabelling neighbours."""
    nightly = pipeline(session)
    run(session, store, nightly, dict.fromkeys(FIRST, ItemStatus.SUCCEEDED))
    where = library(store, nightly, FIRST)
    newer = library(LocalStore(tmp_path / "newer"), nightly, FIRST | SECOND)
    store.put(where.key(INDEX), newer.store.get(newer.key(INDEX)))  # the keys are still old
    found = target(session, store, "nightly", SearchQuery(key="a"))
    indexes = IndexCache(1 << 30)
    with pytest.raises(TransientError, match="pipeline 'nightly' is being updated"):
        search.job_index(indexes, found)
    assert found.cache_name not in indexes


def test_thumbnails_come_from_the_newest_run_that_processed_each_object(
    session: Session, store: LocalStore
) -> None:
    nightly = pipeline(session)
    first = run(session, store, nightly, {"a": "succeeded", "b": "succeeded"}, age_s=60)
    second = run(session, store, nightly, {"b": "succeeded", "c": "failed"})
    shown = pipelines.jobs_that_processed(session, nightly.id, ["a", "b", "c", "zzz"])
    assert shown == {"a": first.id, "b": second.id}  # `a` skipped by the rerun, `c` failed
    assert pipelines.jobs_that_processed(session, nightly.id, []) == {}
