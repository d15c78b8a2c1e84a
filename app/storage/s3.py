"""S3 (or any S3-compatible endpoint) as an object store, through boto3."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    NoCredentialsError,
    ParamValidationError,
)

from kiln.app.core.errors import (
    InputError,
    NotFoundError,
    OutputError,
    SetupError,
    TransientError,
)
from kiln.app.sources import parse_s3_uri
from kiln.app.storage.base import NewObject, check_key

if TYPE_CHECKING:
    from kiln.app.storage.base import StoreSettings

PUT_CONCURRENCY = 8  # boto3 clients are thread-safe; S3 answers each PUT in its own time
_MISSING = {"NoSuchKey", "404", "NotFound"}
_DENIED = {"AccessDenied", "403", "AllAccessDisabled"}
_BAD_NAME = {"InvalidBucketName"}


def make_s3_client(settings: StoreSettings) -> Any:
    """A client with adaptive retries: throttling and 5xx back off inside botocore."""
    config = Config(
        retries={"max_attempts": 8, "mode": "adaptive"},
        max_pool_connections=32,
        signature_version="s3v4",  # else botocore presigns with SigV2, which newer regions refuse
    )
    return boto3.client(
        "s3",
        endpoint_url=settings.s3_endpoint_url,
        region_name=settings.s3_region,
        config=config,
    )


def _code(error: ClientError) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))


def translate(error: Exception, where: str) -> Exception:
    """Map boto errors onto Kiln's taxonomy, with a sentence naming the object. A bucket a
    user named that is missing or refused is the user's error (`InputError`); Kiln's own
    store says otherwise (`S3Store(own=True)`)."""
    if isinstance(error, ClientError):
        code = _code(error)
        if code == "NoSuchBucket":
            return InputError(f"The bucket of {where} does not exist.")
        if code in _MISSING:
            return NotFoundError(f"No object at {where}.")
        if code in _DENIED:
            return InputError(f"Access to {where} was refused ({code}).")
        if code in _BAD_NAME:
            return InputError(f"{where} does not name a valid bucket.")
        return TransientError(f"S3 error at {where}: {code or error}.")
    if isinstance(error, ParamValidationError):  # botocore refused the name before sending
        return InputError(f"{where} is not a valid S3 location.")
    return TransientError(f"Could not reach S3 for {where}: {error}.")


def output_error(
    error: Exception, bucket: str, output: str, verb: str = "write to"
) -> OutputError | None:
    """The sentence for a use of a job's `output` (`verb`: "write to", "read") that retrying
    cannot fix (the bucket is missing, refuses Kiln's credentials, or is no bucket name),
    naming the output as the user gave it; None for any other failure (throttling, 5xx, a
    network fault: transient)."""
    code = _code(error) if isinstance(error, ClientError) else ""
    if code == "NoSuchBucket":
        return OutputError(
            f"The output bucket '{bucket}' does not exist ({output}): create it or name "
            "another --output."
        )
    if code in _DENIED:
        return OutputError(
            f"Kiln may not {verb} the output bucket '{bucket}' ({output}): S3 refused its "
            f"credentials ({code}); grant them access there or name another --output."
        )
    if code in _BAD_NAME or isinstance(error, ParamValidationError):
        return OutputError(
            f"'{bucket}' is not a valid bucket name ({output}): name another --output."
        )
    return None


def read_object(client: Any, uri: str, max_bytes: int) -> bytes:
    """The bytes at an s3:// URI, refusing (before downloading) objects over `max_bytes`."""
    bucket, key = parse_s3_uri(uri)
    try:
        response = client.get_object(Bucket=bucket, Key=key)
        size = int(response.get("ContentLength", 0))
        if size > max_bytes:
            response["Body"].close()
            raise InputError(f"{uri} is {size:,} bytes, over the {max_bytes:,} limit.")
        return bytes(response["Body"].read())
    except (ClientError, BotoCoreError) as error:
        raise translate(error, uri) from error


def missing_bucket(bucket: str) -> SetupError:
    return SetupError(
        f"Kiln's storage bucket {bucket} does not exist (KILN_STORAGE_URL); "
        "create it with `kiln storage check --create`."
    )


class S3Store:
    """A bucket (and a prefix in it). `own` marks Kiln's own store (`KILN_STORAGE_URL`):
    there a missing or refused bucket is the service's misconfiguration (`SetupError`, 503),
    not the user's error it is in a bucket the user named. `output`: the job's `output` as the
    user named it, when this is that bucket: a write it refuses for good raises `OutputError`
    naming it (reads keep their own sentences)."""

    def __init__(
        self,
        client: Any,
        bucket: str,
        prefix: str = "",
        *,
        own: bool = False,
        output: str | None = None,
    ) -> None:
        self.client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.own = own
        self.output = output

    @classmethod
    def from_url(cls, url: str, client: Any, *, own: bool = False) -> S3Store:
        bucket, prefix = parse_s3_uri(url)
        return cls(client, bucket, prefix, own=own)

    def _translate(self, error: Exception, where: str) -> Exception:
        if self.own and isinstance(error, NoCredentialsError):
            return SetupError(
                f"Kiln has no S3 credentials for its storage bucket {self.bucket}: set "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or another way boto3 reads)."
            )
        if self.own and isinstance(error, ClientError):
            code = _code(error)
            if code == "NoSuchBucket":
                return missing_bucket(self.bucket)
            if code in _DENIED:
                return SetupError(
                    f"Kiln may not use its storage bucket {self.bucket} ({code}): check its "
                    "S3 credentials and KILN_STORAGE_URL."
                )
        return translate(error, where)

    def _written(self, error: Exception, where: str, verb: str = "write to") -> Exception:
        """A failure to use the bucket: an output's own sentence where retrying cannot fix it
        (`verb` says how it was used), else what `_translate` says."""
        if self.output is not None:
            refused = output_error(error, self.bucket, self.output, verb)
            if refused is not None:
                return refused
        return self._translate(error, where)

    def _key(self, key: str) -> str:
        return self.prefix + check_key(key)

    def put(self, key: str, data: bytes, content_type: str | None = None) -> None:
        extra = {"ContentType": content_type} if content_type else {}
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, **extra)
        except (ClientError, BotoCoreError) as error:
            raise self._written(error, self.describe(key)) from error

    def put_new(self, objects: Sequence[NewObject]) -> None:
        """Side by side: an upload's objects go up PUT_CONCURRENCY at a time."""
        if len(objects) <= 1:
            for key, data, content_type in objects:
                self.put(key, data, content_type)
            return
        with ThreadPoolExecutor(min(PUT_CONCURRENCY, len(objects))) as pool:
            list(pool.map(lambda o: self.put(*o), objects))

    def get(self, key: str) -> bytes:
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            return bytes(response["Body"].read())
        except (ClientError, BotoCoreError) as error:
            raise self._translate(error, self.describe(key)) from error

    def exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as error:
            if isinstance(translate(error, key), NotFoundError):
                return False
            raise self._translate(error, self.describe(key)) from error
        return True

    def list(self, prefix: str) -> Iterator[str]:
        paginator = self.client.get_paginator("list_objects_v2")
        pages = paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix)
        try:
            for page in pages:
                for entry in page.get("Contents", []):
                    yield entry["Key"][len(self.prefix) :]
        except (ClientError, BotoCoreError) as error:  # an output's listing: its shards
            raise self._written(error, self.describe(prefix), "read") from error

    def delete(self, key: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except (ClientError, BotoCoreError) as error:
            raise self._written(error, self.describe(key)) from error

    def bucket_exists(self) -> bool:
        """Whether the bucket is there (HEAD); a refusal or an unreachable S3 raises."""
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as error:
            if _code(error) in _MISSING or _code(error) == "NoSuchBucket":
                return False
            raise self._translate(error, f"s3://{self.bucket}") from error
        except BotoCoreError as error:
            raise self._translate(error, f"s3://{self.bucket}") from error
        return True

    def ping(self) -> None:
        if not self.bucket_exists():
            if self.own:
                raise missing_bucket(self.bucket)
            raise InputError(f"The bucket s3://{self.bucket} does not exist.")

    def create_bucket(self) -> None:
        """Create the bucket (in the client's region)."""
        region = self.client.meta.region_name
        extra: dict[str, Any] = {}
        if region and region != "us-east-1":  # us-east-1 takes no LocationConstraint
            extra["CreateBucketConfiguration"] = {"LocationConstraint": region}
        try:
            self.client.create_bucket(Bucket=self.bucket, **extra)
        except ClientError as error:
            if _code(error) == "BucketAlreadyExists":  # the name is another account's
                raise SetupError(
                    f"The bucket name {self.bucket} is taken by another S3 account; "
                    "name another in KILN_STORAGE_URL."
                ) from error
            raise self._translate(error, f"s3://{self.bucket}") from error
        except BotoCoreError as error:
            raise self._translate(error, f"s3://{self.bucket}") from error

    def describe(self, key: str) -> str:
        return f"s3://{self.bucket}/{self.prefix}{key}"

    def presign(self, key: str, seconds: int) -> str:
        # Signed locally with the client's credentials (SigV4): no request is made, and S3
        # refuses the URL once `seconds` have passed or if any part of it is changed.
        try:
            url = self.client.generate_presigned_url(
                "get_object",
                Params={"Bucket": self.bucket, "Key": self._key(key)},
                ExpiresIn=seconds,
            )
        except (ClientError, BotoCoreError) as error:
            raise self._translate(error, self.describe(key)) from error
        return str(url)
