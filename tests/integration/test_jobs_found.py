"""Finding a job again, on the real stack (Postgres, Redis, moto S3, `kiln api`, `kiln worker`,
`kiln beat`): `kiln jobs` and its filters, the eight characters the CLI and the console show
accepted wherever an id is (`kiln status`, `GET /v1/jobs/{prefix}`, its items and results), an
ambiguous prefix answered with how many jobs match, and the job's pipeline, schedule, output and
options in its answer. A schedule added with `--cron @daily` starts the run `kiln beat` makes."""

from __future__ import annotations

import io
import re
import secrets
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pyarrow.parquet as pq
import pytest
from sqlalchemy import update

from devstack.images import photo
from devstack.jobs import wait_closed
from devstack.services import Process, kiln_command, wait_for
from devstack.services import service_env as process_env
from kiln.app.db.models import Job, Schedule, utcnow
from kiln.app.tenants.auth import create_key
from tests.stack import BUCKET, RUNNING, SOURCE_BUCKET, run_kiln


def flat(text: str) -> str:
    return " ".join(text.split())


class Tenant:
    """A tenant of this test's own (so `kiln jobs` lists only its jobs): an HTTP client and the
    CLI's environment, both with its key."""

    def __init__(self, name: str, api_url: str, service_env: dict[str, str], key: str) -> None:
        self.name = name
        self.http = httpx.Client(
            base_url=api_url, headers={"Authorization": f"Bearer {key}"}, timeout=60
        )
        # COLUMNS: rich draws the table this wide when not on a terminal
        self.env = {**service_env, "KILN_API_URL": api_url, "KILN_API_KEY": key, "COLUMNS": "200"}

    def kiln(self, *args: str) -> Any:
        return run_kiln(self.env, *args)

    def ids(self, *filters: str) -> list[str]:
        listed = self.kiln("jobs", "-q", *filters)
        assert listed.returncode == 0, listed.stderr
        return listed.stdout.split()


@pytest.fixture
def tenant(
    api_url: str, worker: Process, service_env: dict[str, str], sessions: Any
) -> Iterator[Tenant]:
    name = f"finder-{secrets.token_hex(3)}"
    with sessions() as session:
        key = create_key(session, name, (BUCKET, SOURCE_BUCKET)).secret
    own = Tenant(name, api_url, service_env, key)
    try:
        yield own
    finally:
        own.http.close()


def start_beat(service_env: dict[str, str], log_dir: Path) -> Process:
    """`kiln beat`, ticking the schedules every second (the shipped tick is 20 s)."""
    env = {**service_env, "KILN_SCHEDULE_TICK_S": "1"}
    beat = Process("finder-beat", kiln_command("beat"), process_env(env), log_dir)
    RUNNING["finder-beat"] = beat
    return beat


def scheduled_run(sessions: Any, tenant: Tenant, name: str, log_dir: Path) -> str:
    """Make the schedule due now and let `kiln beat` start its run; the run's job id."""
    with sessions() as session:
        session.execute(
            update(Schedule)
            .where(Schedule.name == name)
            .values(next_run_at=utcnow() - timedelta(minutes=1))
        )
        session.commit()
    beat = start_beat(tenant.env, log_dir)
    try:
        wait_for(lambda: last_job(sessions, name) is not None, 60, "the scheduled run")
    finally:
        RUNNING.pop("finder-beat")
        beat.stop()
    found = last_job(sessions, name)
    assert found is not None
    return found


def last_job(sessions: Any, name: str) -> str | None:
    with sessions() as session:
        schedule = session.query(Schedule).filter(Schedule.name == name).one()
        return schedule.last_job_id


