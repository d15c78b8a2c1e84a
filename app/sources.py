"""Where an item's bytes are, as `items.source` records it.

`store:<key>`: an upload, in Kiln's own object store; `s3://bucket/key`: any bucket the tenant
may read; `file:///path`: this machine's files (`kiln run` only). Written by the submit path,
read by the workers' fetcher: both go through these functions.
"""

from __future__ import annotations

from urllib.parse import urlparse

from kiln.app.core.errors import InputError

STORE = "store:"
# What a local file's name says it is (`kiln run` collects folders by them; a video is still
# known by its bytes, so a name that says neither is looked into).
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".gif", ".bmp", ".webp", ".tif", ".tiff"}
VIDEO_SUFFIXES = {".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".ts", ".mts", ".m2ts", ".mpg"}


def in_store(key: str) -> str:
    """The source of an object in Kiln's own store."""
    return f"{STORE}{key}"


def store_key(source: str) -> str | None:
    """The object key when `source` is in Kiln's own store, else None."""
    return source.removeprefix(STORE) if source.startswith(STORE) else None


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """`s3://bucket/key` → (bucket, key). Here, not in kiln.app.storage.s3: checking a URI
    needs no boto3, and a job with no S3 input never imports it."""
    parsed = urlparse(uri)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise InputError(f"{uri!r} is not an S3 URI like s3://bucket/key.")
    return parsed.netloc, parsed.path.lstrip("/")
