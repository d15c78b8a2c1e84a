"""A job's `output` (an `s3://bucket/prefix` the user names for its results), checked before a
bulk job or a schedule is recorded, so an output that cannot work is refused with a sentence
instead of costing a night of inference whose results cannot be stored.

The order matters: the URI's form first, then the tenant's allow-list (Kiln's credentials never
touch a bucket the tenant was not given), then S3 itself — one small object written and
deleted under the prefix. Nothing cheaper proves that Kiln may write there: HEAD Bucket needs
only s3:ListBucket and says nothing of s3:PutObject, and reading the bucket's policy or ACL
needs rights Kiln should not have (and a policy can deny by prefix). The probe costs two
requests per submission, no more than a schedule's or a bulk job's first shard.
"""

from __future__ import annotations

import logging

from sqlalchemy.orm import Session

from kiln.app.core.errors import InputError, KilnError
from kiln.app.sources import parse_s3_uri
from kiln.app.storage.base import S3Factory
from kiln.app.tenants import tenants

log = logging.getLogger(__name__)

# One fixed name, not one per job: where Kiln may write but not delete, at most this one
# empty object stays behind, overwritten by the next check.
PROBE_NAME = ".kiln-write-check"


def output_prefix(output: str) -> str:
    """The key prefix of an `s3://bucket/prefix` output, refused with a sentence when its
    folders could not make object keys (an empty, `.` or `..` part)."""
    folders = parse_s3_uri(output)[1].strip("/")
    parts = folders.split("/") if folders else []
    if any(part in ("", ".", "..") for part in parts):
        raise InputError(
            f"The output {output} has an empty, '.' or '..' folder; name a prefix like "
            "s3://bucket/results/."
        )
    return "/".join(parts)


def probe_key(prefix: str) -> str:
    """Where the check writes, under the output's prefix (results go to `<prefix>/<job>/`)."""
    return f"{prefix}/{PROBE_NAME}" if prefix else PROBE_NAME


def check_output(session: Session, tenant: str, output: str, s3: S3Factory) -> None:
    """Refuse an output the job could not write: not an S3 prefix or a bad one (422), a bucket
    the tenant may not name (403), or one that is missing, refuses Kiln's credentials or is no
    bucket name (422, `OutputError`); S3 unreachable is a `TransientError` (503)."""
    from kiln.app.storage.s3 import S3Store  # boto3: only for a job that names an output

    prefix = output_prefix(output)
    tenants.check_buckets(session, tenant, [output], verb="write to")
    bucket, _ = parse_s3_uri(output)
    store = S3Store(s3(), bucket, output=output)
    key = probe_key(prefix)
    store.put(key, b"", "text/plain")  # raises OutputError (missing, refused) or transient
    try:
        store.delete(key)
    except KilnError as error:  # a write-only grant: the one empty marker stays
        log.info("the output check left %s behind: %s", store.describe(key), error)
