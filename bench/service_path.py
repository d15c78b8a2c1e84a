"""What a user meets on the service path (issue 30): how a cancel stops a running job, and how
soon and how truly a job's progress moves.

    python -m bench.service_path                  # the Kiln installed here
    PYTHONPATH=/path/to/old/tree python -m bench.service_path --label before

A fresh `kiln api` and `kiln worker` with Kiln's shipped chunking and concurrency (32-item
chunks, 16 in flight), on real Postgres, Redis and moto's S3 server, as the README's service
steps start them. Two runs of OCR over generated 96×72 photos (OCR is the slow built-in, so a
job lasts long enough to watch):

- **cancel**: 200 images uploaded as one job, cancelled once 16 have succeeded: the items not
  done at the cancel's answer that still ran after it, those cancelled, and the seconds from
  the answer until the job closed.
- **progress**: 150 images as one job, read every 0.5 s as `kiln status --watch` does: when the
  first sign of work shows (anything counted `running`, where the API has that count), when
  the first progress shows (items ended, or answered and not yet written), and how far each
  ETA's predicted finish falls from the real one (worst over the run, and over its second
  half), in % of the job's length.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer

from devstack.images import photo
from devstack.services import (
    backing_services,
    create_api_key,
    service_env,
    settings_for,
    start_api,
    start_worker,
)
from kiln.app.db.migrate import upgrade

BUCKET = "kiln-bench-service-path"
CLOSED = ("completed", "failed", "cancelled")


def main(
    label: Annotated[str, typer.Option(help="Names this run in the output.")] = "here",
    runs: Annotated[int, typer.Option(help="Runs of each measure.")] = 2,
) -> None:
    """Print one JSON line per measure and run."""
    with _stack() as client:
        for run in range(runs):
            figures = cancel(client, seed=10_000 * run)
            print(json.dumps({"label": label, "measure": "cancel", **figures}), flush=True)
            figures = watch(client, seed=10_000 * run + 5_000)
            print(json.dumps({"label": label, "measure": "progress", **figures}), flush=True)


def cancel(client: httpx.Client, images: int = 200, seed: int = 0) -> dict[str, Any]:
    job = _submit(client, images, seed)
    _poll(client, job, lambda j: j["counts"]["succeeded"] >= 16)
    at = client.post(f"/v1/jobs/{job}/cancel").json()["counts"]
    answered = time.monotonic()
    final = _poll(client, job, lambda j: j["status"] in CLOSED, every=0.1)
    closed_s = time.monotonic() - answered
    done_then = at["succeeded"] + at["failed"] + at.get("answered", 0)
    counts = final["counts"]
    return {
        "unfinished_at_cancel": images - done_then,
        "ran_after": counts["succeeded"] + counts["failed"] - done_then,
        "cancelled": counts["cancelled"],
        "closed_after_s": round(closed_s, 1),
    }


def watch(client: httpx.Client, images: int = 150, seed: int = 5_000) -> dict[str, Any]:
    started = time.monotonic()
    job = _submit(client, images, seed)
    samples: list[tuple[float, dict[str, Any]]] = []
    while True:
        answer = client.get(f"/v1/jobs/{job}").json()
        samples.append((time.monotonic() - started, answer))
        if answer["status"] in CLOSED:
            break
        time.sleep(0.5)
    end = samples[-1][0]

    def first(test: Any) -> float | None:
        return next((round(t, 1) for t, a in samples if test(a["counts"])), None)

    predicted = [(t, t + a["eta_seconds"]) for t, a in samples if a["eta_seconds"] is not None]
    errors = [(t, abs(p - end) / end) for t, p in predicted]
    late = [e for t, e in errors if t >= end / 2]
    return {
        "seconds": round(end, 1),
        "first_running_s": first(lambda c: c.get("running", 0) > 0),
        "first_progress_s": first(
            lambda c: c["succeeded"] + c["failed"] + c.get("answered", 0) > 0
        ),
        "first_eta_s": round(predicted[0][0], 1) if predicted else None,
        "worst_eta_error_pct": round(100 * max(e for _, e in errors)) if errors else None,
        "worst_eta_error_second_half_pct": round(100 * max(late)) if late else None,
    }


def _submit(client: httpx.Client, images: int, seed: int) -> str:
    files = [
        ("files", (f"s-{i:04d}.jpg", photo(seed + i, (96, 72)), "image/jpeg"))
        for i in range(images)
    ]
    response = client.post("/v1/jobs", data={"model": "ocr"}, files=files)
    response.raise_for_status()
    return str(response.json()["id"])


def _poll(client: httpx.Client, job: str, ready: Any, every: float = 0.05) -> dict[str, Any]:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        answer: dict[str, Any] = client.get(f"/v1/jobs/{job}").json()
        if ready(answer):
            return answer
        time.sleep(every)
    raise TimeoutError(f"job {job} did not get there in 600 s")


@contextmanager
def _stack() -> Iterator[httpx.Client]:
    """Postgres, Redis and moto of our own, one `kiln api` and one `kiln worker`, and a key."""
    logs = Path(tempfile.mkdtemp(prefix="kiln-bench-service-path-"))
    with backing_services(logs, [BUCKET], "kiln_bench_path") as services:
        # The content cache off, as in every bench case: a rerun must run, not look up.
        kiln = services.kiln_env(logs / "data", f"s3://{BUCKET}/kiln", content_cache="false")
        settings = settings_for(kiln)
        upgrade(settings)
        key = create_api_key(settings, "acme")
        env = service_env(kiln)
        api, url = start_api(env, logs)
        try:
            worker, _node = start_worker(env, logs)
            try:
                headers = {"Authorization": f"Bearer {key}"}
                with httpx.Client(base_url=url, headers=headers, timeout=120) as client:
                    yield client
            finally:
                worker.stop()
        finally:
            api.stop()


if __name__ == "__main__":
    os.environ.setdefault("KILN_LOG_LEVEL", "WARNING")
    typer.run(main)
