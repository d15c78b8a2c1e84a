"""A night's run as a cron wrapper sees it, on the real stack (moto S3, Postgres, Redis, `kiln
api` and `kiln worker`), through `kiln bulk … --watch`:

- a rerun where only known-broken objects are left to do exits 0 and says "nothing new; N known
  failures kept", without processing them again; `--retry-failed` processes them again;
- a prefix (or filters) that matched no object exits 1 with a sentence;
- `--include '*.jpg'` takes a camera's `IMG_0001.JPG`, and the job says how many objects the
  filters left out.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from devstack.images import photo
from kiln.app.db.models import Item
from tests.integration.test_bulk import put_objects
from tests.stack import SOURCE_BUCKET, _key, run_kiln

BROKEN = b"\xff\xd8 not really a JPEG"


@pytest.fixture
def cli_env(service_env: dict[str, str], api_url: str, client: httpx.Client, sessions: Any) -> Any:
    """The CLI's environment, as a tenant of its own (a worker runs: `client` starts it)."""
    return {**service_env, "KILN_API_URL": api_url, "KILN_API_KEY": _key(sessions, "nightly")}


def bulk(env: dict[str, str], prefix: str, *flags: str) -> Any:
    """`kiln bulk s3://…/prefix --model phash … --watch`: the finished process."""
    uri = f"s3://{SOURCE_BUCKET}/{prefix}"
    return run_kiln(env, "bulk", uri, "--model", "phash", *flags, "--watch", timeout=600)


def job_of(done: Any, env: dict[str, str]) -> dict[str, Any]:
    """The job `kiln bulk` started (its id is the second word it prints)."""
    job_id = done.stdout.split()[1]
    headers = {"Authorization": f"Bearer {env['KILN_API_KEY']}"}
    answer = httpx.get(f"{env['KILN_API_URL']}/v1/jobs/{job_id}", headers=headers, timeout=30)
    assert answer.status_code == 200, answer.text
    job: dict[str, Any] = answer.json()
    return job


def said(done: Any) -> str:
    """What the command printed, on either stream, one space between words."""
    return " ".join((done.stdout + done.stderr).split())


def items_of(sessions: Any, job_id: str) -> dict[str, int]:
    """The job's items, by key: how many times each was leased."""
    with sessions() as session:
        rows = session.execute(select(Item.key, Item.attempts).where(Item.job_id == job_id))
        return {key: attempts for key, attempts in rows}


def test_a_night_with_only_known_failures_left_exits_0_and_retries_them_when_asked(
    cli_env: dict[str, str], s3: Any, sessions: Any
) -> None:
    prefix = "nightly-known/"
    good = [f"{prefix}ok-{i}.jpg" for i in range(3)]
    broken = [f"{prefix}broken-{i}.jpg" for i in range(2)]
    put_objects(s3, good, seed=7)
    for key in broken:
        s3.put_object(Bucket=SOURCE_BUCKET, Key=key, Body=BROKEN)
    flags = ("--name", "nightly-known", "--include", "*.jpg")

    first = bulk(cli_env, prefix, *flags)
    assert first.returncode == 0, said(first)  # some succeeded: the failures are in the results
    c = job_of(first, cli_env)["counts"]
    assert (c["total"], c["succeeded"], c["failed"], c["known_failed"]) == (5, 3, 2, 0)

    for key in good:  # the good ones leave; only the known-broken objects are left to do
        s3.delete_object(Bucket=SOURCE_BUCKET, Key=key)
    again = bulk(cli_env, prefix, *flags)
    assert again.returncode == 0, said(again)
    assert "nothing new; 2 known failures kept" in said(again), said(again)
    job = job_of(again, cli_env)
    c = job["counts"]
    assert job["status"] == "completed"
    assert (c["total"], c["failed"], c["known_failed"], c["deleted"]) == (0, 0, 2, 3)
    assert items_of(sessions, job["id"]) == {}  # nothing processed again

    retried = bulk(cli_env, prefix, *flags, "--retry-failed")
    job = job_of(retried, cli_env)
    c = job["counts"]
    assert (c["total"], c["failed"], c["known_failed"]) == (2, 2, 0)
    assert items_of(sessions, job["id"]) == dict.fromkeys(broken, 1)  # each tried once more
    # …and, every item that ran having failed, the README's promise holds: exit 1 and why
    assert retried.returncode == 1, said(retried)
    assert "no item succeeded (2 failed)" in said(retried)

    s3.put_object(Bucket=SOURCE_BUCKET, Key=broken[0], Body=photo(77, (48, 36)))  # fixed
    fixed = bulk(cli_env, prefix, *flags)
    assert fixed.returncode == 0, said(fixed)
    c = job_of(fixed, cli_env)["counts"]
    assert (c["total"], c["succeeded"], c["known_failed"]) == (1, 1, 1)
    assert "1 known failure kept" in said(fixed)  # the summary line


def test_a_prefix_that_matches_no_object_exits_1_with_a_sentence(
    cli_env: dict[str, str], s3: Any
) -> None:
    empty = bulk(cli_env, "nightly-no-such-prefix/")
    assert empty.returncode == 1, said(empty)
    assert (
        f"s3://{SOURCE_BUCKET}/nightly-no-such-prefix/ matched no object: nothing is listed "
        "under that prefix."
    ) in said(empty)
    assert job_of(empty, cli_env)["counts"]["total"] == 0

    s3.put_object(Bucket=SOURCE_BUCKET, Key="nightly-pngs/a.png", Body=b"png")
    s3.put_object(Bucket=SOURCE_BUCKET, Key="nightly-pngs/b.png", Body=b"png")
    filtered = bulk(cli_env, "nightly-pngs/", "--include", "*.jpg", "--include", "*.jpeg")
    assert filtered.returncode == 1, said(filtered)
    assert (
        f"s3://{SOURCE_BUCKET}/nightly-pngs/ with --include '*.jpg' --include '*.jpeg' matched "
        "no object (2 listed, 2 left out by the filters)."
    ) in said(filtered)


def test_a_lower_case_glob_takes_a_camera_s_upper_case_names(
    cli_env: dict[str, str], s3: Any, sessions: Any
) -> None:
    prefix = "nightly-camera/"
    for key, body in (
        ("IMG_0001.JPG", photo(1, (48, 36))),
        ("img_0002.jpg", photo(2, (48, 36))),
        ("notes.txt", b"not a photo"),
        ("IMG_0003.HEIC", b"not taken"),
    ):
        s3.put_object(Bucket=SOURCE_BUCKET, Key=prefix + key, Body=body)

    done = bulk(cli_env, prefix, "--include", "*.jpg")
    assert done.returncode == 0, said(done)
    job = job_of(done, cli_env)
    assert (job["counts"]["succeeded"], job["counts"]["excluded"]) == (2, 2)
    assert set(items_of(sessions, job["id"])) == {f"{prefix}IMG_0001.JPG", f"{prefix}img_0002.jpg"}
    assert "2 left out by the filters" in said(done)

    strict = bulk(cli_env, prefix, "--include", "*.jpg", "--case-sensitive")
    job = job_of(strict, cli_env)
    assert (job["counts"]["total"], job["counts"]["excluded"]) == (1, 3)
    assert job["source"]["case_sensitive"] is True
    with sessions() as session:
        count = session.scalar(select(func.count()).where(Item.job_id == job["id"]))
    assert count == 1
