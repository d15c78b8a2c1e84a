"""Prometheus metrics of a live stack: a job through the API and a worker, then both scraped
and parsed with prometheus_client's own parser."""

from __future__ import annotations

import math
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from devstack.images import photo
from devstack.services import wait_for
from kiln.app.dispatch.contract import QUEUES
from kiln.workers.ops.chunk_stats import STAGES
from tests.integration.test_http_jobs import upload, wait_done

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
IMAGES = 10


def scrape(url: str) -> Samples:
    response = httpx.get(url, timeout=10)  # no API key: /metrics is open
    assert response.status_code == 200, response.text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), math.nan)


def test_a_job_shows_in_api_and_worker_metrics(
    client: httpx.Client, api_url: str, worker_metrics_url: str, settings: Any
) -> None:
    response = upload(client, {f"metrics-{i}.jpg": photo(i) for i in range(IMAGES)})
    assert response.status_code == 202, response.text
    job = wait_done(client, response.json()["id"])
    assert job["status"] == "completed"
    model = job["model"]

    def counted() -> bool:  # the worker tallies a chunk just after writing it
        got = scrape(worker_metrics_url)
        return value(got, "kiln_items_total", model=model, status="succeeded") >= IMAGES

    wait_for(counted, 10, "the worker's item counters")
    worker = scrape(worker_metrics_url)
    assert value(worker, "kiln_items_total", model=model, status="succeeded") >= IMAGES
    batches = value(worker, "kiln_batch_size_count", model=model)
    assert batches >= math.ceil(IMAGES / settings.max_batch)
    assert value(worker, "kiln_batch_size_bucket", model=model, le="+Inf") == batches
    assert value(worker, "kiln_batch_size_sum", model=model) == value(
        worker, "kiln_batch_rows_total", model=model
    )
    assert value(worker, "kiln_engine_seconds_total", model=model) > 0
    assert value(worker, "kiln_batch_engine_duration_seconds_count", model=model) == batches
    rows = value(worker, "kiln_batch_rows_total", model=model)
    assert value(worker, "kiln_batch_queue_wait_duration_seconds_count", model=model) == rows
    assert value(worker, "kiln_batch_queue_wait_seconds_total", model=model) >= 0
    assert value(worker, "kiln_chunks_total", model=model) >= math.ceil(
        IMAGES / settings.chunk_size
    )
    for stage in STAGES:
        assert value(worker, "kiln_stage_seconds_total", model=model, stage=stage) >= 0
    assert value(worker, "kiln_stage_seconds_total", model=model, stage="write") > 0
    engines = [labels for name, labels in worker if name == "kiln_engine_info"]
    assert any(("model", model) in labels for labels in engines)

    api = scrape(f"{api_url}/metrics")
    assert value(api, "kiln_jobs", status="completed") >= 1
    for queue in QUEUES:  # a Redis broker: every queue is read, empty or not
        assert value(api, "kiln_queue_length", queue=queue) >= 0
    posted = value(api, "kiln_http_requests_total", route="/v1/jobs", method="POST", status="202")
    assert posted >= 1
    polled = value(api, "kiln_http_request_duration_seconds_count", route="/v1/jobs/{job_id}",
                   method="GET")  # fmt: skip
    assert polled >= 1
