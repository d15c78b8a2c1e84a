"""Replaying what failed, on the real stack (moto S3, Postgres, Redis, `kiln api`, `kiln
worker`): a job of 1,000 images of which 120 fail for a transient cause (their objects are not
in the bucket yet), the objects then uploaded, and a retry that runs exactly those 120; the two
jobs name each other, the retry's key answers the same job again, and `kiln retry --wait` does
it from the CLI. A pipeline's run retries its objects by their own sources, without listing,
as a run of the pipeline."""

from __future__ import annotations

from typing import Any

import httpx
from sqlalchemy import select

from devstack.jobs import wait_closed
from kiln.app.db.models import Item
from tests.integration.test_bulk import put_objects
from tests.stack import SOURCE_BUCKET, _key, run_kiln

ITEMS, MISSING = 1000, 120


def item_keys(sessions: Any, job_id: str) -> dict[str, str]:
    with sessions() as session:
        rows = session.execute(select(Item.key, Item.status).where(Item.job_id == job_id))
        return {key: status for key, status in rows}


def test_a_retry_runs_exactly_the_items_that_failed_and_the_jobs_name_each_other(
    client: httpx.Client, s3: Any, sessions: Any, service_env: dict[str, str], api_url: str
) -> None:
    prefix = "retry-transient/"
    keys = [f"{prefix}img-{i:04d}.jpg" for i in range(ITEMS)]
    late = set(keys[7 :: ITEMS // MISSING][:MISSING])  # spread over the job's chunks
    assert len(late) == MISSING
    put_objects(s3, [k for k in keys if k not in late], seed=40)
    inputs = [{"uri": f"s3://{SOURCE_BUCKET}/{key}"} for key in keys]

    submitted = client.post("/v1/jobs", json={"model": "phash", "inputs": inputs})
    assert submitted.status_code == 202, submitted.text
    first = wait_closed(client, submitted.json()["id"], timeout=600)
    assert (first["counts"]["succeeded"], first["counts"]["failed"]) == (ITEMS - MISSING, MISSING)

    put_objects(s3, sorted(late), seed=41)  # the cause passes: the objects arrive
    retried = client.post(f"/v1/jobs/{first['id']}/retry", headers={"Idempotency-Key": "r-40"})
    assert retried.status_code == 201, retried.text
    second = retried.json()
    assert second["retry_of"] == first["id"] and second["counts"]["total"] == MISSING
    assert second["model"] == first["model"]

    done = wait_closed(client, second["id"], timeout=600)
    assert (done["counts"]["succeeded"], done["counts"]["failed"]) == (MISSING, 0)
    ran = item_keys(sessions, second["id"])
    assert set(ran) == {f"s3://{SOURCE_BUCKET}/{key}" for key in late}
    assert set(ran.values()) == {"succeeded"}
    assert client.get(f"/v1/jobs/{first['id']}").json()["retries"] == [second["id"]]

    again = client.post(f"/v1/jobs/{first['id']}/retry", headers={"Idempotency-Key": "r-40"})
    assert again.status_code == 200 and again.json()["id"] == second["id"]
    nothing = client.post(f"/v1/jobs/{second['id']}/retry")
    assert nothing.status_code == 409
    assert (
        nothing.json()["detail"] == f"Job {second['id']} has no failed items to retry "
        "(add include_cancelled for cancelled ones)."
    )

    # `kiln retry` (the CLI, through the API): another replay of the same failures, followed
    env = {**service_env, "KILN_API_URL": api_url, "KILN_API_KEY": _key(sessions, "acme")}
    cli = run_kiln(env, "retry", first["id"][:8], "--wait")
    assert cli.returncode == 0, cli.stdout + cli.stderr
    third = cli.stdout.split()[1]
    assert f"retrying {first['id']}" in " ".join(cli.stdout.split())
    assert client.get(f"/v1/jobs/{first['id']}").json()["retries"] == [second["id"], third]
    assert client.get(f"/v1/jobs/{third}").json()["counts"]["succeeded"] == MISSING


BROKEN = b"\xff\xd8 not really a JPEG"


def test_a_pipeline_runs_retry_takes_its_objects_without_listing_and_counts_as_a_run(
    client: httpx.Client, s3: Any, sessions: Any
) -> None:
    prefix, name = "retry-pipeline/", "retry-pipeline"
    good = [f"{prefix}ok-{i}.jpg" for i in range(10)]
    broken = [f"{prefix}bad-{i}.jpg" for i in range(3)]
    put_objects(s3, good, seed=42)
    for key in broken:
        s3.put_object(Bucket=SOURCE_BUCKET, Key=key, Body=BROKEN)
    body = {"model": "phash", "source": {"s3": f"s3://{SOURCE_BUCKET}/{prefix}"}, "pipeline": name}
    started = client.post("/v1/jobs", json=body)
    assert started.status_code == 202, started.text
    night = wait_closed(client, started.json()["id"], timeout=300)
    assert (night["counts"]["succeeded"], night["counts"]["failed"]) == (10, 3)

    put_objects(s3, broken, seed=43)  # fixed: good JPEGs now
    retried = client.post(f"/v1/jobs/{night['id']}/retry")
    assert retried.status_code == 201, retried.text
    again = wait_closed(client, retried.json()["id"], timeout=300)
    assert (again["counts"]["total"], again["counts"]["succeeded"]) == (3, 3)
    assert again["pipeline"] == name and again["retry_of"] == night["id"]
    assert set(item_keys(sessions, again["id"])) == set(broken)  # the objects' own keys
    with sessions() as session:
        sources = session.scalars(select(Item.source).where(Item.job_id == again["id"])).all()
    assert sorted(sources) == sorted(f"s3://{SOURCE_BUCKET}/{key}" for key in broken)

    # The next night: the ten untouched objects are skipped; the three rewritten ones changed
    # ETag since the listing their retry replayed, so they run once more.
    started = client.post("/v1/jobs", json=body)
    next_night = wait_closed(client, started.json()["id"], timeout=300)
    assert (next_night["counts"]["skipped"], next_night["counts"]["total"]) == (10, 3)
