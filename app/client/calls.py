"""The requests the clients make and how their answers are read, with no I/O: `Client` and
`AsyncClient` send the same `Call`s and read them the same way, so the two cannot drift."""

from __future__ import annotations

import json
import mimetypes
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeAlias

from kiln.app.api.schemas import JobOut, NotifyIn
from kiln.app.client.errors import ApiError

if TYPE_CHECKING:
    import pyarrow as pa

DEFAULT_API_URL = "http://127.0.0.1:8000"  # as app/core/config.py's `api_url`
DEFAULT_TIMEOUT_S = 60.0
MAX_JOBS_PAGE = 200  # the most jobs GET /v1/jobs answers at once
MAX_ITEMS_PAGE = 1000  # and items, GET /v1/jobs/{id}/items
MAX_SERVER_WAIT_S = 60.0  # GET /v1/jobs/{id}?wait= takes at most this
CLOSED = frozenset({"completed", "failed", "cancelled"})

# A file to upload: a path, bytes (named `input-N`), or a (name, bytes or binary file) pair.
FileInput: TypeAlias = str | os.PathLike[str] | bytes | tuple[str, bytes | IO[bytes]]
# A job, or its id (or its first 8 characters, or any unique prefix of 4 or more).
JobRef: TypeAlias = str | JobOut
# A completion webhook: a URL (every event), a dict {url, events}, or a NotifyIn.
Notify: TypeAlias = str | Mapping[str, Any] | NotifyIn


@dataclass(frozen=True)
class Call:
    """One HTTP request, as httpx's `request()` takes it."""

    method: str
    path: str
    params: dict[str, Any] | None = None
    json: Any = None
    data: dict[str, str] | None = None
    files: list[tuple[str, tuple[str, Any, str]]] | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def kwargs(self) -> dict[str, Any]:
        given = {
            "params": self.params,
            "json": self.json,
            "data": self.data,
            "files": self.files,
            "headers": self.headers or None,
        }
        return {name: value for name, value in given.items() if value is not None}


def connection(api_url: str | None, api_key: str | None) -> tuple[str, str]:
    """The API's URL and key: as given, else KILN_API_URL and KILN_API_KEY."""
    url = api_url or os.environ.get("KILN_API_URL") or DEFAULT_API_URL
    key = api_key or os.environ.get("KILN_API_KEY")
    if not key:
        raise ApiError(
            "Set KILN_API_KEY to a key from `kiln keys create --tenant NAME` (or pass api_key=...)."
        )
    return url.rstrip("/"), key


def job_id(job: JobRef) -> str:
    return job.id if isinstance(job, JobOut) else job


def notify_body(notify: Notify | None) -> dict[str, Any] | None:
    """A webhook as the API takes it (`NotifyIn`), checked here so a typo fails before sending."""
    if notify is None:
        return None
    if isinstance(notify, str):
        notify = NotifyIn(url=notify)
    elif not isinstance(notify, NotifyIn):
        notify = NotifyIn.model_validate(dict(notify))
    return notify.model_dump(mode="json")


@dataclass(frozen=True)
class Extras:
    """What every kind of job may add to its body besides its inputs."""

    options: Mapping[str, Any] | None = None
    video_fps: float | None = None
    idempotency_key: str | None = None
    notify: Notify | None = None
    expires_after: int | str | None = None

    def added_to(self, body: dict[str, Any]) -> dict[str, Any]:
        """`body` with those given (None and empty options left out: the API's defaults)."""
        extras = {
            "options": dict(self.options) if self.options else None,
            "video_fps": self.video_fps,
            "idempotency_key": self.idempotency_key,
            "notify": notify_body(self.notify),
            "expires_after": self.expires_after,
        }
        return {**body, **{name: value for name, value in extras.items() if value is not None}}


def submit_call(
    model: str,
    *,
    files: Sequence[FileInput] | None = None,
    uris: Iterable[str] | None = None,
    texts: Iterable[str] | None = None,
    extras: Extras = Extras(),
) -> Call:
    """POST /v1/jobs: files as a multipart upload, or URIs and texts as JSON `inputs`."""
    inputs = [{"uri": u} for u in uris or ()] + [{"text": t} for t in texts or ()]
    if files and inputs:
        raise ValueError("Send files in one job and URIs or texts in another.")
    if files:
        # A form's fields are text: the JSON ones (options, notify) go as JSON.
        fields = extras.added_to({"model": model})
        form = {k: v if isinstance(v, str) else json.dumps(v) for k, v in fields.items()}
        return Call("POST", "/v1/jobs", data=form, files=upload_parts(files))
    if not inputs:
        raise ValueError("Give files, uris or texts to submit.")
    return Call("POST", "/v1/jobs", json=extras.added_to({"model": model, "inputs": inputs}))


def upload_parts(
    files: Sequence[FileInput], field: str = "files"
) -> list[tuple[str, tuple[str, Any, str]]]:
    """Each file as a multipart part `field`: its name (the item's key), bytes, and type."""
    parts = []
    for n, given in enumerate(files, start=1):
        content: bytes | IO[bytes]
        if isinstance(given, bytes):
            name, content = f"input-{n}", given
        elif isinstance(given, tuple):
            name, content = given
        else:
            path = Path(given)
            name, content = path.name, path.read_bytes()
        kind = mimetypes.guess_type(name)[0] or "application/octet-stream"
        parts.append((field, (name, content, kind)))
    return parts


