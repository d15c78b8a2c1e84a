"""A small HTTP client for the Kiln API, used by the CLI's remote commands."""

from __future__ import annotations

import json
import mimetypes
from pathlib import Path
from typing import Any

import httpx
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

from kiln.app.core.errors import KilnError

MAX_JOBS_PAGE = 200  # the most jobs GET /v1/jobs answers at once


class ApiError(KilnError):
    """The API answered with an error; the message is its sentence."""


class UnavailableError(ApiError):
    """The API answered 503: what was asked is not ready yet, or a dependency is down."""


class KilnClient:
    def __init__(self, base_url: str, api_key: str | None, timeout: float = 60.0) -> None:
        if not api_key:
            raise ApiError("Set KILN_API_KEY to a key from `kiln keys create --tenant NAME`.")
        self.http = httpx.Client(
            base_url=base_url.rstrip("/"),
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=timeout,
        )

    def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as error:
            raise ApiError(
                f"Could not reach the Kiln API at {self.http.base_url} (KILN_API_URL): {error}. "
                "Is `kiln api` running there?"
            ) from None
        if response.is_error:
            self._raise_for(response)
        return response

    @staticmethod
    def _raise_for(response: httpx.Response) -> None:
        try:
            detail = response.json().get("detail", response.text)
        except ValueError:
            detail = response.text
        error = UnavailableError if response.status_code == 503 else ApiError
        raise error(f"{detail} (HTTP {response.status_code})")

    def submit(
        self, files: list[Path], model: str, options: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        parts = [
            (
                "files",
                (
                    f.name,
                    f.read_bytes(),
                    mimetypes.guess_type(f.name)[0] or "application/octet-stream",
                ),
            )
            for f in files
        ]
        form = {"model": model, **({"options": json.dumps(options)} if options else {})}
        result: dict[str, Any] = self._call("POST", "/v1/jobs", data=form, files=parts).json()
        return result

    def submit_json(self, body: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", "/v1/jobs", json=body).json()
        return result

    def estimate(self, body: dict[str, Any]) -> dict[str, Any]:
        """A bulk job's estimate (POST /v1/jobs/estimate): nothing is created."""
        result: dict[str, Any] = self._call("POST", "/v1/jobs/estimate", json=body).json()
        return result

    def add_schedule(self, body: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", "/v1/schedules", json=body).json()
        return result

    def schedules(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._call("GET", "/v1/schedules").json()
        return result

    def remove_schedule(self, name: str) -> None:
        self._call("DELETE", f"/v1/schedules/{name}")

    def jobs(self, limit: int, **only: str | None) -> list[dict[str, Any]]:
        """The tenant's newest `limit` jobs, page by page; `only`: `status`, `pipeline` or
        `schedule` filters (None: not filtered)."""
        params: dict[str, Any] = {k: v for k, v in only.items() if v is not None}
        found: list[dict[str, Any]] = []
        while len(found) < limit:
            params["limit"] = min(limit - len(found), MAX_JOBS_PAGE)
            page = self._call("GET", "/v1/jobs", params=params).json()
            found += page["jobs"]
            if not page["next"]:
                break
            params["after"] = page["next"]
        return found

    def job(self, job_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", f"/v1/jobs/{job_id}").json()
        return result

    def first_error(self, job_id: str) -> str | None:
        """The sentence of the job's first failed item, or None."""
        failed = {"status": "failed", "limit": 1}
        items = self._call("GET", f"/v1/jobs/{job_id}/items", params=failed).json().get("items", [])
        return items[0].get("error") if items else None

    def cancel(self, job_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", f"/v1/jobs/{job_id}/cancel").json()
        return result

    def download_results(self, job_id: str, path: Path, name: str = "results") -> None:
        """The job's results (or `name`: "groups") into `path`, written as they arrive (never
        whole in memory). A 503 (groups asked for in the moment between a job's close and its
        close steps' end) is asked again, for up to a minute."""
        for attempt in Retrying(
            retry=retry_if_exception_type(UnavailableError),
            wait=wait_exponential(multiplier=0.5, max=5),
            stop=stop_after_delay(60),
            reraise=True,
        ):
            with attempt:
                self._download(f"/v1/jobs/{job_id}/{name}", path)

    def download_pipeline_results(self, name: str, path: Path) -> None:
        """The pipeline's current results into `path`, written as they arrive."""
        self._download(f"/v1/pipelines/{name}/results", path)

    def _download(self, url: str, path: Path) -> None:
        try:
            with self.http.stream("GET", url) as response:
                if response.is_error:
                    response.read()
                    self._raise_for(response)
                with path.open("wb") as out:
                    for piece in response.iter_bytes():
                        out.write(piece)
        except httpx.HTTPError as error:
            raise ApiError(
                f"Could not download the results from {self.http.base_url}: {error}."
            ) from None

    def search(
        self,
        job_id: str | None = None,
        *,
        pipeline: str | None = None,
        image: Path | None = None,
        text: str | None = None,
        key: str | None = None,
        k: int = 10,
    ) -> dict[str, Any]:
        """The items of a job (or the objects of a pipeline's library) most alike to an image
        file, a text or one of their keys."""
        where = f"jobs/{job_id}" if pipeline is None else f"pipelines/{pipeline}"
        path = f"/v1/{where}/search"
        if image is not None:
            kind = mimetypes.guess_type(image.name)[0] or "application/octet-stream"
            upload = [("file", (image.name, image.read_bytes(), kind))]
            response = self._call("POST", path, data={"k": str(k)}, files=upload)
        else:
            response = self._call("POST", path, json={"text": text, "key": key, "k": k})
        result: dict[str, Any] = response.json()
        return result

    def result_urls(self, job_id: str, expires: int) -> dict[str, Any]:
        path = f"/v1/jobs/{job_id}/results/urls"
        result: dict[str, Any] = self._call("GET", path, params={"expires": expires}).json()
        return result

    def close(self) -> None:
        self.http.close()
