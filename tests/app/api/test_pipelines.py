"""GET /v1/pipelines, /v1/pipelines/{name} and /v1/pipelines/{name}/results on the embedded
defaults. No worker runs: a pipeline's runs, their items, shards and the pipeline's objects are
written as an ingest and its chunks leave them. The same on the real stack, driven by real
runs, is tests/integration/test_pipeline_state.py."""

from __future__ import annotations

import io
import uuid
from collections.abc import Callable
from datetime import timedelta

import pyarrow.parquet as pq
import pytest
from sqlalchemy.orm import Session, sessionmaker

from kiln.app.db.models import Item, Job, JobStatus, Pipeline, PipelineObject, Schedule, utcnow
from kiln.app.results.results import ResultRow, items_table, place_for, write_table
from kiln.app.storage.local import LocalStore
from tests.app.api.conftest import TestClient
from tests.app.api.test_routes import assert_sentence

ERROR = "The file is not an image."


def no_s3() -> object:
    raise AssertionError("these runs keep their results in Kiln's own store")


def add_run(
    session: Session,
    store: LocalStore,
    pipeline: Pipeline,
    finished: dict[str, tuple[str, str]],  # key → (status, etag)
    age_s: int,
) -> str:
    """A closed run: its items and its one shard."""
    job = Job(
        id=str(uuid.uuid4()),
        tenant=pipeline.tenant,
        model="phash",
        status=JobStatus.COMPLETED,
        source=pipeline.source,
        pipeline_id=pipeline.id,
        queue="bulk",
        created_at=utcnow() - timedelta(seconds=age_s),
        finished_at=utcnow() - timedelta(seconds=age_s - 5),
    )
    session.add(job)
    session.flush()
    rows = []
    for key, (status, etag) in finished.items():
        error = ERROR if status == "failed" else None
        session.add(Item(job_id=job.id, key=key, status=status, etag=etag, error=error))
        rows.append(ResultRow(key, status, error, 1.0, None, sha256=f"{key}@{etag}"))
    session.commit()
    write_table(place_for(store, job.id, None, no_s3), 0, items_table(rows, []))
    return job.id


@pytest.fixture
def nightly(sessions: sessionmaker[Session], store: LocalStore) -> dict[str, str]:
    """Pipeline `nightly` of acme: a first run over a, b, c, d and broken x; a rerun after b
    changed, d was deleted and e added (x failed again); p listed since, not processed."""
    with sessions() as session:
        pipeline = Pipeline(tenant="acme", name="nightly", source={"s3": "s3://p/"}, model="phash")
        session.add(pipeline)
        session.commit()
        first = add_run(
            session,
            store,
            pipeline,
            {k: ("succeeded", "1") for k in "abcd"} | {"x": ("failed", "1")},
            age_s=120,
        )
        rerun = add_run(
            session,
            store,
            pipeline,
            {"b": ("succeeded", "2"), "e": ("succeeded", "1"), "x": ("failed", "1")},
            age_s=60,
        )
        etags = {"a": "1", "b": "2", "c": "1", "e": "1", "x": "1", "p": "1"}
        done = {"a": "1", "b": "2", "c": "1", "e": "1"}
        session.add_all(
            PipelineObject(
                pipeline_id=pipeline.id,
                key=key,
                etag=etag,
                seen_job=rerun,
                done_etag=done.get(key),
                done_model="phash" if key in done else None,
            )
            for key, etag in etags.items()
        )
        session.commit()
    return {"first": first, "rerun": rerun}