def bulk_call(
    model: str,
    source: str,
    *,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    case_sensitive: bool = False,
    pipeline: str | None = None,
    output: str | None = None,
    retry_failed: bool = False,
    extras: Extras = Extras(),
) -> Call:
    """POST /v1/jobs with a `source`: every object under an s3:// prefix the globs let through."""
    body: dict[str, Any] = {"model": model, "source": source_body(source, include, exclude)}
    if case_sensitive:
        body["source"]["case_sensitive"] = True
    for name, value in (("pipeline", pipeline), ("output", output)):
        if value is not None:
            body[name] = value
    if retry_failed:
        body["retry_failed"] = True
    return Call("POST", "/v1/jobs", json=extras.added_to(body))


def source_body(source: str, include: Sequence[str], exclude: Sequence[str]) -> dict[str, Any]:
    if isinstance(include, str) or isinstance(exclude, str):
        raise TypeError("include and exclude take a list of globs, e.g. ['*.jpg'].")
    return {"s3": source, "include": list(include), "exclude": list(exclude)}


def estimate_call(
    model: str,
    source: str,
    *,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    case_sensitive: bool = False,
    options: Mapping[str, Any] | None = None,
    video_fps: float | None = None,
) -> Call:
    """POST /v1/jobs/estimate: what a bulk job over the source would take; creates nothing."""
    body = bulk_call(
        model,
        source,
        include=include,
        exclude=exclude,
        case_sensitive=case_sensitive,
        extras=Extras(options=options, video_fps=video_fps),
    ).json
    return Call("POST", "/v1/jobs/estimate", json=body)


def retry_call(
    job: JobRef,
    *,
    include_cancelled: bool = False,
    model: str | None = None,
    options: Mapping[str, Any] | None = None,
    idempotency_key: str | None = None,
    notify: Notify | None = None,
) -> Call:
    """POST /v1/jobs/{id}/retry: a new job over the failed (and cancelled) items."""
    body: dict[str, Any] = {"include_cancelled": include_cancelled}
    if model is not None:
        body["model"] = model
    if options is not None:
        body["options"] = dict(options)
    if (hook := notify_body(notify)) is not None:
        body["notify"] = hook
    headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
    return Call("POST", f"/v1/jobs/{job_id(job)}/retry", json=body, headers=headers)


def wait_call(job: JobRef, seconds: float) -> Call:
    """GET /v1/jobs/{id}?wait=S: answers as soon as the job closes, or after S seconds."""
    wait = max(0.0, min(seconds, MAX_SERVER_WAIT_S))
    return Call("GET", f"/v1/jobs/{job_id(job)}", params={"wait": round(wait, 3)})


def pause_before_asking_again(
    step: float, retry_after: float | None, deadline: float | None, now: float
) -> float:
    """How long `wait` pauses after a 503, a 429 or no answer: its step, or as long as the API
    asked (`Retry-After`), but never past its deadline."""
    pause = max(step, retry_after or 0.0)
    return pause if deadline is None else max(0.0, min(pause, deadline - now))


def jobs_params(
    limit: int, after: str | None, status: str | None, pipeline: str | None, schedule: str | None
) -> dict[str, Any]:
    only = {"status": status, "pipeline": pipeline, "schedule": schedule, "after": after}
    return {"limit": limit, **{k: v for k, v in only.items() if v is not None}}


def search_call(
    job: JobRef | None,
    *,
    pipeline: str | None = None,
    image: str | os.PathLike[str] | None = None,
    text: str | None = None,
    key: str | None = None,
    k: int = 10,
) -> Call:
    """POST /v1/jobs/{id}/search (or a pipeline's): look-alikes of an image, a text or a key."""
    if (job is None) == (pipeline is None):
        raise ValueError("Search a job or a pipeline (one of them).")
    where = f"pipelines/{pipeline}" if job is None else f"jobs/{job_id(job)}"
    path = f"/v1/{where}/search"
    if image is not None:
        return Call("POST", path, data={"k": str(k)}, files=upload_parts([image], field="file"))
    return Call("POST", path, json={"text": text, "key": key, "k": k})


def shard_keys_of(manifest: Mapping[str, Any] | None) -> set[str] | None:
    """The shards a closed job's manifest names (None: no manifest yet, take what is listed)."""
    if manifest is None:
        return None
    return set(manifest.get("shards", []))


def parquet_table(data: bytes) -> pa.Table:
    """A Parquet file's bytes as a pyarrow Table (pyarrow imported only when results are read).
    Read from an Arrow buffer, not a Python file object: after a read through one (io.BytesIO)
    pyarrow's threads may still touch it as the interpreter exits, and a short script then
    aborts at its end ("terminate called without an active exception", apache/arrow#33975;
    measured here: 2 exits in 60 with io.BytesIO, none with the buffer)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pq.read_table(pa.BufferReader(data))


def parquet_row_groups(data: bytes) -> list[pa.Table]:
    """The Parquet file's row groups, each a Table: the API writes each shard as its own."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(pa.BufferReader(data))
    return [parquet.read_row_group(i) for i in range(parquet.num_row_groups)]
