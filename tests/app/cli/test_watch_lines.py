"""Following a job (`kiln bulk --watch`, `kiln status --watch`, `kiln submit --wait`): in a
terminal a live bar; without one (cron, `| tee`), where the bar draws nothing, a plain line now
and then — never more done than total, never past 100%."""

from __future__ import annotations

import io
import re
from typing import Any

import pytest
from rich.console import Console

from kiln.app.cli import remote, watch_lines
from kiln.app.cli.watch_lines import LineLog, follow, progress_line


def job(status: str, done: int, total: int = 1487, **more: Any) -> dict[str, Any]:
    counts = {"total": total, "done": done, "succeeded": done, "failed": 0, "cancelled": 0,
              "pending": total - done, "running": 0, "answered": 0, "skipped": 1386,
              "deleted": 30}  # fmt: skip
    return {"id": "4665f751-0000-4000-8000-000000000000", "status": status, "counts": counts,
            "listing": False, "source": {"s3": "s3://photos/2026/"}, "items_per_second": 58.1,
            "eta_seconds": 17.0, **more}  # fmt: skip


def test_a_progress_line_says_done_of_total_and_what_was_left_alone() -> None:
    line = progress_line(job("running", 512))
    assert line == (
        "job 4665f751 running: 512 done of 1,487 (34%), 512 succeeded, 0 failed, 0 running; "
        "58.1 items/s, ETA 0:17; 1,386 unchanged, 30 deleted at source"
    )
    listing = progress_line(job("running", 0, total=40, listing=True, eta_seconds=None))
    assert "running, listing: 0 done of 40 so far (0%)" in listing and "ETA" not in listing


def test_lines_come_on_a_change_of_state_and_every_30_s_while_counts_move() -> None:
    log = LineLog(every_s=30.0, quiet_s=600.0)
    assert log.due(job("queued", 0), 0.0)  # the first
    assert not log.due(job("queued", 0), 5.0)
    assert log.due(job("running", 0), 6.0)  # a new state: at once
    assert not log.due(job("running", 100), 20.0)  # moved, but within 30 s
    assert log.due(job("running", 200), 36.5)
    assert not log.due(job("running", 200), 100.0)  # nothing moved: quiet
    assert log.due(job("running", 200), 636.5)  # ... but not for ever
    assert log.due(job("running", 200, stalled_since="2026-01-01T00:00:00Z"), 637.0)


def test_follow_logs_lines_until_the_job_closes() -> None:
    states = iter([job("running", 100), job("running", 900), job("running", 1400),
                   job("completed", 1487)])  # fmt: skip
    clock = iter([0.0, 10.0, 40.0, 50.0])
    said: list[str] = []
    closed = follow(lambda: next(states), job("queued", 0), said.append,
                    clock=lambda: next(clock), sleep=lambda _s: None)  # fmt: skip
    assert closed["status"] == "completed"
    assert [re.sub(r"^\d\d:\d\d:\d\d ", "", s).split(":")[0] for s in said] == [
        "job 4665f751 queued",  # the first
        "job 4665f751 running",  # a new state
        "job 4665f751 running",  # moved, 30 s on
    ]
    assert all(re.match(r"\d\d:\d\d:\d\d job 4665f751 ", s) for s in said)  # timestamped


class FakeClient:
    """The API as `watch` asks it: the job, as it moves on."""

    def __init__(self, states: list[dict[str, Any]]) -> None:
        self.states = states

    def job(self, _job_id: str) -> dict[str, Any]:
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]


@pytest.fixture
def no_terminal(monkeypatch: pytest.MonkeyPatch) -> tuple[io.StringIO, io.StringIO]:
    """stdout and stderr as under cron or `| tee`: not terminals."""
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(remote, "console", Console(file=out, width=200))
    monkeypatch.setattr(remote, "errors", Console(file=err, width=200))
    monkeypatch.setattr(watch_lines, "POLL_S", 0.0)
    return out, err


def test_watch_without_a_terminal_logs_lines_and_the_summary(
    no_terminal: tuple[io.StringIO, io.StringIO],
) -> None:
    out, err = no_terminal
    client = FakeClient([job("queued", 0, total=0, listing=True), job("running", 700),
                         job("completed", 1487)])  # fmt: skip
    closed = remote.watch(client, "4665f751-0000-4000-8000-000000000000")
    assert closed["status"] == "completed"
    lines = out.getvalue().splitlines()
    assert "job 4665f751 queued, listing: 0 done of 0 so far (0%)" in lines[0]
    assert "job 4665f751 running: 700 done of 1,487 (47%)" in lines[1]
    assert lines[-1].startswith("job 4665f751-0000-4000-8000-000000000000 completed: 1487")
    assert "1,386 unchanged, 30 deleted at source" in lines[-1]
    assert err.getvalue() == ""  # no bar drawn where nobody sees it
