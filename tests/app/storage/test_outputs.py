"""A job's `output` checked before it is recorded (`app/jobs/outputs.py`), and the sentences a write
to an output says when retrying cannot fix it, against moto's in-process S3 and SQLite."""

from __future__ import annotations

import re
from typing import Any

import pytest
from botocore.exceptions import ClientError
from sqlalchemy.orm import Session

from kiln.app.core.errors import ForbiddenError, InputError, OutputError
from kiln.app.dispatch.stub import RecordingDispatcher
from kiln.app.jobs import outputs
from kiln.app.jobs.ingest import BulkRequest, Source, submit_bulk
from kiln.app.jobs.schedules import ScheduleRequest, add_schedule
from kiln.app.storage.s3 import S3Store, output_error
from kiln.app.tenants.tenants import allow_bucket
from tests.app.storage.conftest import BUCKET

MISSING = "no-such-results"
MISSING_SENTENCE = (
    f"The output bucket '{MISSING}' does not exist (s3://{MISSING}/detector/): create it or "
    "name another --output."
)


@pytest.mark.parametrize(
    ("output", "prefix"),
    [("s3://b", ""), ("s3://b/", ""), ("s3://b/detector/", "detector"), ("s3://b/a/b", "a/b")],
)
def test_an_output_prefix_is_its_folders(output: str, prefix: str) -> None:
    assert outputs.output_prefix(output) == prefix
    assert outputs.probe_key(prefix).endswith(outputs.PROBE_NAME)


@pytest.mark.parametrize("output", ["s3://b/a//c/", "s3://b/./x", "s3://b/x/../y"])
def test_an_output_whose_folders_make_no_keys_is_refused(output: str) -> None:
    with pytest.raises(InputError, match=re.escape("empty, '.' or '..' folder")):
        outputs.output_prefix(output)


def test_a_writable_output_passes_and_the_probe_leaves_nothing(session: Session, s3: Any) -> None:
    allow_bucket(session, "acme", BUCKET)
    outputs.check_output(session, "acme", f"s3://{BUCKET}/detector/", lambda: s3)
    assert s3.list_objects_v2(Bucket=BUCKET).get("KeyCount") == 0


def test_an_output_bucket_that_does_not_exist_is_named(session: Session, s3: Any) -> None:
    allow_bucket(session, "acme", MISSING)
    with pytest.raises(OutputError) as refused:
        outputs.check_output(session, "acme", f"s3://{MISSING}/detector/", lambda: s3)
    assert str(refused.value) == MISSING_SENTENCE


def test_an_output_the_tenant_may_not_name_is_refused_before_s3_is_asked(
    session: Session,
) -> None:
    def no_s3() -> Any:
        raise AssertionError("S3 was asked about a bucket the tenant may not name")

    with pytest.raises(ForbiddenError, match="'acme' may not write to bucket 'private'"):
        outputs.check_output(session, "acme", "s3://private/results/", no_s3)


def test_a_bulk_job_and_a_schedule_are_refused_at_submission(session: Session, s3: Any) -> None:
    allow_bucket(session, "acme", "photos")
    allow_bucket(session, "acme", MISSING)
    session.commit()
    dispatcher = RecordingDispatcher()
    output = f"s3://{MISSING}/detector/"
    request = BulkRequest("acme", "phash", Source("s3://photos/2026/"), output=output)
    with pytest.raises(OutputError, match="does not exist"):
        submit_bulk(session, dispatcher, request, s3=lambda: s3)
    assert dispatcher.ingests == []
    schedule = ScheduleRequest(
        "acme", "nightly", "0 2 * * *", Source("s3://photos/"), "phash", output=output
    )
    with pytest.raises(OutputError, match="does not exist"):
        add_schedule(session, schedule, s3=lambda: s3)
    s3.create_bucket(Bucket=MISSING)
    assert submit_bulk(session, dispatcher, request, s3=lambda: s3).created
    assert add_schedule(session, schedule, s3=lambda: s3).name == "nightly"


def test_writes_to_an_output_say_what_is_wrong_with_it(s3: Any) -> None:
    output = f"s3://{MISSING}/detector/"
    store = S3Store(s3, MISSING, output=output)
    with pytest.raises(OutputError) as refused:
        store.put("detector/job/part-000000.parquet", b"rows")
    assert str(refused.value) == MISSING_SENTENCE
    with pytest.raises(OutputError):  # a close lists the shards it wrote
        list(store.list("detector/job/"))
    bad = S3Store(s3, "Not_A+Bucket", output="s3://Not_A+Bucket/x/")
    with pytest.raises(OutputError, match="is not a valid bucket name"):
        bad.put("x/k", b"rows")
    plain = S3Store(s3, MISSING)  # not an output: today's sentence
    with pytest.raises(InputError, match="The bucket of s3://") as other:
        plain.put("k", b"rows")
    assert not isinstance(other.value, OutputError)


@pytest.mark.parametrize("code", ["AccessDenied", "403", "AllAccessDisabled"])
def test_a_refused_write_says_kiln_may_not_write(code: str) -> None:
    error = ClientError({"Error": {"Code": code, "Message": "no"}}, "PutObject")
    refused = output_error(error, "results", "s3://results/x/")
    assert refused is not None
    assert str(refused).startswith("Kiln may not write to the output bucket 'results'")
    assert f"({code})" in str(refused)


@pytest.mark.parametrize("code", ["SlowDown", "InternalError", "RequestTimeout"])
def test_a_fault_that_may_pass_is_no_output_error(code: str) -> None:
    error = ClientError({"Error": {"Code": code, "Message": "later"}}, "PutObject")
    assert output_error(error, "results", "s3://results/x/") is None
