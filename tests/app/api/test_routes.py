"""The HTTP API on the embedded defaults: SQLite, a local store and the filesystem broker.

No worker runs: chunk messages just accumulate in the broker's folder.
"""

from __future__ import annotations

import gc
import io
import json
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from sqlalchemy.orm import Session, sessionmaker

from devstack.images import solid
from kiln.app.api.app import create_app
from kiln.app.core.config import Settings
from kiln.app.results import results
from kiln.app.storage import open_store
from kiln.app.tenants.auth import revoke_key
from kiln.app.tenants.tenants import allow_bucket
from tests.app.api.conftest import TestClient, bearer

MISSING_JOB = "00000000-0000-0000-0000-000000000000"


def files(*names: str) -> list[tuple[str, tuple[str, bytes, str]]]:
    return [
        ("files", (name, solid((20 * i, 100, 200)), "image/png")) for i, name in enumerate(names)
    ]


def submit(client: TestClient, n: int = 4, **kwargs: Any) -> dict[str, Any]:
    response = client.post(
        "/v1/jobs",
        data={"model": "detector"},
        files=files(*(f"f{i}.png" for i in range(n))),
        **kwargs,
    )
    assert response.status_code == 202, response.text
    body: dict[str, Any] = response.json()
    return body


def queued_messages(settings: Settings) -> list[Path]:
    return sorted((settings.broker_dir / "queue").glob("*.msg"))


def assert_sentence(response: Any, status: int, *fragments: str) -> str:
    assert response.status_code == status, response.text
    detail = response.json()["detail"]
    assert isinstance(detail, str) and detail.endswith("."), detail
    for fragment in fragments:
        assert fragment in detail, detail
    return detail


# --- authentication -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/jobs"),
        ("POST", "/v1/jobs"),
        ("GET", f"/v1/jobs/{MISSING_JOB}"),
        ("GET", f"/v1/jobs/{MISSING_JOB}/items"),
        ("GET", f"/v1/jobs/{MISSING_JOB}/results"),
        ("POST", f"/v1/jobs/{MISSING_JOB}/cancel"),
        ("GET", "/v1/models"),
    ],
)
def test_every_route_needs_a_key(client: TestClient, method: str, path: str) -> None:
    client.headers.pop("Authorization")
    response = client.request(method, path)
    assert_sentence(response, 401, "Authorization: Bearer")
    assert response.headers["WWW-Authenticate"] == "Bearer"


def test_an_unknown_or_revoked_key_is_401(
    client: TestClient, sessions: sessionmaker[Session], new_key: Callable[[str], str]
) -> None:
    response = client.get("/v1/jobs", headers=bearer("kiln_00000000_nope"))
    assert_sentence(response, 401, "unknown or revoked")

    secret = new_key("acme")
    assert client.get("/v1/jobs", headers=bearer(secret)).status_code == 200
    with sessions() as session:
        revoke_key(session, secret.split("_")[1])
        session.commit()
    assert_sentence(client.get("/v1/jobs", headers=bearer(secret)), 401, "unknown or revoked")


# --- submit and inspect -------------------------------------------------------------------


def test_submit_multipart_is_accepted_and_queued(client: TestClient, settings: Settings) -> None:
    response = client.post("/v1/jobs", data={"model": "detector"}, files=files(*"abcd"))

    assert response.status_code == 202, response.text
    job = response.json()
    assert response.headers["Location"] == f"http://testserver/v1/jobs/{job['id']}"
    assert job["status"] == "queued"
    assert job["model"] == "detector"
    assert job["counts"] == {
        "total": 4, "done": 0, "succeeded": 0, "failed": 0, "pending": 4, "running": 0,
        "answered": 0, "cancelled": 0, "skipped": 0, "deleted": 0, "fell_back": 0,
        "fell_back_succeeded": 0, "expanding": 0, "known_failed": 0,
        "excluded": 0,
    }  # fmt: skip
    assert job["results_url"] == f"http://testserver/v1/jobs/{job['id']}/results"
    assert job["started_at"] is None and job["items_per_second"] is None
    assert len(queued_messages(settings)) == 2  # chunk_size 3: two chunk messages

    shown = client.get(response.headers["Location"])
    assert shown.status_code == 200
    assert shown.json()["status"] == "queued"
    assert shown.json()["counts"]["pending"] == 4
    assert shown.json()["id"] == job["id"]


