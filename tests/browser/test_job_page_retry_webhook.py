"""The console's job page for issue 40's parts, in a real headless Chromium against the stack
that sends webhooks (tests/stack.py `webhook_stack`): a closed job with failed items offers
"Retry failed items", the click makes the retry job and the two pages link to each other; a
job's webhook shows its deliveries, a failed attempt then the delivery, without a reload."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import expect

import kiln
from devstack.images import solid
from tests.browser.conftest import Watched, screenshot, sign_in, thumbs_loaded
from tests.browser.test_console import mark, not_reloaded
from tests.integration.test_python_client import Receiver
from tests.stack import WebhookStack

CLOSED = re.compile(r"^(completed|failed|cancelled)$")


@pytest.fixture(scope="module")
def console_key(webhook_stack: WebhookStack) -> str:
    return webhook_stack.key("console40")


@pytest.fixture(scope="module")
def py(webhook_stack: WebhookStack, console_key: str) -> Iterator[kiln.Client]:
    with kiln.Client(webhook_stack.url, console_key) as client:
        yield client


def test_retry_failed_items_from_the_job_page(
    watched: Watched, webhook_stack: WebhookStack, console_key: str, py: kiln.Client, log_dir: Path
) -> None:
    page, url = watched.page, webhook_stack.url
    files = [(f"ok-{n}.png", solid((30 * n, 90, 60))) for n in range(3)]
    files += [("torn.jpg", b"\xff\xd8 cut short"), ("bent.jpg", b"\xff\xd8 also cut")]
    sign_in(page, url, console_key)
    job = py.submit("phash", files=files)
    page.goto(f"{url}/console/jobs/{job.id}")  # at once: watched until it closes
    mark(page)
    expect(page.locator("#summary")).to_have_attribute("data-status", CLOSED, timeout=60_000)
    button = page.get_by_role("button", name="Retry failed items (2)")
    expect(button).to_be_visible()  # offered as the job closes, without a reload
    assert not_reloaded(page)
    job = py.job(job)
    assert (job.status, job.counts.succeeded, job.counts.failed) == ("completed", 3, 2)
    thumbs_loaded(page)
    screenshot(page, "retry-1-original-before", log_dir, full_page=True)
    button.click()

    expect(page).not_to_have_url(re.compile(rf".*/console/jobs/{job.id}$"))  # to the new job
    retry_id = page.url.rsplit("/", 1)[1]
    assert py.job(retry_id).retry_of == job.id and py.job(job).retries == [retry_id]
    back = page.locator("p.links", has_text="Retries the failed items of").get_by_role("link")
    expect(back).to_have_text(job.id[:8])
    expect(page.locator("#summary")).to_have_attribute("data-status", CLOSED, timeout=60_000)
    expect(page.locator("#items figure.item")).to_have_count(2)  # the two failed, again
    expect(page.get_by_role("button", name="Retry failed items (2)")).to_be_visible()
    screenshot(page, "retry-2-new-job", log_dir, full_page=True)

    back.click()
    expect(page).to_have_url(re.compile(rf".*/console/jobs/{job.id}$"))
    forward = page.locator("p.links", has_text="Retried by").get_by_role("link")
    expect(forward).to_have_text(retry_id[:8])
    expect(forward).to_have_attribute("href", f"/console/jobs/{retry_id}")
    screenshot(page, "retry-3-original-after", log_dir, full_page=True)
    assert not watched.problems


def test_a_job_s_webhook_deliveries_on_its_page(
    watched: Watched, webhook_stack: WebhookStack, console_key: str, py: kiln.Client, log_dir: Path
) -> None:
    page, url = watched.page, webhook_stack.url
    receiver = Receiver(py.webhook_secret(), fail_first=1)  # a 500 first: Kiln tries again
    try:
        sign_in(page, url, console_key)
        hook = {"url": receiver.url, "events": ["completed", "failed"]}
        job = py.submit(
            "phash", files=[(f"h-{n}.png", solid((n, 7, 7))) for n in range(4)], notify=hook
        )
        page.goto(f"{url}/console/jobs/{job.id}")
        expect(page.locator("#webhook")).to_contain_text(receiver.url)
        row = page.locator("#webhook tr.delivery")
        expect(row).to_have_class(re.compile(r"\bdelivered\b"), timeout=60_000)  # no reload
        cells = row.locator("td")
        expect(cells.nth(0)).to_have_text("completed")
        expect(cells.nth(2)).to_have_text("delivered")
        expect(cells.nth(3)).to_have_text("2")  # the 500, then the delivery
        expect(cells.nth(4)).to_have_text("HTTP 204")
        delivery = cells.nth(1).inner_text()
        assert receiver.seen == [delivery, delivery] and list(receiver.events) == [delivery]
        thumbs_loaded(page)
        screenshot(page, "webhook-deliveries", log_dir, full_page=True)
    finally:
        receiver.stop()
    assert not watched.problems
