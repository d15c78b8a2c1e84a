"""The console's routes on the embedded defaults: sign-in, sessions, CSRF, tenant scoping,
escaping and the security headers (the browser tests drive the same pages in Chromium)."""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Callable
from datetime import timedelta

import pytest
from PIL import Image
from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from kiln.app.console.security import POLICY
from kiln.app.db import counters, worker_facts
from kiln.app.db.models import Ingest, Item, Job, utcnow
from kiln.app.db.session import unit_of_work
from kiln.app.results.thumbnails import thumbnail
from kiln.app.tenants.auth import revoke_key
from tests.app.api.conftest import TestClient, bearer

NAME = '"><img src=x onerror=alert(1)>.png'


def png(colour: tuple[int, int, int] = (200, 30, 30), size: tuple[int, int] = (64, 48)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, "PNG")
    return buffer.getvalue()


def csrf(page: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    assert found, "the page has no CSRF field"
    return found.group(1)


def sign_in(http: TestClient, key: str) -> None:
    token = csrf(http.get("/console/login").text)
    answer = http.post("/console/login", data={"key": key, "csrf": token}, follow_redirects=False)
    assert answer.status_code == 303, answer.text


@pytest.fixture
def browser(client: TestClient) -> TestClient:
    """The same app without the API key header: a browser has only its cookie."""
    client.headers.pop("Authorization")
    return client


@pytest.fixture
def acme_key(new_key: Callable[[str], str]) -> str:
    return new_key("acme")


def submit(http: TestClient, key: str, name: str = "a.png", model: str = "phash") -> str:
    answer = http.post(
        "/v1/jobs",
        headers=bearer(key),
        data={"model": model},
        files=[("files", (name, png(), "image/png"))],
    )
    assert answer.status_code == 202, answer.text
    return str(answer.json()["id"])


def test_signed_out_pages_send_to_sign_in(browser: TestClient) -> None:
    for path in ("/console/", "/console/fleet", "/console/jobs/x", "/console/models"):
        answer = browser.get(path, follow_redirects=False)
        assert (answer.status_code, answer.headers["location"]) == (303, "/console/login")
    live = browser.get("/console/jobs/rows", headers={"HX-Request": "true"})
    assert (live.status_code, live.headers["HX-Redirect"]) == (204, "/console/login")
    assert browser.get("/", follow_redirects=False).headers["location"] == "/console/"


def test_sign_in_sets_a_signed_cookie_without_the_key(browser: TestClient, acme_key: str) -> None:
    token = csrf(browser.get("/console/login").text)
    answer = browser.post(
        "/console/login", data={"key": acme_key, "csrf": token}, follow_redirects=False
    )
    cookie = answer.headers["set-cookie"]
    assert "httponly" in cookie.lower() and "samesite=lax" in cookie.lower()
    assert "path=/console" in cookie.lower()
    payload = cookie.split("=", 1)[1].split(".", 1)[0]
    assert acme_key not in base64.b64decode(payload + "==").decode()
    page = browser.get("/console/")
    assert page.status_code == 200 and "acme" in page.text and acme_key not in page.text


def test_a_wrong_key_or_a_missing_token_does_not_sign_in(
    browser: TestClient, acme_key: str
) -> None:
    token = csrf(browser.get("/console/login").text)
    wrong = browser.post("/console/login", data={"key": "kiln_x_y", "csrf": token})
    assert wrong.status_code == 401 and "not one Kiln knows" in wrong.text
    forged = browser.post("/console/login", data={"key": acme_key, "csrf": "forged"})
    assert forged.status_code == 403 and "not sent by the console" in forged.text
    assert browser.get("/console/", follow_redirects=False).status_code == 303


def test_revoking_the_key_ends_its_sessions(
    browser: TestClient, acme_key: str, sessions: sessionmaker[Session]
) -> None:
    sign_in(browser, acme_key)
    assert browser.get("/console/").status_code == 200
    with sessions() as session:
        revoke_key(session, acme_key.split("_")[1])
    assert browser.get("/console/", follow_redirects=False).status_code == 303


def test_sign_out_needs_the_token(browser: TestClient, acme_key: str) -> None:
    sign_in(browser, acme_key)
    assert browser.post("/console/logout", data={"csrf": "nope"}).status_code == 403
    token = csrf(browser.get("/console/").text)
    browser.post("/console/logout", data={"csrf": token}, follow_redirects=False)
    assert browser.get("/console/", follow_redirects=False).status_code == 303


def test_cancel_needs_the_token(browser: TestClient, acme_key: str) -> None:
    job = submit(browser, acme_key)
    sign_in(browser, acme_key)
    forged = browser.post(f"/console/jobs/{job}/cancel", data={"csrf": "forged"})
    assert forged.status_code == 403
    assert browser.get(f"/v1/jobs/{job}", headers=bearer(acme_key)).json()["status"] == "queued"
    token = csrf(browser.get(f"/console/jobs/{job}").text)
    done = browser.post(f"/console/jobs/{job}/cancel", data={"csrf": token})
    assert done.status_code == 200
    status = browser.get(f"/v1/jobs/{job}", headers=bearer(acme_key)).json()["status"]
    assert status in ("cancelling", "cancelled")


def test_another_tenants_job_is_not_found(
    browser: TestClient, acme_key: str, new_key: Callable[[str], str]
) -> None:
    job = submit(browser, acme_key)
    sign_in(browser, new_key("globex"))
    assert job not in browser.get("/console/").text
    for path in ("", "/summary", "/items", "/groups", "/throughput.json", "/results.parquet"):
        answer = browser.get(f"/console/jobs/{job}{path}")
        assert answer.status_code == 404, path
    assert browser.get(f"/console/jobs/{job}/thumbnail", params={"key": "a.png"}).status_code == 404
    assert browser.get(f"/console/try/{job}").status_code == 404
    token = csrf(browser.get("/console/").text)
    assert browser.post(f"/console/jobs/{job}/cancel", data={"csrf": token}).status_code == 404


def test_a_thumbnail_the_owner_saw_stays_hidden_from_another_tenant(
    browser: TestClient, acme_key: str, new_key: Callable[[str], str]
) -> None:
    job = submit(browser, acme_key)
    sign_in(browser, acme_key)
    path, params = f"/console/jobs/{job}/thumbnail", {"key": "a.png"}
    assert browser.get(path, params=params).status_code == 200  # now in the API's cache
    sign_in(browser, new_key("globex"))
    assert browser.get(path, params=params).status_code == 404


def test_file_names_are_escaped_and_pages_carry_the_policy(
    browser: TestClient, acme_key: str
) -> None:
    job = submit(browser, acme_key, name=NAME)
    sign_in(browser, acme_key)
    for path in (f"/console/jobs/{job}/items", f"/console/try/{job}"):
        page = browser.get(path)
        assert "<img src=x" not in page.text
        assert "&gt;&lt;img src=x onerror=alert(1)&gt;.png" in page.text  # as text
    page = browser.get(f"/console/jobs/{job}")
    assert page.headers["content-security-policy"] == POLICY
    assert "unsafe-inline" not in POLICY and "script-src 'self'" in POLICY
    assert page.headers["x-frame-options"] == "DENY"
    assert "<script>" not in page.text  # every script is a file: <script src=…>


def test_every_page_renders(browser: TestClient, acme_key: str) -> None:
    job = submit(browser, acme_key)
    sign_in(browser, acme_key)
    for path in (
        "/console/",
        f"/console/jobs/{job}",
        f"/console/jobs/{job}/groups",
        "/console/try",
        f"/console/try/{job}/answer",
        "/console/fleet",
        "/console/fleet/workers",
        "/console/models",
        "/console/schedules",
    ):
        page = browser.get(path)
        assert page.status_code == 200, (path, page.text[:500])
        assert page.headers["content-type"].startswith("text/html")
    assert browser.get("/console/fleet/data.json").json() == {"workers": []}
    assert browser.get(f"/console/jobs/{job}/throughput.json").json()["t"] == []


def test_try_submits_a_job_through_the_queue(browser: TestClient, acme_key: str) -> None:
    sign_in(browser, acme_key)
    token = csrf(browser.get("/console/try").text)
    answer = browser.post(
        "/console/try",
        data={"csrf": token, "model": "phash"},
        files=[("files", ("x.png", png(), "image/png"))],
        follow_redirects=False,
    )
    assert answer.status_code == 303
    job = answer.headers["location"].rsplit("/", 1)[1]
    assert browser.get(f"/v1/jobs/{job}", headers=bearer(acme_key)).json()["model"] == "phash"
    empty = browser.post("/console/try", data={"csrf": token, "model": "phash"})
    assert empty.status_code == 422 and "Drop one or more images" in empty.text


def test_the_api_still_answers_json(client: TestClient) -> None:
    missing = client.get("/v1/jobs/nope")
    assert missing.status_code == 404 and missing.json()["detail"]


def test_boxes_are_drawn_in_the_originals_pixels() -> None:
    """A 400×200 picture, a box on its right half: on a 100×50 thumbnail, around x 50–100."""
    big = png((255, 255, 255), (400, 200))
    drawn = Image.open(
        io.BytesIO(thumbnail(big, 10**8, side=100, boxes=[("x", [200, 0, 399, 199])]))
    )
    plain = Image.open(io.BytesIO(thumbnail(big, 10**8, side=100)))
    assert drawn.size == plain.size == (100, 50)
    left = [drawn.getpixel((x, 25)) for x in range(0, 45)]
    assert all(min(p) > 200 for p in left)  # untouched, still white
    edge = drawn.getpixel((50, 25))
    assert min(edge) < 200  # the box's left side


def test_the_fleet_shows_a_tenant_its_models_and_charts_what_nvml_said(
    browser: TestClient, acme_key: str, sessions: sessionmaker[Session]
) -> None:
    gpu = {"name": "NVIDIA L4", "index": 0, "utilization_pct": 87.0, "temperature_c": 61.0}
    models = {
        "ocr": {"backend": "tensorrt", "tenant": "", "batches": 4, "rows": 40, "mean_batch": 10.0,
                "engine_ms_per_batch": 12.5, "failed_batches": 0, "memory_bytes": 300 * 2**20,
                "slot_bytes": 12 * 2**20},
        "secret-model:1": {"backend": "tensorrt", "tenant": "globex"},
    }  # fmt: skip
    with sessions() as session, unit_of_work(session):
        memory = {"rss_bytes": 2500 * 2**20, "prep_rss_bytes": 600 * 2**20}
        facts = {"models": models, "gpu": gpu, "memory": memory}
        worker_facts.publish(session, "gpu0@box", "box", "NVIDIA L4", facts, utcnow())
        worker_facts.publish(session, "cpu@box", "box", "cpu", {"models": {}}, utcnow())
    sign_in(browser, acme_key)
    page = browser.get("/console/fleet").text
    assert "gpu0@box" in page and "cpu@box" in page and "12.5" in page
    assert "RSS 2,500 MiB + prep 600 MiB" in page and "312 MiB" in page  # ocr: engines + slots
    assert page.count("RSS ") == 1  # cpu@box said nothing of its memory: nothing is shown
    assert "secret-model" not in page and "and 1 other tenants" in page
    assert 'id="no-gpu"' not in page
    charts = {
        w["worker"]: w["gpu"] for w in browser.get("/console/fleet/data.json").json()["workers"]
    }
    assert charts == {"cpu@box": None, "gpu0@box": gpu}  # power absent: not reported, not 0


def test_throughput_starts_at_zero_and_counts_every_finished_item(
    browser: TestClient, acme_key: str, sessions: sessionmaker[Session]
) -> None:
    job_id = submit(browser, acme_key)
    started = utcnow() - timedelta(seconds=120)
    with sessions() as session, unit_of_work(session):
        session.execute(update(Job).where(Job.id == job_id).values(started_at=started))
        session.execute(
            update(Item)
            .where(Item.job_id == job_id)
            .values(status="succeeded", finished_at=started + timedelta(seconds=30))
        )
    sign_in(browser, acme_key)
    series = browser.get(f"/console/jobs/{job_id}/throughput.json").json()
    assert series["t"][0] == pytest.approx(started.timestamp()) and series["rate"][0] == 0
    width = series["t"][1] - series["t"][0]  # the job is open: its buckets reach now
    assert sum(series["rate"]) * width == pytest.approx(1, abs=0.05)  # its one item


def test_every_item_filter_of_a_job_page_answers(browser: TestClient, acme_key: str) -> None:
    """Each filter the job page offers is a status items have (a pipeline's skipped objects
    are not items: the summary counts them)."""
    job = submit(browser, acme_key)
    sign_in(browser, acme_key)
    page = browser.get(f"/console/jobs/{job}").text
    filters = re.findall(rf'hx-get="(/console/jobs/{job}/items(?:\?status=\w+)?)"', page)
    assert len(filters) >= 6
    for path in filters:
        assert browser.get(path).status_code == 200, path


def test_a_job_whose_worker_stopped_renewing_says_it_is_stalled(
    browser: TestClient, acme_key: str, sessions: sessionmaker[Session]
) -> None:
    """A worker died holding the job's item: the summary counts it as running and says since
    when nobody renews it, the jobs list tags the job, and the API answers the same."""
    job_id = submit(browser, acme_key)
    renewed = utcnow() - timedelta(seconds=45)  # a 60 s lease, renewed 45 s ago and no more
    with sessions() as session, unit_of_work(session):
        session.execute(
            update(Job).where(Job.id == job_id).values(status="running", started_at=renewed)
        )
        session.execute(
            update(Item)
            .where(Item.job_id == job_id)
            .values(
                status="running",
                lease_owner="a-dead-run",
                lease_expires_at=renewed + timedelta(seconds=60),
            )
        )
    sign_in(browser, acme_key)
    summary = browser.get(f"/console/jobs/{job_id}/summary").text
    assert re.search(r"<dt>Running</dt><dd>1</dd>", summary)
    assert re.search(r"<dt>Pending</dt><dd>0</dd>", summary)
    assert "Stalled since" in summary and "kiln beat" in summary
    assert 'class="tag stalled"' in browser.get("/console/").text
    job = browser.get(f"/v1/jobs/{job_id}", headers=bearer(acme_key)).json()
    assert job["counts"]["running"] == 1 and job["counts"]["pending"] == 0
    assert job["stalled_since"] is not None


def test_a_job_page_answers_to_the_eight_characters_it_shows(
    browser: TestClient, acme_key: str, new_key: Callable[[str], str]
) -> None:
    job = submit(browser, acme_key)
    sign_in(browser, acme_key)
    page = browser.get(f"/console/jobs/{job[:8]}")
    assert page.status_code == 200, page.text[:500]
    assert f'hx-get="/console/jobs/{job}/items"' in page.text  # its parts ask by the whole id
    for path in ("/summary", "/items", "/throughput.json", "/results.parquet"):
        assert browser.get(f"/console/jobs/{job[:8]}{path}").status_code == 200, path
    sign_in(browser, new_key("globex"))
    assert browser.get(f"/console/jobs/{job[:8]}").status_code == 404


def percents(page: str) -> list[float]:
    """Every percent the page shows, as text and as its bars' values."""
    shown = re.findall(r'<span class="percent">([\d.]+)%</span>', page)
    bars = re.findall(r'<progress max="100" value="([\d.]+)"', page)
    assert shown and len(shown) == len(bars), "the page shows no progress"
    return [float(p) for p in shown + bars]


@pytest.mark.parametrize("status", ["running", "completed"])
def test_an_incremental_rerun_is_never_past_100_percent(
    browser: TestClient, acme_key: str, sessions: sessionmaker[Session], status: str
) -> None:
    """A pipeline's rerun with one object to do, 1,386 unchanged and 30 deleted: the console
    counted those in done, not in the total (13,518%). Progress is over the total; what the
    listing left alone is shown apart."""
    job_id = submit(browser, acme_key)
    now = utcnow()
    with sessions() as session, unit_of_work(session):
        item = "succeeded" if status == "completed" else "pending"
        session.execute(
            update(Job)
            .where(Job.id == job_id)
            .values(status=status, source={"s3": "s3://photos/2026/"}, started_at=now,
                    finished_at=now if status == "completed" else None)
        )  # fmt: skip
        session.execute(
            update(Item).where(Item.job_id == job_id).values(status=item, finished_at=now)
        )
        session.add(Ingest(job_id=job_id, done=True, listed=1417, skipped=1386, deleted=30))
        counters.repair(session, job_id)  # the edits above bypass the counters
    sign_in(browser, acme_key)
    done = 1 if status == "completed" else 0
    for path in ("/console/", f"/console/jobs/{job_id}", f"/console/jobs/{job_id}/summary"):
        page = browser.get(path).text
        assert max(percents(page)) <= 100, path
        assert "1,386 unchanged" in page or "Unchanged (not in total)" in page, path
    rows = browser.get("/console/jobs/rows").text
    assert re.search(rf"{done} / 1<.*1,386 unchanged, 30 deleted at source", rows)
    summary = browser.get(f"/console/jobs/{job_id}/summary").text
    assert f'data-done="{done}" data-total="1"' in summary
    assert re.search(r"<dt>Unchanged \(not in total\)</dt><dd>1,386</dd>", summary)
    assert re.search(r"<dt>Deleted at source \(not in total\)</dt><dd>30</dd>", summary)
    api = browser.get(f"/v1/jobs/{job_id}", headers=bearer(acme_key)).json()["counts"]
    assert (api["done"], api["total"], api["skipped"], api["deleted"]) == (done, 1, 1386, 30)


def test_a_failed_items_card_shows_its_sentence_and_asks_for_no_thumbnail(
    browser: TestClient, acme_key: str, sessions: sessionmaker[Session]
) -> None:
    """Its thumbnail would answer 422 (what failed it is often the picture itself), which a
    browser draws as a broken image: its sentence takes the picture's place."""
    answer = browser.post(
        "/v1/jobs",
        headers=bearer(acme_key),
        data={"model": "phash"},
        files=[("files", ("broken.png", b"not a picture", "image/png"))],
    )
    assert answer.status_code == 202, answer.text
    job_id = answer.json()["id"]
    with sessions() as session, unit_of_work(session):
        session.execute(
            update(Item)
            .where(Item.job_id == job_id)
            .values(status="failed", error="Item 'broken.png' is not a picture Kiln can read.")
        )
    sign_in(browser, acme_key)
    grid = browser.get(f"/console/jobs/{job_id}/items").text
    assert "/thumbnail?" not in grid and 'class="thumb"' not in grid
    assert re.search(
        r'<div class="no-picture"><p class="sentence">Item &#39;broken.png&#39; is not a picture',
        grid,
    )
    assert grid.count("is not a picture Kiln can read") == 1  # said once, where it is seen
    asked = browser.get(f"/console/jobs/{job_id}/thumbnail", params={"key": "broken.png"})
    assert asked.status_code == 422  # asked anyway: still a sentence, not a broken image
    assert "Item &#39;broken.png&#39; is not a picture Kiln can read." in asked.text
