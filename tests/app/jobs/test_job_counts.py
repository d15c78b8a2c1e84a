"""What a job's counts mean together (`kiln.app.jobs.job_counts`): progress over what the run must
do, never past its total, with what a pipeline's rerun left alone shown apart."""

from __future__ import annotations

import pytest

from kiln.app.jobs.job_counts import LEFT_ALONE, done, left_alone, left_alone_text, percent


@pytest.mark.parametrize(
    ("ended", "answered", "total", "expected"),
    [
        (0, 0, 1487, 0),
        (488, 192, 1500, 680),  # a chunk written, rows of running chunks answered
        (90, 0, 90, 90),
        (500, 40, 512, 512),  # a run's rows counted in both for a moment: never past the total
        (0, 5, 0, 0),
    ],
)
def test_done_is_ended_and_answered_never_past_the_total(
    ended: int, answered: int, total: int, expected: int
) -> None:
    assert done(ended, answered, total) == expected


def test_an_incremental_rerun_is_at_most_100_percent() -> None:
    """The issue's rerun: 90 items to do, 1,420 unchanged and 30 deleted left alone. The
    console counted those in done, not in the total: 1,502%."""
    counts = {"total": 90, "skipped": 1420, "deleted": 30}
    for ended in range(0, 91, 15):
        for answered in (0, 10, 90):
            shown = done(ended, answered, counts["total"])
            assert shown <= counts["total"]
            assert 0 <= percent(shown, counts["total"], closed=False) <= 100
    assert percent(done(90, 0, 90), 90, closed=True) == 100
    assert left_alone(counts) == [("unchanged", 1420), ("deleted at source", 30)]


def test_a_run_with_nothing_to_do() -> None:
    """Everything unchanged: nothing to do. Open (still listing, items may come): 0%; closed:
    100%, never a division by zero."""
    assert percent(0, 0, closed=False) == 0
    assert percent(0, 0, closed=True) == 100


def test_percent_never_passes_100_whatever_it_is_given() -> None:
    assert percent(13518, 100, closed=False) == 100
    assert percent(-3, 100, closed=False) == 0
    assert percent(34, 100, closed=False) == pytest.approx(34)


def test_left_alone_reads_what_the_api_gives() -> None:
    """A count the API (or an older one) leaves out is 0; each is named as the CLI and the
    console show it."""
    shown_at_zero = [word for _, word, always in LEFT_ALONE if always]
    assert left_alone({}) == [(word, 0) for word in shown_at_zero]
    assert left_alone({"known_failed": 1, "excluded": 40})[2:] == [
        ("known failure kept", 1),
        ("left out by the filters", 40),
    ]
    assert left_alone_text({"skipped": 3, "known_failed": 11}) == (
        "3 unchanged, 0 deleted at source, 11 known failures kept"
    )
    assert left_alone_text({"skipped": 1386, "deleted": 30}) == (
        "1,386 unchanged, 30 deleted at source"
    )
