"""What a job's counts mean together: the one reading the API, the CLI and the console share.

A job's `total` is what its run must do: its items. Its progress is the items that ended
(succeeded, failed or cancelled) plus those answered whose chunk has not written them yet, over
that total — never more than the total, so never past 100%. A bulk run over a pipeline also
says what its listing left alone: objects unchanged since the pipeline's last run (`skipped`),
objects gone since then (`deleted`), unchanged objects that failed before and are kept as they
are (`known_failed`) and objects the filters left out (`excluded`). They are not items: they
are in neither the total nor the progress, and are shown beside them.
"""

from __future__ import annotations

from collections.abc import Mapping

# Each count of objects a run left alone, what a person calls it, and whether it is shown when
# 0, in the order shown. Unchanged and deleted say what a rerun is; the rarer two only when they
# happened.
LEFT_ALONE: tuple[tuple[str, str, bool], ...] = (
    ("skipped", "unchanged", True),
    ("deleted", "deleted at source", True),
    ("known_failed", "known failure{s} kept", False),  # failed before, unchanged: not run again
    ("excluded", "left out by the filters", False),
)


def done(ended: int, answered: int, total: int) -> int:
    """Items ended and items answered but not yet written, never more than `total` (a guard:
    `jobs.progress` reads the two so they agree, a chunk's rows in one or the other)."""
    return max(0, min(total, ended + answered))


def percent(done: int, total: int, closed: bool) -> float:
    """`done` of `total` in percent, never past 100. A job with nothing to do is at 0 while
    it may still get items (it is open), and at 100 once closed."""
    if total <= 0:
        return 100.0 if closed else 0.0
    return min(100.0, 100.0 * max(0, done) / total)


def left_alone(counts: Mapping[str, object]) -> list[tuple[str, int]]:
    """(what it is called, how many) for each count of objects the run left alone, in
    `LEFT_ALONE` order; a count `counts` lacks is 0, and a rarer one that is 0 is not shown."""
    found = [(word, _number(counts.get(name)), always) for name, word, always in LEFT_ALONE]
    return [(word.format(s="" if n == 1 else "s"), n) for word, n, always in found if always or n]


def left_alone_text(counts: Mapping[str, object]) -> str:
    """`1,386 unchanged, 30 deleted at source`: what a run left alone, in a sentence's words."""
    return ", ".join(f"{n:,} {word}" for word, n in left_alone(counts))


def _number(value: object) -> int:
    return value if isinstance(value, int) else 0
