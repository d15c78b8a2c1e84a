"""A bulk job's output on the real stack (moto S3, Postgres, Redis, `kiln api`, `kiln worker`,
`kiln beat`): an output that cannot work is refused at submission, through the API and the CLI;
an output bucket removed while its job runs fails the job within a minute with a sentence
naming it, no item run past the attempts limit nor again after, and the pipeline takes a new
run at once."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from devstack.jobs import wait_closed
from devstack.services import (
    Process,
    claim_redis_db,
    kiln_command,
    release_redis_db,
    start_api,
    start_worker,
)
from devstack.services import service_env as process_env
from kiln.app.db.models import Item
from kiln.app.tenants.auth import create_key
from kiln.app.tenants.tenants import allow_bucket
from tests.integration.test_bulk import put_objects
from tests.stack import RUNNING, SOURCE_BUCKET, run_kiln

MISSING = "results"  # the README's example, a bucket never created
SENTENCE = (
    f"The output bucket '{MISSING}' does not exist (s3://{MISSING}/detector/): create it or "
    "name another --output."
)


def readme_bulk(output: str) -> dict[str, Any]:
    """The README's bulk example as its JSON body (`kiln bulk … --name … --output …`)."""
    return {
        "model": "detector",
        "source": {"s3": f"s3://{SOURCE_BUCKET}/2026/", "include": ["*.jpg", "*.png"]},
        "pipeline": "nightly-moderation",
        "output": output,
    }


def plain(text: str) -> str:
    """Text as one line (rich wraps the CLI's sentences at the terminal's width)."""
    return " ".join(text.split())


def test_a_missing_output_bucket_is_refused_at_submission(
    client: httpx.Client,
    sessions: Any,
    s3: Any,
    service_env: dict[str, str],
    api_url: str,
) -> None:
    with sessions() as session:  # allowed, but never created: S3 itself must say
        allow_bucket(session, "acme", MISSING)
        session.commit()
    output = f"s3://{MISSING}/detector/"

    refused = client.post("/v1/jobs", json=readme_bulk(output))
    assert refused.status_code == 422, refused.text
    assert refused.json()["detail"] == SENTENCE
    schedule = {"name": "nightly", "cron": "0 2 * * *", **readme_bulk(output)}
    del schedule["pipeline"]
    refused_schedule = client.post("/v1/schedules", json=schedule)
    assert refused_schedule.status_code == 422, refused_schedule.text
    assert refused_schedule.json()["detail"] == SENTENCE

    private = client.post("/v1/jobs", json=readme_bulk("s3://someone-elses/detector/"))
    assert private.status_code == 403, private.text
    assert "'acme' may not write to bucket 'someone-elses'" in private.json()["detail"]

    with sessions() as session:
        key = create_key(session, "acme").secret
        session.commit()
    env = {**service_env, "KILN_API_URL": api_url, "KILN_API_KEY": key}
    cli = run_kiln(
        env, "bulk", f"s3://{SOURCE_BUCKET}/2026/", "--model", "detector",
        "--include", "*.jpg", "--include", "*.png", "--name", "nightly-moderation",
        "--output", output, "--watch",
    )  # fmt: skip
    assert cli.returncode == 1, cli.stdout
    assert SENTENCE in plain(cli.stderr), cli.stderr
    assert "job" not in cli.stdout  # nothing was submitted
    assert MISSING not in {b["Name"] for b in s3.list_buckets()["Buckets"]}  # none made


# A job paced to run for a while whatever the machine: one list page of two chunks at a time,
# the next page two seconds later while those are outstanding.
OBJECTS = 400
LIMIT = 3  # KILN_MAX_ATTEMPTS, small, so passing it would show
OUT_BUCKET = "kiln-night-results"


@pytest.fixture
def night(
    service_env: dict[str, str], migrated: Any, sessions: Any, log_dir: Path
) -> Iterator[tuple[httpx.Client, dict[str, str]]]:
    """An API, a worker and beat of their own (a Redis database of their own), with leases,
    the reconciler and re-sends in seconds, as test_stalled's."""
    broker = claim_redis_db()
    env = process_env(
        {
            **{k: v for k, v in service_env.items() if k.startswith("KILN_")},
            "KILN_BROKER_URL": broker,
            "KILN_MAX_ATTEMPTS": str(LIMIT),
            "KILN_INGEST_PAGE_SIZE": "16",
            "KILN_BULK_MAX_CHUNKS": "2",
            "KILN_LEASE_S": "12",
            "KILN_LEASE_RENEW_S": "2",
            "KILN_RECONCILE_INTERVAL_S": "2",
            "KILN_REDISPATCH_AFTER_S": "5",
        }
    )
    started: list[Process] = []

    def keep(proc: Process) -> None:
        started.append(proc)
        RUNNING[proc.name] = proc

    try:
        api, url = start_api(env, log_dir, name="night-api")
        keep(api)
        keep(start_worker(env, log_dir, name="night-worker", node_prefix="night")[0])
        keep(Process("night-beat", kiln_command("beat"), env, log_dir))
        with sessions() as session:
            key = create_key(session, "acme", (SOURCE_BUCKET, OUT_BUCKET)).secret
            session.commit()
        headers = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
            yield http, env
    finally:
        for proc in started:
            RUNNING.pop(proc.name, None)
            proc.stop()
        release_redis_db(broker)


