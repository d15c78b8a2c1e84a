"""The exit status of a job waited for (app/cli/verdict.py), as a cron wrapper reads it: 1 for
a failed or cancelled job, a bucket source that matched nothing, or items none of which
succeeded; 0 otherwise — a pipeline's night with nothing new, or whose only failures are the
known ones it kept, included."""

from __future__ import annotations

from typing import Any

import pytest

from kiln.app.cli.verdict import Ended, Kind, decide

PHOTOS = {"s3": "s3://photos/2026/", "include": [], "exclude": [], "case_sensitive": False}


def bulk(**counts: Any) -> Ended:
    source = counts.pop("source", PHOTOS)
    return Ended("completed", source=source, **counts)


def test_a_job_that_failed_exits_1_with_its_error() -> None:
    decided = decide(Ended("failed", error="The bucket 'x' does not exist."))
    assert (decided.code, decided.kind) == (1, Kind.FAILED)
    assert decided.sentence == "the job failed: The bucket 'x' does not exist."


def test_a_cancelled_job_exits_1() -> None:
    decided = decide(Ended("cancelled", total=9, succeeded=3, cancelled=6))
    assert (decided.code, decided.kind) == (1, Kind.CANCELLED)
    assert decided.sentence == "The job was cancelled: 3 items succeeded before it was."


def test_items_that_ran_none_succeeding_exit_1_and_ask_for_the_first_error() -> None:
    decided = decide(Ended("completed", total=2, failed=2))
    assert (decided.code, decided.kind, decided.first_error) == (1, Kind.NONE_SUCCEEDED, True)
    assert decided.sentence == "no item succeeded (2 failed)."
    local = decide(Ended("completed", total=2, failed=2), results="out.parquet")
    assert local.sentence == "no item succeeded (2 of 2 failed; each error is in out.parquet)."


def test_new_failures_only_exit_1_though_known_ones_were_kept() -> None:
    decided = decide(bulk(total=3, failed=3, skipped=40, known_failed=11))
    assert (decided.code, decided.kind) == (1, Kind.NONE_SUCCEEDED)
    assert decided.sentence == "no item succeeded (3 failed; 11 known failures kept)."


@pytest.mark.parametrize(
    "ended",
    [
        Ended("completed", total=3, succeeded=2, failed=1),
        bulk(total=5, succeeded=5, skipped=1000, known_failed=11),  # old failures, kept
        bulk(total=5, succeeded=4, failed=1, known_failed=11),
    ],
)
def test_a_job_with_any_success_exits_0_silently(ended: Ended) -> None:
    assert decide(ended) == decide(Ended("completed", total=1, succeeded=1))
    assert decide(ended).sentence is None and decide(ended).code == 0


def test_a_night_with_only_known_failures_left_exits_0_and_says_nothing_new() -> None:
    decided = decide(bulk(known_failed=11))
    assert (decided.code, decided.kind) == (0, Kind.NOTHING_NEW)
    assert decided.sentence == (
        "nothing new; 11 known failures kept (--retry-failed runs the known failures again)"
    )


def test_a_night_with_nothing_changed_exits_0() -> None:
    decided = decide(bulk(skipped=1386, deleted=2, known_failed=1))
    assert (decided.code, decided.kind) == (0, Kind.NOTHING_NEW)
    assert decided.sentence == (
        "nothing new; 1 known failure kept, 1386 unchanged, 2 deleted "
        "(--retry-failed runs the known failures again)"
    )
    assert decide(bulk(skipped=5)).sentence == "nothing new; 5 unchanged"


def test_a_prefix_that_lists_nothing_exits_1_with_a_sentence() -> None:
    decided = decide(bulk())
    assert (decided.code, decided.kind) == (1, Kind.MATCHED_NOTHING)
    assert decided.sentence == (
        "s3://photos/2026/ matched no object: nothing is listed under that prefix."
    )


def test_filters_that_leave_everything_out_exit_1_naming_them() -> None:
    source = {**PHOTOS, "include": ["*.jpg", "*.jpeg"], "exclude": ["tmp dir/*"]}
    decided = decide(bulk(source=source, excluded=40))
    assert (decided.code, decided.kind) == (1, Kind.MATCHED_NOTHING)
    assert decided.sentence == (
        "s3://photos/2026/ with --include '*.jpg' --include '*.jpeg' --exclude 'tmp dir/*' "
        "matched no object (40 listed, 40 left out by the filters)."
    )
    strict = decide(bulk(source={**source, "case_sensitive": True}, excluded=40))
    assert strict.sentence is not None and "--case-sensitive matched no object" in strict.sentence


def test_a_pipeline_whose_every_object_was_deleted_matched_nothing() -> None:
    decided = decide(bulk(deleted=30))
    assert (decided.code, decided.kind) == (1, Kind.MATCHED_NOTHING)
    assert decided.sentence is not None and "prefix (the pipeline's 30 objects are gone)." in (
        decided.sentence
    )


def test_an_answer_of_the_api_reads_as_what_the_job_ended_as() -> None:
    job = {
        "status": "completed",
        "error": None,
        "source": PHOTOS,
        "counts": {"total": 0, "succeeded": 0, "failed": 0, "cancelled": 0, "known_failed": 11},
    }
    assert decide(Ended.of_job(job)).kind == Kind.NOTHING_NEW
    older = {**job, "counts": {"total": 0, "succeeded": 0, "failed": 0, "cancelled": 0}}
    assert decide(Ended.of_job(older)).kind == Kind.MATCHED_NOTHING  # an API before the field
