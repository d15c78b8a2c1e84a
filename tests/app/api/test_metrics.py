"""GET /metrics on the embedded defaults (SQLite, filesystem broker): read back with
prometheus_client's own parser."""

from __future__ import annotations

from typing import Any

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kiln.app.api.metrics import ApiMetrics
from kiln.app.dispatch.depths import queue_lengths
from tests.app.api.conftest import TestClient
from tests.app.api.test_routes import submit

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(client: TestClient) -> Samples:
    response = client.get("/metrics", headers={"Authorization": ""})  # no key needed
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return samples(response.text)


def test_jobs_by_status_and_open_items(client: TestClient) -> None:
    job = submit(client, n=4)
    got = scrape(client)
    assert got[("kiln_jobs", (("status", "queued"),))] == 1
    assert got[("kiln_jobs", (("status", "completed"),))] == 0  # every status, zeros included
    assert got[("kiln_open_job_items", (("model", job["model"]), ("status", "pending")))] == 4


def test_no_queue_length_without_a_redis_broker(client: TestClient) -> None:
    assert not any(name == "kiln_queue_length" for name, _ in scrape(client))


def test_requests_are_counted_by_route_template(client: TestClient) -> None:
    job = submit(client, n=1)
    client.get(f"/v1/jobs/{job['id']}")
    client.get("/v1/jobs/00000000-0000-0000-0000-000000000000")
    client.get("/no/such/path")
    got = scrape(client)
    route = "/v1/jobs/{job_id}"
    ok = (("method", "GET"), ("route", route), ("status", "200"))
    missing = (("method", "GET"), ("route", route), ("status", "404"))
    assert got[("kiln_http_requests_total", ok)] == 1
    assert got[("kiln_http_requests_total", missing)] == 1
    unmatched = (("method", "GET"), ("route", "unmatched"), ("status", "404"))
    assert got[("kiln_http_requests_total", unmatched)] == 1
    latency = (("method", "GET"), ("route", route))
    assert got[("kiln_http_request_duration_seconds_count", latency)] == 2
    assert got[("kiln_http_request_duration_seconds_sum", latency)] > 0


def test_each_app_has_its_own_registry() -> None:
    first, second = ApiMetrics(lambda: None, ("a",)), ApiMetrics(lambda: None, ("a",))
    first.observe("/x", "GET", 200, 0.1)
    assert "kiln_http_requests_total" in generate_latest(first.registry).decode()
    assert 'route="/x"' not in generate_latest(second.registry).decode()
    got = samples(generate_latest(second.registry).decode())  # no context yet: no samples
    assert not any(name in ("kiln_jobs", "kiln_queue_length") for name, _ in got)


class FakePredictor:
    def __init__(self, lists: dict[str, int]) -> None:
        self.lists, self.keys = lists, list[str]()

    def llen(self, key: str) -> None:
        self.keys.append(key)

    def execute(self) -> list[int]:
        return [self.lists.get(k, 0) for k in self.keys]


class FakeChannel:
    """kombu's Redis channel, as far as `queue_lengths` reads it."""

    priority_steps = (0, 3, 6, 9)

    def __init__(self, lists: dict[str, int]) -> None:
        self.client: Any = type("Client", (), {"pipeline": lambda _self: FakePredictor(lists)})()

    def _q_for_pri(self, queue: str, pri: int) -> str:
        return f"{queue}\x06\x16{pri}" if pri else queue


def test_queue_lengths_sum_every_priority_list() -> None:
    channel = FakeChannel({"bulk": 5, "bulk\x06\x163": 2, "interactive\x06\x169": 1})
    assert queue_lengths(channel, ("interactive", "bulk", "control")) == {
        "interactive": 1,
        "bulk": 7,
        "control": 0,
    }
