"""The CLI's remote commands over the public client (`kiln.Client`, app/client): every request,
its key, its errors and its downloads are the client's. The commands' printers, exit verdict
and line log read a job as the API's JSON, so this hands them each answer as that JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel

from kiln.app.client import Client
from kiln.app.client.errors import ApiError, UnavailableError

__all__ = ["ApiError", "KilnClient", "UnavailableError"]


def _json(model: BaseModel) -> dict[str, Any]:
    """An answer as the API's JSON (timestamps as ISO text)."""
    return model.model_dump(mode="json")


class KilnClient:
    def __init__(self, base_url: str, api_key: str | None, timeout: float = 60.0) -> None:
        if not api_key:  # not the environment's: the CLI's settings already read it
            raise ApiError("Set KILN_API_KEY to a key from `kiln keys create --tenant NAME`.")
        self.api = Client(base_url, api_key, timeout=timeout)

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        """Any endpoint's JSON answer (None when it has no body)."""
        response = self.api.request(method, path, **kwargs)
        return response.json() if response.content else None

    def submit(
        self,
        files: list[Path],
        model: str,
        options: dict[str, Any] | None = None,
        notify: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return _json(self.api.submit(model, files=files, options=options, notify=notify))

    def submit_json(self, body: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", "/v1/jobs", json=body)
        return result

    def estimate(self, body: dict[str, Any]) -> dict[str, Any]:
        """A bulk job's estimate (POST /v1/jobs/estimate): nothing is created."""
        result: dict[str, Any] = self._call("POST", "/v1/jobs/estimate", json=body)
        return result

    def add_schedule(self, body: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", "/v1/schedules", json=body)
        return result

    def schedules(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._call("GET", "/v1/schedules")
        return result

    def remove_schedule(self, name: str) -> None:
        self.api.request("DELETE", f"/v1/schedules/{name}")

    def jobs(self, limit: int, **only: str | None) -> list[dict[str, Any]]:
        """The tenant's newest `limit` jobs; `only`: `status`, `pipeline` or `schedule`."""
        return [_json(job) for job in self.api.jobs(limit=limit, **only)]

    def job(self, job_id: str) -> dict[str, Any]:
        return _json(self.api.job(job_id))

    def first_error(self, job_id: str) -> str | None:
        """The sentence of the job's first failed item, or None."""
        first = next(iter(self.api.items(job_id, status="failed", page_size=1)), None)
        return first.error if first else None

    def cancel(self, job_id: str) -> dict[str, Any]:
        return _json(self.api.cancel(job_id))

    def retry(
        self,
        job_id: str,
        include_cancelled: bool = False,
        model: str | None = None,
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        """A new job over the job's failed (and cancelled) items: `POST /v1/jobs/{id}/retry`."""
        return _json(
            self.api.retry(
                job_id,
                include_cancelled=include_cancelled,
                model=model,
                idempotency_key=idempotency_key,
            )
        )

    def download_results(self, job_id: str, path: Path, name: str = "results") -> None:
        """The job's results (or `name`: "groups") into `path`, written as they arrive."""
        self.api.download_results(job_id, path, groups=name == "groups")

    def download_pipeline_results(self, name: str, path: Path) -> None:
        self.api.download_pipeline_results(name, path)

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
        found = self.api.search(job_id, pipeline=pipeline, image=image, text=text, key=key, k=k)
        return found.model_dump(mode="json")

    def result_urls(self, job_id: str, expires: int) -> dict[str, Any]:
        return _json(self.api.result_urls(job_id, expires))

    def close(self) -> None:
        self.api.close()
