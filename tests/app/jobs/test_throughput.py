"""Items per second from when items were worked on (`kiln.app.jobs.throughput`): a steady job whose
chunks write hundreds of rows at once is a steady line, not spikes between zeros."""

from __future__ import annotations

import pytest

from kiln.app.jobs.throughput import Span, rate, series, worked


def chunks(per_second: float, size: int, workers: int, seconds: float) -> list[Span]:
    """A steady job: `workers` runs at once, each writing `size` rows every `size /
    (per_second / workers)` seconds, staggered."""
    each = size / (per_second / workers)
    spans = []
    for worker in range(workers):
        start = worker * each / workers
        while start + each <= seconds:
            spans.append(Span(start, start + each, size))
            start += each
    return spans


def test_a_steady_job_is_a_steady_line() -> None:
    """58 items/s in 512-row chunks on 4 workers: written, that is 512 rows every ~9 s, which
    in 5 s steps drew ~100/s and zeros. Spread over each run it is ~58/s in every step."""
    spans = chunks(58.0, 512, 4, 600.0)
    t, rates = series(spans, 0.0, 600.0, 120)
    assert t[0] == 0 and rates[0] == 0  # the line starts at the job's start, at 0
    middle = rates[30:100]  # past the staggered start, before the last runs' end
    assert min(middle) == pytest.approx(58.0, rel=0.05)
    assert max(middle) == pytest.approx(58.0, rel=0.05)


def test_every_item_is_counted_once() -> None:
    spans = [Span(0.0, 30.0, 512), Span(10.0, 50.0, 300), Span(42.0, 42.0, 7)]
    t, rates = series(spans, 0.0, 60.0, 60)
    width = t[1] - t[0]
    assert sum(rates) * width == pytest.approx(819, abs=0.5)
    assert worked(spans, 0.0, 60.0) == pytest.approx(819)


def test_a_window_counts_only_its_share_of_a_run() -> None:
    """A run leased 100 s ago and written 40 s ago: a third of its 60 s is in the last
    minute; rows answered in a run still going (30 in 30 s) all are."""
    spans = [Span(0.0, 60.0, 60), Span(70.0, 100.0, 30)]
    assert rate(spans, 40.0, 100.0) == pytest.approx((20 + 30) / 60)


def test_an_item_ended_without_a_lease_counts_at_its_end() -> None:
    spans = [Span(5.0, 5.0, 3)]
    assert worked(spans, 0.0, 5.0) == 3
    assert worked(spans, 5.0, 10.0) == 0  # (low, high]: once, not in both steps
    assert rate(spans, 5.0, 5.0) is None  # no time, no rate


def test_a_job_done_within_a_second_is_still_a_line() -> None:
    t, rates = series([Span(0.0, 0.4, 10)], 0.0, 0.4, 60)
    assert len(t) == len(rates) == 2 and rates == [0.0, 10.0]