def test_a_job_says_when_no_worker_is_running(
    client: TestClient, sessions: sessionmaker[Session]
) -> None:
    """Queued with no worker reporting (workers publish their facts every 5 s): the job says
    it waits for one; once one reports, it does not."""
    from kiln.app.db import worker_facts
    from kiln.app.db.models import utcnow

    job = submit(client)
    assert job["waiting_for_worker"] is True
    with sessions() as session:
        worker_facts.publish(session, "cpu@box", "box", "cpu", {"models": {}}, utcnow())
        session.commit()
    shown = client.get(f"/v1/jobs/{job['id']}").json()
    assert shown["waiting_for_worker"] is False
    listed = client.get("/v1/jobs").json()["jobs"]
    assert [j["waiting_for_worker"] for j in listed] == [False]


def test_the_jobs_listing_keeps_a_status_and_refuses_one_there_is_not(client: TestClient) -> None:
    job = submit(client)

    def listed(**only: str) -> list[str]:
        return [j["id"] for j in client.get("/v1/jobs", params=only).json()["jobs"]]

    assert listed(status="queued") == [job["id"]]
    assert listed(status="completed") == listed(pipeline="nightly") == listed(schedule="n") == []
    assert_sentence(client.get("/v1/jobs", params={"status": "done"}), 422, "status", "'queued'")
    assert (job["pipeline"], job["schedule"], job["output"], job["options"]) == (
        None, None, None, {},
    )  # fmt: skip


def test_chunk_messages_carry_ids_not_bytes(client: TestClient, settings: Settings) -> None:
    job = submit(client, n=2)
    [message] = queued_messages(settings)
    envelope = json.loads(message.read_text())
    assert envelope["headers"]["task"] == "kiln.process_chunk"
    assert envelope["properties"]["delivery_info"]["routing_key"] == "interactive"
    assert job["id"] in message.read_text()
    assert message.stat().st_size < 4096


