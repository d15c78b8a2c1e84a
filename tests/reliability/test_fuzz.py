"""Property-based fuzzing of the live API from its own OpenAPI document (schemathesis).

Every operation gets generated requests, valid and invalid, with a valid key of a tenant of its
own ("fuzz"); each answer must not be a 5xx, must use a documented status code and content type,
and must match the documented response schema. Bounded and repeatable: derandomized (the same
examples every run), 25 per operation and generation phase, no deadline (the machine is
shared), no example database.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import checks

from devstack.services import Process
from kiln.app.api.app import create_app
from kiln.app.core.config import get_settings
from tests.stack import _key

EXAMPLES_PER_OPERATION = 25
CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,  # type: ignore[attr-defined]
    checks.content_type_conformance,  # type: ignore[attr-defined]
    checks.response_schema_conformance,  # type: ignore[attr-defined]
]
# The tenant rate limit (KILN_TENANT_RATE_LIMIT, 100/s by default) would answer most requests
# with 429 if sent flat out; at this pace they reach the routes.
REQUESTS_PER_SECOND = 60
CALLS: list[tuple[str, int]] = []  # (operation, status) of every request sent, for the summary


@pytest.fixture(scope="module")
def fuzz_headers(sessions: Any) -> dict[str, str]:
    return {"Authorization": f"Bearer {_key(sessions, 'fuzz')}"}


class Pacer:
    """At most `rate` calls of `wait()` per second."""

    def __init__(self, rate: float) -> None:
        self.interval = 1 / rate
        self.next = 0.0

    def wait(self) -> None:
        now = time.monotonic()
        time.sleep(max(0.0, self.next - now))  # never more than one interval
        self.next = max(now, self.next) + self.interval


PACER = Pacer(REQUESTS_PER_SECOND)

# The document the API serves, built here without connecting anywhere (pytest needs the
# operations at collection); test_the_live_api_serves_this_document checks they are the same.
DOCUMENT = create_app(get_settings()).openapi()
schema = schemathesis.openapi.from_dict(DOCUMENT)
# Our own valid key on every request: generated credentials would only meet the 401 path.
schema.config.generation.update(max_examples=EXAMPLES_PER_OPERATION, with_security_parameters=False)


@pytest.fixture(scope="module", autouse=True)
def report_calls(request: pytest.FixtureRequest) -> Any:
    started = time.monotonic()
    yield
    operations = {name for name, _ in CALLS}
    statuses: dict[int, int] = {}
    for _, status in CALLS:
        statuses[status] = statuses.get(status, 0) + 1
    print(
        f"\nfuzz: {len(CALLS)} requests over {len(operations)} operations in "
        f"{time.monotonic() - started:.1f} s; statuses {dict(sorted(statuses.items()))}"
    )


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_api_answers_every_request_within_its_contract(
    case: schemathesis.Case, api_url: str, worker: Process, fuzz_headers: dict[str, str]
) -> None:
    PACER.wait()
    response = case.call(base_url=api_url, headers=fuzz_headers, timeout=60)
    CALLS.append((case.operation.label, response.status_code))
    case.validate_response(response, checks=CHECKS)


def test_the_live_api_serves_this_document(api_url: str) -> None:
    served = httpx.get(f"{api_url}/openapi.json", timeout=30).json()
    assert served == DOCUMENT
    assert {"/v1/jobs", "/v1/models", "/v1/schedules"} <= set(served["paths"])