def test_an_output_bucket_removed_mid_run_fails_the_job_within_a_minute(
    night: tuple[httpx.Client, dict[str, str]], s3: Any, sessions: Any
) -> None:
    client, _env = night
    prefix = "night-output/"
    put_objects(s3, [f"{prefix}img-{i:05d}.jpg" for i in range(OBJECTS)], seed=7)
    s3.create_bucket(Bucket=OUT_BUCKET)
    output = f"s3://{OUT_BUCKET}/detector/"
    body = {
        "model": "phash",
        "source": {"s3": f"s3://{SOURCE_BUCKET}/{prefix}"},
        "pipeline": "night",
        "output": output,
    }
    submitted = client.post("/v1/jobs", json=body)
    assert submitted.status_code == 202, submitted.text
    job_id = submitted.json()["id"]
    job = _poll(client, job_id, lambda j: j["counts"]["succeeded"] >= 16)  # shards written
    assert job["status"] == "running", "the job ended before the bucket went; make it larger"

    _remove_bucket(s3, OUT_BUCKET)
    removed_at = time.monotonic()
    failed = wait_closed(client, job_id, timeout=90, poll_s=5)
    took = time.monotonic() - removed_at
    print(f"failed {took:.1f} s after the bucket went: {failed['counts']}")
    assert took < 60
    assert failed["status"] == "failed"
    sentence = (
        f"The output bucket '{OUT_BUCKET}' does not exist ({output}): create it or name "
        "another --output."
    )
    assert failed["error"] == sentence
    c = failed["counts"]
    assert c["pending"] == c["running"] == 0 and c["failed"] > 0
    assert c["succeeded"] + c["failed"] == c["total"]

    attempts = _attempts(sessions, job_id)
    errors = _errors(sessions, job_id)
    assert max(attempts) <= LIMIT
    assert errors == {sentence}, errors  # each failed item names the output
    for _ in range(3):  # the reconciler runs every 2 s: it re-sends nothing, nothing re-runs
        time.sleep(2.5)
        assert _attempts(sessions, job_id) == attempts
    assert client.get(f"/v1/jobs/{job_id}").json()["status"] == "failed"

    s3.create_bucket(Bucket=OUT_BUCKET)  # the pipeline takes a new run at once (not 409)
    again = client.post("/v1/jobs", json=body)
    assert again.status_code == 202, again.text
    rerun = wait_closed(client, again.json()["id"], timeout=300, poll_s=5)
    assert rerun["status"] == "completed", rerun
    assert rerun["counts"]["failed"] == 0


def _remove_bucket(s3: Any, bucket: str) -> None:
    """Empty the bucket and delete it; shards written meanwhile are deleted on the next try."""
    for _ in range(50):
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                s3.delete_objects(Bucket=bucket, Delete={"Objects": keys})
        try:
            s3.delete_bucket(Bucket=bucket)
            return
        except s3.exceptions.ClientError as error:
            if error.response["Error"]["Code"] != "BucketNotEmpty":
                raise
    raise AssertionError(f"could not remove {bucket}: writes kept filling it")


def _attempts(sessions: Any, job_id: str) -> list[int]:
    with sessions() as session:
        return list(
            session.scalars(select(Item.attempts).where(Item.job_id == job_id).order_by(Item.id))
        )


def _errors(sessions: Any, job_id: str) -> set[str | None]:
    with sessions() as session:
        return set(
            session.scalars(
                select(func.distinct(Item.error)).where(
                    Item.job_id == job_id, Item.status == "failed"
                )
            )
        )


def _poll(
    client: httpx.Client, job_id: str, ready: Callable[[dict[str, Any]], bool], timeout: float = 120
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if ready(job) or job["status"] in ("completed", "failed", "cancelled"):
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} never got there in {timeout} s: {job}")