def test_a_pipeline_answers_its_runs_objects_and_known_failures(
    client: TestClient, nightly: dict[str, str]
) -> None:
    response = client.get("/v1/pipelines/nightly", params={"runs": 5})
    assert response.status_code == 200, response.text
    state = response.json()
    assert (state["name"], state["model"], state["run_count"]) == ("nightly", "phash", 2)
    assert [run["id"] for run in state["runs"]] == [nightly["rerun"], nightly["first"]]
    assert state["last_run"] == state["runs"][0]
    assert state["last_run"]["status"] == "completed" and state["last_run"]["finished_at"]
    assert state["objects"] == {"live": 6, "succeeded": 4, "failed": 1, "pending": 1}
    assert state["failures"] == [{"key": "x", "error": ERROR, "job_id": nightly["rerun"]}]
    assert state["schedule"] is None
    assert state["results_url"].endswith("/v1/pipelines/nightly/results")

    one = client.get("/v1/pipelines/nightly", params={"runs": 1}).json()
    assert [run["id"] for run in one["runs"]] == [nightly["rerun"]] and one["run_count"] == 2


def test_the_list_has_each_pipeline_with_its_last_run(
    client: TestClient, nightly: dict[str, str]
) -> None:
    listed = client.get("/v1/pipelines")
    assert listed.status_code == 200, listed.text
    (only,) = listed.json()
    assert only["name"] == "nightly" and only["last_run"]["id"] == nightly["rerun"]
    assert only["objects"]["live"] == 6 and "runs" not in only and "failures" not in only


def test_the_current_results_are_one_row_per_live_object(
    client: TestClient, nightly: dict[str, str]
) -> None:
    response = client.get("/v1/pipelines/nightly/results")
    assert response.status_code == 200, response.text
    assert response.headers["x-kiln-live-objects"] == "6"
    rows = pq.read_table(io.BytesIO(response.content)).to_pylist()
    got = {r["key"]: (r["status"], r["sha256"], r["job_id"]) for r in rows}
    first, rerun = nightly["first"], nightly["rerun"]
    assert len(rows) == len(got) == 5  # d deleted; p not processed yet
    assert got == {
        "a": ("succeeded", "a@1", first),
        "b": ("succeeded", "b@2", rerun),
        "c": ("succeeded", "c@1", first),
        "e": ("succeeded", "e@1", rerun),
        "x": ("failed", "x@1", rerun),  # its newest failure, once
    }


def test_a_schedule_shows_and_one_not_run_yet_is_a_sentence(
    client: TestClient, nightly: dict[str, str], sessions: sessionmaker[Session]
) -> None:
    with sessions() as session:
        for name in ("nightly", "later"):
            session.add(
                Schedule(
                    tenant="acme",
                    name=name,
                    cron="0 2 * * *",
                    source={"s3": "s3://p/"},
                    model="phash",
                    next_run_at=utcnow() + timedelta(hours=1),
                )
            )
        session.commit()
    assert client.get("/v1/pipelines/nightly").json()["schedule"]["cron"] == "0 2 * * *"
    assert_sentence(
        client.get("/v1/pipelines/later"), 404, "Pipeline 'later' has not run yet", "schedule"
    )


def test_an_unknown_or_anothers_pipeline_is_a_404_sentence(
    client: TestClient, nightly: dict[str, str], other: dict[str, str]
) -> None:
    for path in ("/v1/pipelines/nope", "/v1/pipelines/nope/results"):
        assert_sentence(client.get(path), 404, "There is no pipeline 'nope'", "--name nope")
    for path in ("/v1/pipelines/nightly", "/v1/pipelines/nightly/results"):
        assert_sentence(client.get(path, headers=other), 404, "There is no pipeline 'nightly'")
    assert client.get("/v1/pipelines", headers=other).json() == []


def test_a_run_whose_results_cannot_be_read_is_a_sentence(
    client: TestClient, nightly: dict[str, str], store: LocalStore
) -> None:
    place = place_for(store, nightly["rerun"], None, no_s3)
    store.put(place.key("part-000000.parquet"), b"damaged")
    assert_sentence(
        client.get("/v1/pipelines/nightly/results"),
        409,
        f"The results of run {nightly['rerun']} cannot be read",
    )


def test_no_pipelines_is_an_empty_list(client: TestClient, new_key: Callable[[str], str]) -> None:
    assert client.get("/v1/pipelines").json() == []