def test_kiln_jobs_lists_filters_and_finds_a_job_by_its_first_eight_characters(
    tenant: Tenant, s3: Any, sessions: Any, log_dir: Path, tmp_path: Path
) -> None:
    tag = secrets.token_hex(3)
    prefix, pipeline, schedule = f"found/{tag}/", f"found-{tag}", f"daily-{tag}"
    source = f"s3://{SOURCE_BUCKET}/{prefix}"
    for i in range(3):
        s3.put_object(Bucket=SOURCE_BUCKET, Key=f"{prefix}img-{i}.jpg", Body=photo(900 + i))

    # a pipeline's run, with an output of its own and an option
    bulk = tenant.http.post(
        "/v1/jobs",
        json={
            "model": "phash",
            "source": {"s3": source, "include": ["*.jpg"]},
            "pipeline": pipeline,
            "output": f"s3://{BUCKET}/found-out/{tag}/",
            "options": {"max_distance": 6},
        },
    )
    assert bulk.status_code == 202, bulk.text
    bulk_id = bulk.json()["id"]
    assert wait_closed(tenant.http, bulk_id, timeout=180)["status"] == "completed"
    # an upload, started by no pipeline and no schedule
    upload = tenant.http.post(
        "/v1/jobs", data={"model": "phash"}, files=[("files", ("a.jpg", photo(7)))]
    )
    assert upload.status_code == 202, upload.text
    upload_id = upload.json()["id"]
    assert wait_closed(tenant.http, upload_id)["status"] == "completed"

    # a schedule, by the shorthand a new user types; a 4-field cron says what one is
    four = tenant.kiln(
        "schedule", "add", f"bad-{tag}", "--cron", "0 2 * *", "--source", source, "--model", "phash"
    )
    assert four.returncode == 1
    assert "'0 2 * *' has 4 fields, not five. A cron expression is five fields" in flat(four.stderr)
    added = tenant.kiln(
        "schedule", "add", schedule, "--cron", "@daily", "--source", source, "--model", "phash"
    )
    assert added.returncode == 0, added.stderr
    assert re.search(rf"schedule {schedule}: next run \S+T00:00:00", added.stdout), added.stdout
    scheduled_id = scheduled_run(sessions, tenant, schedule, log_dir)
    assert wait_closed(tenant.http, scheduled_id, timeout=180)["status"] == "completed"

    # kiln jobs: newest first, each id as the 8 characters that find it, and who started it
    listed = tenant.kiln("jobs")
    assert listed.returncode == 0, listed.stderr
    rows = [line for line in listed.stdout.splitlines() if re.search(r"[0-9a-f]{8}", line)]
    assert [row.split()[1] for row in rows] == [scheduled_id[:8], upload_id[:8], bulk_id[:8]]
    assert f"{schedule} (schedule)" in rows[0] and "completed" in rows[0]
    assert "3/3" in rows[2] and pipeline in rows[2] and "phash" in rows[2]
    assert tenant.ids() == [scheduled_id, upload_id, bulk_id]
    assert tenant.ids("--pipeline", pipeline) == [bulk_id]
    assert tenant.ids("--schedule", schedule) == [scheduled_id]
    assert tenant.ids("--pipeline", schedule) == [scheduled_id]  # a schedule's runs: its pipeline
    assert tenant.ids("--status", "completed", "--limit", "2") == [scheduled_id, upload_id]
    none = tenant.kiln("jobs", "--status", "failed")
    assert none.returncode == 0 and none.stdout == "" and "No jobs match." in none.stderr

    # the job's answer, asked by the 8 characters: who started it, where and how it writes
    answer = tenant.http.get(f"/v1/jobs/{bulk_id[:8]}")
    assert answer.status_code == 200, answer.text
    job = answer.json()
    assert job["id"] == bulk_id
    assert (job["pipeline"], job["schedule"]) == (pipeline, None)
    assert job["output"] == f"s3://{BUCKET}/found-out/{tag}/"
    assert job["options"] == {"max_distance": 6}
    assert job["source"] == {
        "s3": source,
        "include": ["*.jpg"],
        "exclude": [],
        "case_sensitive": False,
    }
    run = tenant.http.get(f"/v1/jobs/{scheduled_id[:8]}").json()
    assert (run["pipeline"], run["schedule"]) == (schedule, schedule)
    plain = tenant.http.get(f"/v1/jobs/{upload_id[:8]}").json()
    assert (plain["pipeline"], plain["schedule"], plain["output"], plain["options"]) == (
        None, None, None, {},
    )  # fmt: skip
    listed_page = tenant.http.get("/v1/jobs", params={"schedule": schedule}).json()
    assert [j["id"] for j in listed_page["jobs"]] == [scheduled_id]
    assert listed_page["jobs"][0]["schedule"] == schedule

    # every route and command that takes an id takes the 8 characters
    items = tenant.http.get(f"/v1/jobs/{bulk_id[:8]}/items").json()["items"]
    assert sorted(i["key"] for i in items) == [f"{prefix}img-{i}.jpg" for i in range(3)]
    results = tenant.http.get(f"/v1/jobs/{bulk_id[:8]}/results")
    assert results.status_code == 200
    assert f'filename="{bulk_id}.parquet"' in results.headers["content-disposition"]
    assert pq.read_table(io.BytesIO(results.content)).num_rows == 3
    status = tenant.kiln("status", upload_id[:8])
    assert status.returncode == 0, status.stderr
    assert flat(status.stdout).startswith(f"job {upload_id} completed: 1 succeeded")
    out = tmp_path / "r.parquet"
    fetched = tenant.kiln("results", scheduled_id[:8], "-o", str(out))
    assert fetched.returncode == 0, fetched.stderr
    assert pq.read_table(out).num_rows == 3
    done = tenant.kiln("cancel", upload_id[:8])
    assert done.returncode == 1
    assert f"Job {upload_id} is already completed" in flat(done.stderr)


