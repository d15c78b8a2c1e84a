"""`kiln.AsyncClient`: Kiln's API from asyncio (httpx), call for call as `kiln.Client`."""

from __future__ import annotations

import asyncio
import inspect
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import httpx

from kiln.app.api.schemas import (
    DeliveryOut,
    EstimateOut,
    ItemOut,
    ItemsPage,
    JobOut,
    JobsPage,
    ResultUrlsOut,
    SearchOut,
)
from kiln.app.client import calls
from kiln.app.client.calls import Call, FileInput, JobRef, Notify
from kiln.app.client.errors import (
    ConflictError,
    ConnectionFailedError,
    JobTimeoutError,
    RateLimitedError,
    UnavailableError,
    error_for,
    unreachable,
)

if TYPE_CHECKING:
    import pyarrow as pa

GROUPS_RETRY_S = 60.0  # a closed job's groups answer 503 until its close steps have written them


class AsyncClient:
    """Kiln's API: submit jobs, follow them, read their items and results.

    `api_url` and `api_key` default to KILN_API_URL (else http://127.0.0.1:8000) and
    KILN_API_KEY. Every method raises `kiln.ApiError` (a subclass by status) with the API's
    sentence when it refuses. Use it as an async context manager, or await `aclose()`.

        async with kiln.AsyncClient() as client:
            job = await client.wait(await client.submit("phash", files=["cat.jpg"]))
    """

    def __init__(
        self,
        api_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = calls.DEFAULT_TIMEOUT_S,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        base_url, key = calls.connection(api_url, api_key)
        self.base_url = base_url
        self._http = httpx.AsyncClient(
            base_url=base_url,
            headers={"Authorization": f"Bearer {key}"},
            timeout=timeout,
            transport=transport,
        )
        # Presigned URLs carry their own signature: no API key goes to the object store.
        self._plain = httpx.AsyncClient(timeout=timeout, transport=transport)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()
        await self._plain.aclose()

    # -- any endpoint ---------------------------------------------------------------------------

    async def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """Any endpoint (`path` below the API's URL) with this client's key; an error answer
        raises its `ApiError`. `kwargs` as httpx's `request()` takes them."""
        try:
            response = await self._http.request(method, path, **kwargs)
        except httpx.HTTPError as error:
            raise unreachable(self.base_url, error) from None
        if response.is_error:
            raise error_for(response)
        return response

    async def _send(self, call: Call, **extra: Any) -> httpx.Response:
        return await self.request(call.method, call.path, **call.kwargs(), **extra)

    # -- submitting -----------------------------------------------------------------------------

    async def submit(
        self,
        model: str,
        *,
        files: Sequence[FileInput] | None = None,
        uris: Iterable[str] | None = None,
        texts: Iterable[str] | None = None,
        options: Mapping[str, Any] | None = None,
        video_fps: float | None = None,
        idempotency_key: str | None = None,
        notify: Notify | None = None,
        expires_after: int | str | None = None,
    ) -> JobOut:
        """Start a job of `model` over files (paths, bytes, or (name, bytes) pairs: uploaded),
        or over URIs (`s3://bucket/key`) and texts. The same `idempotency_key` again answers
        the job it made. `notify`: a webhook URL, or {"url", "events"}; `expires_after`:
        seconds or "7d" before its items and results are deleted."""
        call = calls.submit_call(
            model,
            files=files,
            uris=uris,
            texts=texts,
            extras=calls.Extras(options, video_fps, idempotency_key, notify, expires_after),
        )
        return JobOut.model_validate((await self._send(call)).json())

    async def bulk(
        self,
        model: str,
        source: str,
        *,
        include: Sequence[str] = (),
        exclude: Sequence[str] = (),
        case_sensitive: bool = False,
        pipeline: str | None = None,
        output: str | None = None,
        retry_failed: bool = False,
        options: Mapping[str, Any] | None = None,
        video_fps: float | None = None,
        idempotency_key: str | None = None,
        notify: Notify | None = None,
        expires_after: int | str | None = None,
    ) -> JobOut:
        """Start a bulk job over every object under `source` (an s3:// prefix) that the
        `include` globs take and the `exclude` ones leave; the workers list it page by page.
        `pipeline` names an incremental pipeline (a rerun processes only new or changed
        objects); `output` an s3:// prefix for the results."""
        call = calls.bulk_call(
            model,
            source,
            include=include,
            exclude=exclude,
            case_sensitive=case_sensitive,
            pipeline=pipeline,
            output=output,
            retry_failed=retry_failed,
            extras=calls.Extras(options, video_fps, idempotency_key, notify, expires_after),
        )
        return JobOut.model_validate((await self._send(call)).json())

    async def estimate(
        self,
        model: str,
        source: str,
        *,
        include: Sequence[str] = (),
        exclude: Sequence[str] = (),
        case_sensitive: bool = False,
        options: Mapping[str, Any] | None = None,
        video_fps: float | None = None,
    ) -> EstimateOut:
        """What `bulk()` over the same source would take: objects, bytes, images and videos,
        and the time at the fleet's measured rate. Creates no job."""
        call = calls.estimate_call(
            model,
            source,
            include=include,
            exclude=exclude,
            case_sensitive=case_sensitive,
            options=options,
            video_fps=video_fps,
        )
        return EstimateOut.model_validate((await self._send(call)).json())

    async def retry(
        self,
        job: JobRef,
        *,
        include_cancelled: bool = False,
        model: str | None = None,
        options: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
        notify: Notify | None = None,
    ) -> JobOut:
        """A new job over the job's failed items (and its cancelled ones if asked), with its
        model and options unless others are given; the two name each other (`retry_of`,
        `retries`). The same `idempotency_key` again answers the same new job."""
        call = calls.retry_call(
            job,
            include_cancelled=include_cancelled,
            model=model,
            options=options,
            idempotency_key=idempotency_key,
            notify=notify,
        )
        return JobOut.model_validate((await self._send(call)).json())

    # -- following ------------------------------------------------------------------------------

    async def job(self, job: JobRef) -> JobOut:
        """The job now: status, counts, timestamps, items/s and ETA."""
        answer = await self._send(Call("GET", f"/v1/jobs/{calls.job_id(job)}"))
        return JobOut.model_validate(answer.json())

    async def wait(
        self,
        job: JobRef,
        *,
        progress: Callable[[JobOut], object | Awaitable[object]] | None = None,
        timeout: float | None = None,
        poll_interval: float = 2.0,
    ) -> JobOut:
        """The job once it has closed (completed, failed or cancelled). The API answers as
        soon as it closes; until then `progress` (a function or a coroutine function) gets
        the job every `poll_interval` seconds.
        A 503, a 429 or a moment without the API (a restart) is waited out. JobTimeoutError after
        `timeout` seconds (None: no limit)."""
        if poll_interval <= 0:
            raise ValueError("poll_interval must be more than 0 seconds.")
        deadline = None if timeout is None else time.monotonic() + timeout
        current = job if isinstance(job, JobOut) else await self.job(job)
        if progress is not None and inspect.isawaitable(said := progress(current)):
            await said
        while current.status not in calls.CLOSED:
            left = poll_interval if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise JobTimeoutError(
                    f"Job {current.id} is still {current.status} after {timeout} s.", current
                )
            step = min(poll_interval, left)
            try:
                answer = await self._send(calls.wait_call(current, step), timeout=step + 30)
            except (UnavailableError, ConnectionFailedError, RateLimitedError) as error:
                # a restart, a busy database, a rate: ask again, as late as the API says
                await asyncio.sleep(
                    calls.pause_before_asking_again(
                        step, error.retry_after, deadline, time.monotonic()
                    )
                )
                continue
            current = JobOut.model_validate(answer.json())
            if progress is not None and inspect.isawaitable(said := progress(current)):
                await said
        return current

    async def jobs(
        self,
        *,
        status: str | None = None,
        pipeline: str | None = None,
        schedule: str | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[JobOut]:
        """Your jobs, newest first, fetched page by page as you iterate; only those of a
        `status`, a `pipeline` or a `schedule` when given; at most `limit` (None: all)."""
        after: str | None = None
        given = 0
        while limit is None or given < limit:
            size = calls.MAX_JOBS_PAGE if limit is None else min(limit - given, calls.MAX_JOBS_PAGE)
            params = calls.jobs_params(size, after, status, pipeline, schedule)
            answer = await self._send(Call("GET", "/v1/jobs", params=params))
            page = JobsPage.model_validate(answer.json())
            for found in page.jobs[: None if limit is None else limit - given]:
                yield found
            given += len(page.jobs)
            if page.next is None:
                return
            after = page.next

    async def items(
        self, job: JobRef, *, status: str | None = None, page_size: int = 100
    ) -> AsyncIterator[ItemOut]:
        """The job's items in submission order (only those of a `status`: `failed`, …),
        fetched `page_size` at a time as you iterate."""
        path = f"/v1/jobs/{calls.job_id(job)}/items"
        params: dict[str, Any] = {"limit": min(page_size, calls.MAX_ITEMS_PAGE)}
        if status is not None:
            params["status"] = status
        while True:
            answer = await self._send(Call("GET", path, params=params))
            page = ItemsPage.model_validate(answer.json())
            for item in page.items:
                yield item
            if page.next is None:
                return
            params["after"] = page.next

    async def cancel(self, job: JobRef) -> JobOut:
        """Cancel the job: items no batch has started end `cancelled`; results so far stay."""
        answer = await self._send(Call("POST", f"/v1/jobs/{calls.job_id(job)}/cancel"))
        return JobOut.model_validate(answer.json())

    # -- results --------------------------------------------------------------------------------

    async def results(self, job: JobRef) -> pa.Table:
        """Every result so far as one pyarrow Table (`key`, `status`, `error`, `duration_ms`
        and the model's columns); `.to_pandas()` on it when pandas is installed."""
        data = (await self._send(Call("GET", f"/v1/jobs/{calls.job_id(job)}/results"))).content
        return calls.parquet_table(data)

    async def result_urls(self, job: JobRef, expires: int = 900) -> ResultUrlsOut:
        """The job's manifest and shards as presigned GET URLs, valid `expires` seconds (S3
        storage only: 409 otherwise)."""
        path = f"/v1/jobs/{calls.job_id(job)}/results/urls"
        answer = await self._send(Call("GET", path, params={"expires": expires}))
        return ResultUrlsOut.model_validate(answer.json())

    async def iter_result_shards(
        self, job: JobRef, *, expires: int = 900
    ) -> AsyncIterator[pa.Table]:
        """The results shard by shard (one chunk's items each), memory holding one at a time:
        from the object store through presigned URLs (a closed job's: the shards its manifest
        names). Shards written at different times may differ in columns a model added. On a
        deployment whose storage cannot presign, the one file's row groups instead."""
        try:
            signed = await self.result_urls(job, expires)
        except ConflictError:  # not S3: the API's one file, which it writes shard by shard
            data = (await self._send(Call("GET", f"/v1/jobs/{calls.job_id(job)}/results"))).content
            for group in calls.parquet_row_groups(data):
                yield group
            return
        manifest = (await self._fetch(signed.manifest.url)).json() if signed.manifest else None
        wanted = calls.shard_keys_of(manifest)
        for shard in signed.shards:
            if wanted is None or shard.key in wanted:
                yield calls.parquet_table((await self._fetch(shard.url)).content)

    async def _fetch(self, url: str) -> httpx.Response:
        try:
            response = await self._plain.get(url)
        except httpx.HTTPError as error:
            raise unreachable(url.split("?")[0], error) from None
        if response.is_error:
            raise error_for(response)
        return response

    async def download_results(
        self, job: JobRef, path: str | os.PathLike[str], *, groups: bool = False
    ) -> None:
        """The job's results (or, `groups`, its duplicate groups) into a Parquet file at
        `path`, written as they arrive (never whole in memory). Groups are made as the job
        closes: asked for in that moment (503), they are asked again for up to a minute."""
        name = "groups" if groups else "results"
        url = f"/v1/jobs/{calls.job_id(job)}/{name}"
        deadline = time.monotonic() + GROUPS_RETRY_S
        pause = 0.5
        while True:
            try:
                await self._download(url, Path(path))
                return
            except UnavailableError:
                if time.monotonic() + pause > deadline:
                    raise
                await asyncio.sleep(pause)
                pause = min(pause * 2, 5.0)

    async def download_pipeline_results(self, name: str, path: str | os.PathLike[str]) -> None:
        """A pipeline's current results (one row per live object) into a Parquet file."""
        await self._download(f"/v1/pipelines/{name}/results", Path(path))

    async def _download(self, url: str, path: Path) -> None:
        try:
            async with self._http.stream("GET", url) as response:
                if response.is_error:
                    await response.aread()
                    raise error_for(response)
                with path.open("wb") as out:
                    async for piece in response.aiter_bytes():
                        out.write(piece)
        except httpx.HTTPError as error:
            raise unreachable(self.base_url, error) from None

    # -- search and webhooks --------------------------------------------------------------------

    async def search(
        self,
        job: JobRef | None = None,
        *,
        pipeline: str | None = None,
        image: str | os.PathLike[str] | None = None,
        text: str | None = None,
        key: str | None = None,
        k: int = 10,
    ) -> SearchOut:
        """The items of a closed embedding job (or of a pipeline's library) most alike to an
        image file, a text or one of their keys, most alike first."""
        call = calls.search_call(job, pipeline=pipeline, image=image, text=text, key=key, k=k)
        return SearchOut.model_validate((await self._send(call)).json())

    async def deliveries(self, job: JobRef) -> list[DeliveryOut]:
        """The job's webhook deliveries and their attempts ([] when it names no webhook)."""
        found = await self.job(job)
        return list(found.notify.deliveries) if found.notify else []

    async def webhook_secret(self) -> str:
        """Your tenant's webhook signing secret (`whsec_…`): verify a delivery's
        `webhook-signature` with it (the Standard Webhooks convention)."""
        secret: str = (await self._send(Call("GET", "/v1/webhooks/secret"))).json()["secret"]
        return secret
