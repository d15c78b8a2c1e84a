"""The API's side of webhooks on the embedded stack (no worker runs): a job's webhook is
checked and kept, its answer lists its deliveries, a cancel records its event, a tenant's
default applies to jobs that name none, and each tenant reads its own signing secret."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from pydantic import SecretStr
from sqlalchemy.orm import Session, sessionmaker

from devstack.images import solid
from kiln.app.api.app import create_app
from kiln.app.core.config import Settings
from kiln.app.tenants.defaults import set_defaults
from tests.app.api.conftest import TestClient, bearer

HOOK = "http://127.0.0.1:9/kiln"  # loopback: allowed here by the operator's setting


@pytest.fixture
def hooked(settings: Settings, new_key: Callable[[str], str]) -> Iterator[TestClient]:
    """A client for `acme` on a deployment that signs webhooks and allows private ones."""
    allowed = settings.model_copy(
        update={"webhook_secret": SecretStr("a-secret-for-the-api-tests"),
                "webhook_allow_private": True}
    )  # fmt: skip
    with TestClient(create_app(allowed), headers=bearer(new_key("acme"))) as http:
        yield http


def _submit(client: TestClient, **extra: Any) -> Any:
    return client.post("/v1/jobs", json={"model": "text-embed", "inputs": [{"text": "x"}], **extra})


def test_a_job_keeps_its_webhook_and_a_cancel_records_the_event(hooked: TestClient) -> None:
    response = _submit(hooked, notify={"url": HOOK, "events": ["cancelled"]})
    assert response.status_code == 202, response.text
    job = response.json()
    assert job["notify"] == {"url": HOOK, "events": ["cancelled"], "deliveries": []}

    cancelled = hooked.post(f"/v1/jobs/{job['id']}/cancel").json()
    assert cancelled["status"] == "cancelled"
    [delivery] = cancelled["notify"]["deliveries"]
    assert (delivery["event"], delivery["status"], delivery["attempts"]) == (
        "cancelled", "pending", 0,
    )  # fmt: skip
    assert delivery["next_attempt_at"] is not None  # due now: a worker's courier sends it


def test_the_form_door_takes_a_webhook_too(hooked: TestClient) -> None:
    files = [("files", ("red.png", solid((230, 20, 20)), "image/png"))]
    form = {"model": "phash", "notify": json.dumps({"url": HOOK})}
    job = hooked.post("/v1/jobs", data=form, files=files).json()
    assert job["notify"]["events"] == ["completed", "failed", "cancelled"]
    bad = hooked.post("/v1/jobs", data={**form, "notify": "{"}, files=files)
    assert bad.status_code == 422 and "notify" in bad.json()["detail"]


def test_a_job_naming_no_webhook_takes_its_tenant_s(
    hooked: TestClient, sessions: sessionmaker[Session]
) -> None:
    with sessions() as session:
        set_defaults(session, "acme", {"notify_url": HOOK, "notify_events": ["failed"]})
    job = _submit(hooked).json()
    assert job["notify"] == {"url": HOOK, "events": ["failed"], "deliveries": []}
    own = _submit(hooked, notify={"url": HOOK + "/own"}).json()
    assert own["notify"]["url"] == HOOK + "/own"


def test_each_tenant_reads_its_own_secret(
    hooked: TestClient, new_key: Callable[[str], str]
) -> None:
    mine = hooked.get("/v1/webhooks/secret").json()["secret"]
    theirs = hooked.get("/v1/webhooks/secret", headers=bearer(new_key("globex"))).json()
    assert mine.startswith("whsec_") and theirs["secret"].startswith("whsec_")
    assert mine != theirs["secret"]
    assert hooked.get("/v1/webhooks/secret", headers={"Authorization": ""}).status_code == 401


def test_the_default_deployment_refuses_private_urls_and_cannot_sign(client: TestClient) -> None:
    private = _submit(client, notify={"url": HOOK})
    assert private.status_code == 422
    assert "KILN_WEBHOOK_ALLOW_PRIVATE" in private.json()["detail"]
    public = _submit(client, notify={"url": "https://93.184.215.14/kiln"})
    assert public.status_code == 409 and "KILN_WEBHOOK_SECRET" in public.json()["detail"]
    assert client.get("/v1/webhooks/secret").status_code == 409
    not_http = _submit(client, notify={"url": "gopher://93.184.215.14/"})
    assert not_http.status_code == 422 and "http" in not_http.json()["detail"]
    no_events = _submit(client, notify={"url": "https://93.184.215.14/", "events": []})
    assert no_events.status_code == 422


def test_the_console_s_job_page_shows_the_deliveries(
    hooked: TestClient, new_key: Callable[[str], str]
) -> None:
    from tests.app.api.test_console import sign_in

    job = _submit(hooked, notify={"url": HOOK, "events": ["cancelled"]}).json()
    hooked.post(f"/v1/jobs/{job['id']}/cancel")
    key = hooked.headers.pop("Authorization").removeprefix("Bearer ")
    sign_in(hooked, key)
    summary = hooked.get(f"/console/jobs/{job['id']}/summary").text
    assert HOOK in summary and 'class="delivery pending"' in summary
    delivery = hooked.get(f"/v1/jobs/{job['id']}", headers=bearer(key)).json()["notify"]
    assert delivery["deliveries"][0]["id"] in summary
    # The job is closed: its summary stops refreshing, its pending delivery does not.
    assert f'hx-get="/console/jobs/{job["id"]}/summary"' not in summary
    assert f'hx-get="/console/jobs/{job["id"]}/webhook"' in summary
    part = hooked.get(f"/console/jobs/{job['id']}/webhook").text
    assert part.startswith('<div id="webhook"') and delivery["deliveries"][0]["id"] in part
