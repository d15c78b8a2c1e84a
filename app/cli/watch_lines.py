"""A job followed without a terminal (cron, `| tee`, a CI log): a plain line now and then in
place of the live bar, which draws nothing there — a night's run would say nothing for hours.

A line when the job's state changes (queued, listing, running, stalled, no worker, closed),
every `every_s` while its counts move, and every `quiet_s` while nothing does (so a stuck
night still shows it was watched)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from kiln.app.jobs import job_counts

EVERY_S = 30.0  # at most this often while the counts move
QUIET_S = 600.0  # at least this often while nothing does
POLL_S = 2.0  # how often the job is asked


def progress_line(job: dict[str, Any]) -> str:
    """`job 4665f751 running: 512 done of 1,487 (34%), 500 succeeded, 12 failed, 40 running;
    58.1 items/s, ETA 0:17; 1,386 unchanged, 30 deleted at source`."""
    c = job["counts"]
    total, done = c["total"], c.get("done", 0)
    closed = job["status"] in ("completed", "failed", "cancelled")
    share = job_counts.percent(done, total, closed)
    state, so_far = (
        (f"{job['status']}, listing", " so far") if job.get("listing") else (job["status"], "")
    )
    line = (
        f"job {job['id'][:8]} {state}: {done:,} done of {total:,}{so_far} ({share:.0f}%), "
        f"{c['succeeded']:,} succeeded, {c['failed']:,} failed, {c.get('running', 0):,} running"
    )
    if c.get("cancelled"):
        line += f", {c['cancelled']:,} cancelled"
    if not closed:
        line += f"; {job.get('items_per_second') or 0:.1f} items/s"
        if (eta := job.get("eta_seconds")) is not None:
            line += f", ETA {int(eta) // 60}:{int(eta) % 60:02d}"
    if job.get("source"):
        line += f"; {job_counts.left_alone_text(c)}"
    if job.get("stalled_since"):
        line += "; stalled (a worker holding items stopped)"
    if job.get("waiting_for_worker"):
        line += "; no worker is running"
    return line


@dataclass
class LineLog:
    """When a follower without a terminal writes a line."""

    every_s: float = EVERY_S
    quiet_s: float = QUIET_S
    _state: tuple[Any, ...] | None = field(default=None, init=False)
    _counts: tuple[Any, ...] | None = field(default=None, init=False)
    _at: float = field(default=0.0, init=False)

    def due(self, job: dict[str, Any], now: float) -> bool:
        """Whether `job`, as asked at `now` (seconds, monotonic), is worth a line; if so it
        is taken as written."""
        state = (job["status"], bool(job.get("listing")), bool(job.get("stalled_since")),
                 bool(job.get("waiting_for_worker")))  # fmt: skip
        counts = tuple(sorted(job["counts"].items()))
        waited = now - self._at
        due = (
            self._state != state
            or (counts != self._counts and waited >= self.every_s)
            or waited >= self.quiet_s
        )
        if due:
            self._state, self._counts, self._at = state, counts, now
        return due


def follow(
    ask: Callable[[], dict[str, Any]],
    job: dict[str, Any],
    say: Callable[[str], None],
    log: LineLog | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Ask for the job (`ask`) until it closes, saying a timestamped line (`say`) whenever
    `log` finds one due; the closed job (its summary is the caller's to print)."""
    log = log or LineLog()
    while job["status"] not in ("completed", "failed", "cancelled"):  # closed: the summary says
        if log.due(job, clock()):
            say(f"{datetime.now().astimezone():%H:%M:%S} {progress_line(job)}")
        sleep(POLL_S)
        job = ask()
    return job
