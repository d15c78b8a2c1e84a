"""Counts that add up on the real stack (Postgres, Redis, moto, `kiln api` + `kiln worker`): a
pipeline's incremental rerun, followed with `kiln bulk --watch` without a terminal (its output
piped, as under cron or `| tee`), while the API and the console's pages are read. Progress is
over what the run must do; what its listing left alone (unchanged, deleted) is shown apart:
never done > total, never past 100% (the console said 1502% and 13518%)."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from contextlib import closing
from typing import Any

import httpx

from devstack.services import kiln_command
from devstack.services import service_env as full_env
from tests.integration.test_bulk import put_objects, run_pipeline
from tests.stack import SOURCE_BUCKET, _key

PREFIX = "counts-rerun/"
OBJECTS = 300  # enough that the rerun is seen running, not only queued and closed
CHANGED, DELETED, ADDED = 60, 20, 40


def console_client(api_url: str, key: str) -> httpx.Client:
    """A browser's session: signed in with the key, then only its cookie."""
    http = httpx.Client(base_url=api_url, timeout=60, follow_redirects=True)
    page = http.get("/console/login").text
    token = re.search(r'name="csrf" value="([^"]+)"', page)
    assert token, "the sign-in page has no CSRF field"
    answer = http.post("/console/login", data={"key": key, "csrf": token.group(1)})
    assert answer.status_code == 200 and "Jobs" in answer.text, answer.text[:300]
    return http


def console_progress(page: str) -> list[tuple[int, int, float]]:
    """(done, total, percent) of each job the page shows: the jobs list's rows, or a job's
    summary (`data-done`/`data-total` and its bar)."""
    found = []
    rows = re.findall(
        r'<progress max="100" value="([\d.]+)".*?<td class="num">([\d,]+) / ([\d,]+)', page, re.S
    )
    for percent, done, total in rows:
        found.append((int(done.replace(",", "")), int(total.replace(",", "")), float(percent)))
    bar = r'data-done="(\d+)" data-total="(\d+)".*?<progress max="100" value="([\d.]+)"'
    summary = re.search(bar, page, re.S)
    if summary:
        done, total, percent = summary.groups()
        found.append((int(done), int(total), float(percent)))
    for shown in re.findall(r'<span class="percent">([\d.]+)%</span>', page):
        assert float(shown) <= 100, f"{shown}% shown"
    return found


class Sampler(threading.Thread):
    """Reads the rerun's progress from the API and the console until told to stop."""

    def __init__(self, api: httpx.Client, console: httpx.Client, first: str) -> None:
        super().__init__(daemon=True)
        self.api, self.console = api, console
        self.first = first  # the pipeline's first run: not the one watched
        self.stop = threading.Event()
        self.api_seen: list[tuple[str, int, int]] = []  # (status, done, total)
        self.console_seen: list[tuple[int, int, float]] = []
        self.problems: list[str] = []

    def rerun(self) -> dict[str, Any] | None:
        for job in self.api.get("/v1/jobs", params={"limit": 5}).json()["jobs"]:
            if (job.get("source") or {}).get("s3", "").endswith(PREFIX) and job["id"] != self.first:
                return dict(job)
        return None

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.sample()
            except Exception as error:  # kept for the test's assertion
                self.problems.append(repr(error))
            time.sleep(0.2)

    def sample(self) -> None:
        job = self.rerun()
        if job is None:
            return
        c = job["counts"]
        self.api_seen.append((job["status"], c["done"], c["total"]))
        pages = ["/console/", f"/console/jobs/{job['id']}/summary"]
        for path in pages:
            self.console_seen += console_progress(self.console.get(path).text)


def test_an_incremental_rerun_never_shows_more_done_than_total(
    client: httpx.Client, s3: Any, api_url: str, service_env: dict[str, str], sessions: Any
) -> None:
    keys = [f"{PREFIX}img-{i:04d}.jpg" for i in range(OBJECTS)]
    put_objects(s3, keys, seed=7)
    first = run_pipeline(client, PREFIX, "counts")
    assert first["status"] == "completed" and first["counts"]["total"] == OBJECTS

    put_objects(s3, keys[:CHANGED], seed=8)  # new bytes: new ETags
    gone = keys[CHANGED : CHANGED + DELETED]
    s3.delete_objects(Bucket=SOURCE_BUCKET, Delete={"Objects": [{"Key": k} for k in gone]})
    put_objects(s3, [f"{PREFIX}new/img-{i:04d}.jpg" for i in range(ADDED)], seed=9)
    unchanged = OBJECTS - CHANGED - DELETED

    key = _key(sessions, "acme")
    with closing(console_client(api_url, key)) as console:
        sampler = Sampler(client, console, first["id"])
        watched = watch_rerun(
            sampler, {**service_env, "KILN_API_URL": api_url, "KILN_API_KEY": key}
        )
        rerun = sampler.rerun()
        page = console.get(f"/console/jobs/{rerun['id']}").text if rerun else ""
        listed = console.get("/console/").text
    assert watched.returncode == 0, watched.stdout + watched.stderr
    assert not sampler.problems, sampler.problems

    # The API: progress over the run's items; the left-alone apart.
    assert rerun is not None and rerun["status"] == "completed"
    c = rerun["counts"]
    to_do = CHANGED + ADDED
    assert (c["total"], c["done"], c["succeeded"]) == (to_do, to_do, to_do)
    assert (c["skipped"], c["deleted"]) == (unchanged, DELETED)
    assert sampler.api_seen and all(done <= total for _, done, total in sampler.api_seen)
    assert sampler.api_seen[-1] == ("completed", to_do, to_do)

    # The console: the jobs list and the job's page, while it ran and once closed.
    assert sampler.console_seen
    for done, total, percent in sampler.console_seen:
        assert done <= total and percent <= 100, (done, total, percent)
    assert (to_do, to_do, 100.0) in console_progress(page)
    assert f"<dt>Unchanged (not in total)</dt><dd>{unchanged}</dd>" in page
    assert f"<dt>Deleted at source (not in total)</dt><dd>{DELETED}</dd>" in page
    assert (to_do, to_do, 100.0) in console_progress(listed)
    assert f"{unchanged} unchanged, {DELETED} deleted at source" in listed

    # `--watch` without a terminal: timestamped progress lines, then the summary.
    lines = watched.stdout.splitlines()
    progress = [line for line in lines if re.match(r"\d\d:\d\d:\d\d job [0-9a-f]{8} ", line)]
    assert progress, watched.stdout
    for line in progress:
        found = re.search(r"([\d,]+) done of ([\d,]+)", line)
        assert found, line
        done, total = (int(n.replace(",", "")) for n in found.groups())
        assert done <= total, line
    summary = " ".join(watched.stdout.split())  # rich wraps a long line
    assert f"completed: {to_do} succeeded" in summary
    assert f"{unchanged} unchanged, {DELETED} deleted at source" in summary
    assert "━" not in watched.stderr  # no bar drawn where nobody sees it


def watch_rerun(sampler: Sampler, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`kiln bulk --name counts --watch` with its output piped (no terminal, as under cron),
    sampled all along, and once more when it has returned."""
    command = kiln_command(
        "bulk", f"s3://{SOURCE_BUCKET}/{PREFIX}", "--model", "phash", "--name", "counts",
        "--include", "*.jpg", "--watch",
    )  # fmt: skip
    sampler.start()
    try:
        return subprocess.run(
            command, env=full_env(env), capture_output=True, text=True, timeout=300, check=False
        )
    finally:
        sampler.stop.set()
        sampler.join(30)
        sampler.sample()  # once more, closed
