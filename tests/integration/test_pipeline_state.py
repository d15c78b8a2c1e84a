"""A pipeline's current state on the real stack (API and worker processes, Postgres, Redis,
moto S3): after a rerun over a bucket where objects changed, were deleted and were added,
`GET /v1/pipelines/{name}/results` and `kiln results --pipeline` give exactly one row per live
object with its latest content, where the runs' shards together hold more; `GET /v1/pipelines`
and `GET /v1/pipelines/{name}` answer the runs, the objects' counts, the known failures and the
schedule; an unknown pipeline is a 404 sentence."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.integration.test_bulk import put_objects, result_keys, run_pipeline
from tests.stack import SOURCE_BUCKET, _key, run_kiln

PREFIX = "pipeline-state/"
NAME = "state"
FIRST = 300  # images in the first run (the 1,505, scaled for a small machine)
CHANGED, DELETED, ADDED = 50, 30, 40
KEYS = [f"{PREFIX}img-{i:04d}.jpg" for i in range(FIRST)]
BROKEN = [f"{PREFIX}broken-{i}.jpg" for i in range(3)]  # not images: they fail
FIXED = BROKEN[0]  # replaced by an image before the rerun
CHANGED_KEYS = KEYS[:CHANGED]
DELETED_KEYS = KEYS[CHANGED : CHANGED + DELETED]
ADDED_KEYS = [f"{PREFIX}new/img-{i:04d}.jpg" for i in range(ADDED)]
LIVE = set(KEYS) - set(DELETED_KEYS) | set(ADDED_KEYS) | set(BROKEN)


def put_broken(s3: Any, keys: list[str]) -> None:
    for key in keys:
        s3.put_object(Bucket=SOURCE_BUCKET, Key=key, Body=b"not a picture")


@pytest.fixture(scope="module")
def runs(client: httpx.Client, s3: Any) -> dict[str, Any]:
    """Pipeline `state`: a first run, then a rerun after 50 changed, 30 deleted, 40 added (and
    one failed object fixed, two still broken)."""
    put_objects(s3, KEYS, seed=11)
    put_broken(s3, BROKEN)
    first = run_pipeline(client, PREFIX, NAME)
    assert first["status"] == "completed", first
    assert (first["counts"]["succeeded"], first["counts"]["failed"]) == (FIRST, len(BROKEN))

    put_objects(s3, CHANGED_KEYS, seed=12)  # new bytes: new ETags
    s3.delete_objects(Bucket=SOURCE_BUCKET, Delete={"Objects": [{"Key": k} for k in DELETED_KEYS]})
    put_objects(s3, ADDED_KEYS, seed=13)
    put_objects(s3, [FIXED], seed=14)
    rerun = run_pipeline(client, PREFIX, NAME)
    assert rerun["status"] == "completed", rerun
    return {"first": first, "rerun": rerun}


def current_results(client: httpx.Client) -> pa.Table:
    response = client.get(f"/v1/pipelines/{NAME}/results")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/vnd.apache.parquet"
    return pq.read_table(io.BytesIO(response.content))


def test_the_current_results_are_one_row_per_live_object_at_its_latest(
    client: httpx.Client, s3: Any, runs: dict[str, Any]
) -> None:
    table = current_results(client)
    keys = table.column("key").to_pylist()
    assert len(keys) == len(set(keys)) == len(LIVE)  # exactly one row per live object
    assert set(keys) == LIVE  # deleted ones gone, added ones there
    # the runs' shards together (the README's old glob) hold old rows of changed objects,
    # deleted objects and failures once per run
    union = result_keys(client, runs["first"]["id"]) + result_keys(client, runs["rerun"]["id"])
    assert len(union) > len(LIVE)

    first, rerun = runs["first"]["id"], runs["rerun"]["id"]
    by_key = {row["key"]: row for row in table.to_pylist()}
    for key in LIVE:  # each row is of the bytes the bucket holds now
        body = s3.get_object(Bucket=SOURCE_BUCKET, Key=key)["Body"].read()
        assert by_key[key]["sha256"] == hashlib.sha256(body).hexdigest(), key
    for key in [*CHANGED_KEYS, *ADDED_KEYS, FIXED]:
        assert (by_key[key]["status"], by_key[key]["job_id"]) == ("succeeded", rerun), key
    assert {by_key[k]["job_id"] for k in KEYS[CHANGED + DELETED :]} == {first}  # unchanged
    for key in BROKEN[1:]:  # known failures, once, with their sentence
        assert by_key[key]["status"] == "failed" and by_key[key]["error"], by_key[key]
        assert by_key[key]["phash"] is None


def test_the_cli_writes_the_current_results(
    service_env: dict[str, str],
    api_url: str,
    sessions: object,
    runs: dict[str, Any],
    tmp_path: Path,
) -> None:
    env = {**service_env, "KILN_API_URL": api_url, "KILN_API_KEY": _key(sessions, "acme")}
    out = tmp_path / "current.parquet"
    done = run_kiln(env, "results", "--pipeline", NAME, "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert f"current results of pipeline {NAME} ({len(LIVE)} rows)" in done.stdout
    keys = pq.read_table(out, columns=["key"]).column("key").to_pylist()
    assert len(keys) == len(set(keys)) == len(LIVE) and set(keys) == LIVE

    unknown = run_kiln(env, "results", "--pipeline", "no-such-pipeline", "-o", str(out))
    assert unknown.returncode == 1
    assert "There is no pipeline 'no-such-pipeline'" in unknown.stderr + unknown.stdout
    both = run_kiln(env, "results", "some-job", "--pipeline", NAME, "-o", str(out))
    assert both.returncode != 0 and "--pipeline goes alone" in both.stderr + both.stdout


def test_the_pipeline_answers_its_runs_counts_and_known_failures(
    client: httpx.Client, runs: dict[str, Any]
) -> None:
    first, rerun = runs["first"], runs["rerun"]
    response = client.get(f"/v1/pipelines/{NAME}")
    assert response.status_code == 200, response.text
    state = response.json()
    assert (state["name"], state["model"], state["run_count"]) == (NAME, "phash", 2)
    assert state["source"]["s3"] == f"s3://{SOURCE_BUCKET}/{PREFIX}"
    assert state["last_run"]["id"] == rerun["id"]
    assert state["last_run"]["status"] == "completed" and state["last_run"]["finished_at"]
    assert [run["id"] for run in state["runs"]] == [rerun["id"], first["id"]]

    assert state["objects"] == {
        "live": len(LIVE),
        "succeeded": len(LIVE) - 2,
        "failed": 2,
        "pending": 0,
    }
    assert sorted(f["key"] for f in state["failures"]) == BROKEN[1:]
    assert all(f["error"] for f in state["failures"])

    newest, oldest = (run["counts"] for run in state["runs"])
    assert (oldest["total"], oldest["succeeded"], oldest["failed"]) == (303, 300, 3)
    assert newest["deleted"] == DELETED
    assert newest["succeeded"] == CHANGED + ADDED + 1  # the fixed object too
    # unchanged known failures are kept, not run again: every live object is counted once
    assert newest["known_failed"] == 2
    assert newest["total"] + newest["skipped"] + newest["known_failed"] == len(LIVE)
    assert state["results_url"].endswith(f"/v1/pipelines/{NAME}/results")

    listed = client.get("/v1/pipelines")
    assert listed.status_code == 200, listed.text
    mine = [p for p in listed.json() if p["name"] == NAME]
    assert len(mine) == 1 and "runs" not in mine[0]
    assert mine[0]["objects"] == state["objects"] and mine[0]["last_run"] == state["last_run"]


def test_a_schedule_shows_with_its_pipeline(client: httpx.Client, runs: dict[str, Any]) -> None:
    body = {
        "name": NAME,
        "cron": "0 3 1 1 *",  # once a year: no tick runs it in this test
        "model": "phash",
        "source": {"s3": f"s3://{SOURCE_BUCKET}/{PREFIX}", "include": ["*.jpg"]},
    }
    assert client.post("/v1/schedules", json=body).status_code == 201
    try:
        state = client.get(f"/v1/pipelines/{NAME}").json()
        assert state["schedule"]["cron"] == "0 3 1 1 *" and state["schedule"]["next_run_at"]
    finally:
        assert client.delete(f"/v1/schedules/{NAME}").status_code == 204
    assert client.get(f"/v1/pipelines/{NAME}").json()["schedule"] is None


def test_an_unknown_pipeline_is_a_404_sentence(
    client: httpx.Client, other_client: httpx.Client, runs: dict[str, Any]
) -> None:
    for path in ("/v1/pipelines/nope", "/v1/pipelines/nope/results"):
        response = client.get(path)
        assert response.status_code == 404, response.text
        assert response.json()["detail"].startswith("There is no pipeline 'nope'")
    for path in (f"/v1/pipelines/{NAME}", f"/v1/pipelines/{NAME}/results"):  # another tenant's
        assert other_client.get(path).status_code == 404
    assert all(p["name"] != NAME for p in other_client.get("/v1/pipelines").json())
