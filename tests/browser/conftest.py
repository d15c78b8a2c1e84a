"""A real headless Chromium (Debian's, installed by `make test`: scripts/ensure-browser.sh)
driven by Playwright's Python API against the real stack (tests/stack.py). Playwright never
downloads a browser here: it is pointed at the system's `chromium`."""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page, Playwright, sync_playwright

from tests.stack import unavailable

SCREENSHOTS = os.environ.get("KILN_SCREENSHOTS")  # a folder: refresh docs/screenshots there
VIEWPORT = {"width": 1280, "height": 860}


def chromium_path() -> str:
    found = os.environ.get("KILN_CHROMIUM") or shutil.which("chromium")
    if not found:
        unavailable("No chromium on PATH (Debian: apt-get install chromium; make test does).")
    return found


# Package scope, not session: Playwright's sync API keeps an event loop running in this
# thread while it lives, and later tests that call asyncio.run() would find it.
@pytest.fixture(scope="package")
def playwright() -> Iterator[Playwright]:
    with sync_playwright() as driver:
        yield driver


@pytest.fixture(scope="package")
def browser(playwright: Playwright) -> Iterator[Browser]:
    # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start
    launched = playwright.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
    yield launched
    launched.close()


class Watched:
    """A page and what went wrong on it: script errors and Content-Security-Policy refusals."""

    def __init__(self, page: Page) -> None:
        self.page = page
        self.logged: list[str] = []
        page.on("pageerror", lambda error: self.logged.append(f"script error: {error}"))
        page.on("console", self._console)

    def _console(self, message: object) -> None:
        text = getattr(message, "text", "")
        if getattr(message, "type", "") == "error" and "Failed to load resource" not in text:
            self.logged.append(text)

    @property
    def problems(self) -> list[str]:
        """What was logged, less a request htmx itself cancelled for a newer one (a refresh in
        flight when a filter is clicked): it logs the abort and that request's end as errors,
        though nothing failed. Seen on a loaded machine."""
        aborted = {text.removeprefix("htmx:sendAbort") for text in self.logged
                   if text.startswith("htmx:sendAbort")}  # fmt: skip
        return [
            text for text in self.logged
            if not text.startswith("htmx:sendAbort")
            and text.removeprefix("htmx:afterRequest") not in aborted
        ]  # fmt: skip


@pytest.fixture
def watched(browser: Browser) -> Iterator[Watched]:
    context = browser.new_context(viewport=VIEWPORT)  # type: ignore[arg-type]
    page = context.new_page()
    page.set_default_timeout(30_000)
    watched = Watched(page)
    yield watched
    context.close()


def key_of(client: httpx.Client) -> str:
    return str(client.headers["Authorization"]).removeprefix("Bearer ")


def sign_in(page: Page, api_url: str, key: str) -> None:
    page.goto(f"{api_url}/console/login")
    page.fill("input[name=key]", key)
    page.click("form button[type=submit]")
    page.wait_for_url(re.compile(r".*/console/$"))


def screenshot(page: Page, name: str, log_dir: Path, full_page: bool = False) -> None:
    """Into the test log (always), and into `KILN_SCREENSHOTS` when refreshing the docs'."""
    for folder in [log_dir / "screenshots", *([Path(SCREENSHOTS)] if SCREENSHOTS else [])]:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{name}.jpg"
        page.screenshot(path=path, type="jpeg", quality=70, full_page=full_page)


def thumbs_loaded(page: Page, timeout_s: float = 30.0) -> None:
    """Wait until every thumbnail on the page has loaded. Polled from here: the console's
    Content-Security-Policy forbids the `eval` that `wait_for_function` uses."""
    check = "() => [...document.querySelectorAll('img.thumb')].every(i => i.naturalWidth > 0)"
    deadline = time.monotonic() + timeout_s
    while not page.evaluate(check):
        if time.monotonic() > deadline:
            raise AssertionError(f"thumbnails still loading after {timeout_s:.0f} s")
        page.wait_for_timeout(100)