def test_an_ambiguous_prefix_says_how_many_jobs_match_and_an_unknown_one_is_404(
    tenant: Tenant, other_client: httpx.Client, sessions: Any
) -> None:
    shared = secrets.token_hex(4)  # two jobs whose ids share their first 8 characters
    ids = [f"{shared}-000{n}-4000-8000-000000000000" for n in range(2)]
    upload = tenant.http.post(
        "/v1/jobs", data={"model": "phash"}, files=[("files", ("a.jpg", photo(8)))]
    )
    assert upload.status_code == 202, upload.text
    with sessions() as session:  # on Postgres, through the (tenant, id) prefix index
        for job_id in ids:
            session.add(Job(id=job_id, tenant=tenant.name, model="phash", status="completed"))
        session.commit()

    answer = tenant.http.get(f"/v1/jobs/{shared}")
    assert answer.status_code == 422, answer.text
    assert answer.json()["detail"] == (
        f"2 of your jobs have an id starting with {shared} ({ids[0]}, {ids[1]}); give more of it."
    )
    assert tenant.http.get(f"/v1/jobs/{ids[1][:13]}").json()["id"] == ids[1]  # more of it
    status = tenant.kiln("status", shared)
    assert status.returncode == 1
    assert f"2 of your jobs have an id starting with {shared}" in flat(status.stderr)
    assert "(HTTP 422)" in flat(status.stderr)

    # unknown, or another tenant's (prefix or whole id): today's 404 sentence, never a 422
    for given in (shared, upload.json()["id"][:8], upload.json()["id"]):
        theirs = other_client.get(f"/v1/jobs/{given}")
        assert theirs.status_code == 404
        assert theirs.json()["detail"] == f"There is no job {given}."
    mistyped = tenant.http.get("/v1/jobs/zz99zz99")
    assert mistyped.status_code == 404
    assert mistyped.json()["detail"] == "There is no job zz99zz99."
    short = tenant.http.get(f"/v1/jobs/{shared[:3]}")
    assert short.status_code == 404
    assert short.json()["detail"] == (
        f"There is no job {shared[:3]}; name a job by its id or at least 4 of its first characters."
    )
