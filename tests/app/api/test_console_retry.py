"""The console's "Retry failed items" button: shown only on a closed job with failed items, a
POST form with the console's CSRF token, taking the browser to the new job, which links back."""

from __future__ import annotations

import re

from sqlalchemy.orm import Session, sessionmaker

from kiln.app.db.models import Job
from tests.app.api.conftest import TestClient, bearer
from tests.app.api.test_console import acme_key, browser, csrf, sign_in, submit  # noqa: F401
from tests.app.jobs.test_retry import end

BUTTON = "Retry failed items"


def test_the_retry_button_starts_a_job_over_the_failed_items(
    browser: TestClient,  # noqa: F811
    acme_key: str,  # noqa: F811
    sessions: sessionmaker[Session],
) -> None:
    job = submit(browser, acme_key)
    sign_in(browser, acme_key)
    assert BUTTON not in browser.get(f"/console/jobs/{job}").text  # open: nothing to retry
    with sessions() as session:
        row = session.get(Job, job)
        assert row is not None
        end(session, row, failed=[0])
    page = browser.get(f"/console/jobs/{job}").text
    assert f"{BUTTON} (1)" in page

    forged = browser.post(f"/console/jobs/{job}/retry", data={"csrf": "forged"})
    assert forged.status_code == 403
    moved = browser.post(
        f"/console/jobs/{job}/retry", data={"csrf": csrf(page)}, follow_redirects=False
    )
    assert moved.status_code == 303
    new = moved.headers["location"].rsplit("/", 1)[1]
    answer = browser.get(f"/v1/jobs/{new}", headers=bearer(acme_key)).json()
    assert answer["retry_of"] == job and answer["counts"]["total"] == 1
    assert f'href="/console/jobs/{job}"' in browser.get(f"/console/jobs/{new}").text
    assert f'href="/console/jobs/{new}"' in browser.get(f"/console/jobs/{job}").text


def test_the_same_page_pressed_twice_makes_one_retry(
    browser: TestClient,  # noqa: F811
    acme_key: str,  # noqa: F811
    sessions: sessionmaker[Session],
) -> None:
    """A double click (or a resent form) answers the first press's job; the page shown after it
    (which lists that retry) makes another."""
    job = submit(browser, acme_key)
    sign_in(browser, acme_key)
    with sessions() as session:
        row = session.get(Job, job)
        assert row is not None
        end(session, row, failed=[0])
    page = browser.get(f"/console/jobs/{job}").text
    assert 'name="seen" value="0"' in page

    def press(page: str) -> str:
        seen = re.search(r'name="seen" value="(\d+)"', page)
        assert seen is not None
        form = {"csrf": csrf(page), "seen": seen.group(1)}
        moved = browser.post(f"/console/jobs/{job}/retry", data=form, follow_redirects=False)
        assert moved.status_code == 303
        return str(moved.headers["location"]).rsplit("/", 1)[1]

    first = press(page)
    assert press(page) == first
    again = browser.get(f"/console/jobs/{job}").text
    assert 'name="seen" value="1"' in again
    second = press(again)
    assert second not in (first, job)
    answer = browser.get(f"/v1/jobs/{job}", headers=bearer(acme_key)).json()
    assert answer["retries"] == [first, second]


def test_a_job_with_nothing_failed_shows_no_button(
    browser: TestClient,  # noqa: F811
    acme_key: str,  # noqa: F811
    sessions: sessionmaker[Session],
) -> None:
    job = submit(browser, acme_key)
    sign_in(browser, acme_key)
    with sessions() as session:
        row = session.get(Job, job)
        assert row is not None
        end(session, row, failed=[])
    assert BUTTON not in browser.get(f"/console/jobs/{job}").text