def test_submit_json_inputs(client: TestClient, sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        allow_bucket(session, "acme", "photos")
        session.commit()
    body = {
        "model": "detector",
        "inputs": [{"uri": "s3://photos/a.jpg"}, {"uri": "s3://photos/b.jpg"}],
    }
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    items = client.get(f"/v1/jobs/{response.json()['id']}/items").json()["items"]
    assert [i["key"] for i in items] == ["s3://photos/a.jpg", "s3://photos/b.jpg"]


def test_idempotency_key_header_returns_the_same_job(
    client: TestClient, settings: Settings
) -> None:
    first = client.post(
        "/v1/jobs",
        data={"model": "detector"},
        files=files("a.png"),
        headers={"Idempotency-Key": "upload-7"},
    )
    again = client.post(
        "/v1/jobs",
        data={"model": "detector"},
        files=files("a.png"),
        headers={"Idempotency-Key": "upload-7"},
    )
    assert first.status_code == 202
    assert again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    assert again.headers["Location"] == first.headers["Location"]
    assert len(queued_messages(settings)) == 1


def test_items_are_paged_with_a_next_cursor(client: TestClient) -> None:
    job = submit(client, n=5)
    url = f"/v1/jobs/{job['id']}/items"

    first = client.get(url, params={"limit": 2}).json()
    assert [i["key"] for i in first["items"]] == ["f0.png", "f1.png"]
    assert first["next"] is not None
    second = client.get(url, params={"limit": 2, "after": first["next"]}).json()
    assert [i["key"] for i in second["items"]] == ["f2.png", "f3.png"]
    third = client.get(url, params={"limit": 2, "after": second["next"]}).json()
    assert [i["key"] for i in third["items"]] == ["f4.png"]
    assert third["next"] is None

    item = first["items"][0]
    assert item == {
        "key": "f0.png",
        "status": "pending",
        "error": None,
        "attempts": 0,
        "duration_ms": None,
        "outputs": None,
        "answered_by": None,
        "fallback_reason": None,
        "frame_index": None,
        "frame_time_s": None,
    }


def test_items_filtered_by_status(client: TestClient) -> None:
    job = submit(client, n=3)
    url = f"/v1/jobs/{job['id']}/items"
    assert len(client.get(url, params={"status": "pending"}).json()["items"]) == 3
    assert client.get(url, params={"status": "succeeded"}).json()["items"] == []
    assert_sentence(client.get(url, params={"status": "bogus"}), 422, "status")


def test_jobs_are_listed_newest_first_with_a_cursor(
    client: TestClient, other: dict[str, str]
) -> None:
    ids = [submit(client, n=1)["id"] for _ in range(3)]
    submit(client, n=1, headers=other)  # another tenant's job is not listed

    first = client.get("/v1/jobs", params={"limit": 2}).json()
    rest = client.get("/v1/jobs", params={"limit": 2, "after": first["next"]}).json()
    assert [j["id"] for j in first["jobs"] + rest["jobs"]] == ids[::-1]
    assert rest["next"] is None
    assert_sentence(client.get("/v1/jobs", params={"after": MISSING_JOB}), 422, "not a cursor")


# --- bad requests -------------------------------------------------------------------------


def test_json_with_an_unknown_field_is_422(client: TestClient) -> None:
    body = {"model": "detector", "inputs": [{"uri": "s3://b/k.jpg"}], "priority": "high"}
    assert_sentence(client.post("/v1/jobs", json=body), 422, "The request is not valid", "priority")


def test_json_with_an_unknown_model_is_422(client: TestClient) -> None:
    body = {"model": "nope", "inputs": [{"uri": "s3://b/k.jpg"}]}
    assert_sentence(
        client.post("/v1/jobs", json=body), 422, "no model named 'nope'", "detector", "ocr"
    )


def test_malformed_json_is_422(client: TestClient) -> None:
    response = client.post(
        "/v1/jobs",
        content=b'{"model": "detector", "inputs": [',
        headers={"Content-Type": "application/json"},
    )
    assert_sentence(response, 422, "The request is not valid", "JSON")


def test_json_without_inputs_is_422(client: TestClient) -> None:
    assert_sentence(
        client.post("/v1/jobs", json={"model": "detector", "inputs": []}), 422, "inputs"
    )


def test_an_unsupported_content_type_is_422(client: TestClient) -> None:
    response = client.post(
        "/v1/jobs", content=b"model=detector", headers={"Content-Type": "text/plain"}
    )
    assert_sentence(response, 422, "multipart/form-data", "application/json")


def test_multipart_without_a_model_or_files_is_422(client: TestClient) -> None:
    assert_sentence(client.post("/v1/jobs", files=files("a.png")), 422, "'model' field")
    assert_sentence(
        client.post("/v1/jobs", data={"model": "detector"}, files={"other": ("x", b"1")}),
        422,
        "'files'",
    )


def test_multipart_with_duplicate_names_is_422(client: TestClient) -> None:
    response = client.post("/v1/jobs", data={"model": "detector"}, files=files("a.png", "a.png"))
    assert_sentence(response, 422, "share the name 'a.png'")


def test_multipart_with_bad_options_is_422(client: TestClient) -> None:
    response = client.post(
        "/v1/jobs", data={"model": "detector", "options": "[1, 2]"}, files=files("a.png")
    )
    assert_sentence(response, 422, "'options' must be a JSON object")


@pytest.mark.parametrize(
    ("model", "options", "fragments"),
    [
        ("phash", {"max_distnace": 8}, ("no option 'max_distnace'", "'max_distance'")),
        ("phash", {"max_distance": "8"}, ("'max_distance'", "whole number of bits")),
        ("detector", {"max_distance": 8}, ("'detector' has no option", "only option is")),
    ],
)
def test_options_the_family_does_not_declare_are_422(
    client: TestClient, model: str, options: dict[str, object], fragments: tuple[str, ...]
) -> None:
    multipart = client.post(
        "/v1/jobs", data={"model": model, "options": json.dumps(options)}, files=files("a.png")
    )
    assert_sentence(multipart, 422, *fragments)
    body = {"model": model, "inputs": [{"uri": "s3://any/a.png"}], "options": options}
    assert_sentence(client.post("/v1/jobs", json=body), 422, *fragments)


def test_a_schedule_with_an_unknown_option_is_422(client: TestClient) -> None:
    body = {"name": "n", "cron": "0 2 * * *", "model": "phash", "source": {"s3": "s3://b/"}}
    bad = client.post("/v1/schedules", json={**body, "options": {"max_distnace": 1}})
    assert_sentence(bad, 422, "no option 'max_distnace'")


def test_an_upload_over_the_limit_is_413(settings: Settings, new_key: Callable[[str], str]) -> None:
    small = settings.model_copy(update={"max_upload_bytes": 100})
    with TestClient(create_app(small), headers=bearer(new_key("acme"))) as http:
        response = http.post(
            "/v1/jobs", data={"model": "detector"}, files={"files": ("big.png", b"x" * 101)}
        )
    assert_sentence(response, 413, "big.png", "100-byte limit")


# --- tenants ------------------------------------------------------------------------------


def test_another_tenant_gets_404_everywhere(client: TestClient, other: dict[str, str]) -> None:
    job_id = submit(client)["id"]
    for method, path in [
        ("GET", f"/v1/jobs/{job_id}"),
        ("GET", f"/v1/jobs/{job_id}/items"),
        ("GET", f"/v1/jobs/{job_id}/results"),
        ("GET", f"/v1/jobs/{job_id}/groups"),
        ("POST", f"/v1/jobs/{job_id}/cancel"),
    ]:
        response = client.request(method, path, headers=other)
        assert_sentence(response, 404, f"There is no job {job_id}")
    assert client.get(f"/v1/jobs/{job_id}").json()["status"] == "queued"  # not cancelled


def test_an_unknown_job_is_404(client: TestClient) -> None:
    assert_sentence(client.get(f"/v1/jobs/{MISSING_JOB}"), 404, "There is no job")


# --- models, health, results, cancel ------------------------------------------------------


def test_models_lists_the_builtins(client: TestClient) -> None:
    response = client.get("/v1/models")
    assert response.status_code == 200
    models = {m["name"]: m for m in response.json()}
    assert {"detector", "ocr"} <= set(models)
    assert models["detector"]["kind"] == "detect"
    ocr = models["ocr"]
    assert (ocr["ref"], ocr["kind"], ocr["input"], ocr["builtin"]) == ("ocr", "ocr", "image", True)
    assert ocr["version"]  # the shipping package's version
    assert ocr["engines"] == []  # no worker has loaded it yet
    assert {"text-embed", "phash"} <= set(models)
    assert models["text-embed"]["input"] == "text"


def test_healthz_needs_no_key(client: TestClient) -> None:
    client.headers.pop("Authorization")
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_readyz_checks_database_broker_and_storage(client: TestClient) -> None:
    response = client.get("/readyz")
    assert response.status_code == 200, response.text
    assert response.json() == {
        "ready": True,
        "checks": {"database": "ok", "broker": "ok", "storage": "ok"},
    }


def test_results_before_any_shard_is_an_empty_parquet_file(client: TestClient) -> None:
    job_id = submit(client)["id"]
    response = client.get(f"/v1/jobs/{job_id}/results")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/vnd.apache.parquet"
    assert response.headers["X-Kiln-Job-Status"] == "queued"
    assert f'filename="{job_id}.parquet"' in response.headers["Content-Disposition"]
    table = pq.read_table(io.BytesIO(response.content))
    assert table.num_rows == 0
    assert table.column_names == [
        *["key", "status", "error", "duration_ms", "sha256", "answered_by", "fallback_reason"],
        *["source", "frame_index", "frame_time_s"],
    ]


def test_groups_answer_once_the_job_has_closed(client: TestClient, settings: Settings) -> None:
    job_id = submit(client, n=2)["id"]
    assert_sentence(client.get(f"/v1/jobs/{job_id}/groups"), 409, "still queued", "closes")

    client.post(f"/v1/jobs/{job_id}/cancel")  # closed; its close steps have not run yet
    response = client.get(f"/v1/jobs/{job_id}/groups")
    assert_sentence(response, 503, "still being written")
    assert response.headers["Retry-After"] == "5"

    place = results.Place(open_store(settings), results.results_prefix(job_id))
    results.write_manifest(place, {"job_id": job_id})  # what the close steps write last
    response = client.get(f"/v1/jobs/{job_id}/groups")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/vnd.apache.parquet"
    table = pq.read_table(io.BytesIO(response.content))  # none found: empty, with its columns
    assert (table.num_rows, table.column_names) == (0, ["group", "key", "similarity", "sha256"])


def test_cancel_then_cancel_again(client: TestClient) -> None:
    job_id = submit(client, n=4)["id"]

    response = client.post(f"/v1/jobs/{job_id}/cancel")
    assert response.status_code == 200, response.text
    job = response.json()
    assert job["status"] == "cancelled"
    assert job["counts"] == {
        "total": 4, "done": 4, "succeeded": 0, "failed": 0, "pending": 0, "running": 0,
        "answered": 0, "cancelled": 4, "skipped": 0, "deleted": 0, "fell_back": 0,
        "fell_back_succeeded": 0, "expanding": 0, "known_failed": 0,
        "excluded": 0,
    }  # fmt: skip
    assert job["finished_at"] is not None
    items = client.get(f"/v1/jobs/{job_id}/items").json()["items"]
    assert {i["status"] for i in items} == {"cancelled"}

    assert_sentence(client.post(f"/v1/jobs/{job_id}/cancel"), 409, "already cancelled")


def test_openapi_schema_lists_the_routes(client: TestClient) -> None:
    client.headers.pop("Authorization")
    response = client.get("/openapi.json")
    assert response.status_code == 200
    schema = response.json()
    assert schema["info"]["title"] == "Kiln"
    paths = schema["paths"]
    assert {"post", "get"} <= set(paths["/v1/jobs"])
    assert "/v1/jobs/{job_id}" in paths
    assert "/v1/jobs/{job_id}/items" in paths
    assert "/v1/jobs/{job_id}/results" in paths
    assert "/v1/jobs/{job_id}/cancel" in paths
    assert "/v1/models" in paths
    body = paths["/v1/jobs"]["post"]["requestBody"]["content"]
    assert {"application/json", "multipart/form-data"} <= set(body)


def test_multipart_uploads_are_closed(client: TestClient) -> None:
    """Each upload is spooled to a temporary file (on disk past 1 MB); the API must close
    them once the request is read, not leave them to the garbage collector."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        response = client.post("/v1/jobs", data={"model": "detector"}, files=files("a.png"))
        assert response.status_code == 202
        del response
        gc.collect()
    unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert unclosed == []


def test_wait_returns_at_once_for_a_closed_job(client: TestClient) -> None:
    job = submit(client)
    client.post(f"/v1/jobs/{job['id']}/cancel")
    started = time.monotonic()
    response = client.get(f"/v1/jobs/{job['id']}", params={"wait": 30})
    assert response.status_code == 200
    assert response.json()["status"] == "cancelled"
    assert time.monotonic() - started < 5


def test_wait_on_an_open_job_ends_with_the_wait(client: TestClient) -> None:
    job = submit(client)  # no worker runs: the job stays queued
    started = time.monotonic()
    response = client.get(f"/v1/jobs/{job['id']}", params={"wait": 0.3})
    took = time.monotonic() - started
    assert response.json()["status"] == "queued"
    assert 0.3 <= took < 5


def test_wait_answers_when_the_job_closes(client: TestClient) -> None:
    job = submit(client)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(client.get, f"/v1/jobs/{job['id']}", params={"wait": 30})
        time.sleep(0.3)
        started = time.monotonic()
        client.post(f"/v1/jobs/{job['id']}/cancel")
        response = waiting.result(timeout=30)
    assert response.json()["status"] == "cancelled"
    assert time.monotonic() - started < 5  # not the full 30 s


@pytest.mark.parametrize("wait", ["-1", "61", "soon"])
def test_a_bad_wait_is_a_422(client: TestClient, wait: str) -> None:
    job = submit(client)
    response = client.get(f"/v1/jobs/{job['id']}", params={"wait": wait})
    assert response.status_code == 422
    assert response.json()["detail"].startswith("The request is not valid: query.wait")


def test_one_connection_serves_every_route(
    settings: Settings, new_key: Callable[[str], str]
) -> None:
    """No request holds two pooled connections at once: with a pool of one, nothing waits.

    (Authentication used to keep the request's session while submission opened another, so a
    burst of uploads deadlocked the pool.)"""
    tight = settings.model_copy(
        update={"db_pool_size": 1, "db_max_overflow": 0, "db_pool_timeout_s": 2.0}
    )
    with TestClient(create_app(tight), headers=bearer(new_key("acme"))) as http:
        job = submit(http)
        assert http.get(f"/v1/jobs/{job['id']}", params={"wait": 0.1}).status_code == 200
        assert http.get(f"/v1/jobs/{job['id']}/items").status_code == 200
        assert http.get("/v1/jobs").status_code == 200
        assert http.get("/v1/models").status_code == 200
        assert http.post(f"/v1/jobs/{job['id']}/cancel").status_code == 200
