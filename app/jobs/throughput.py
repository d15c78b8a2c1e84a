"""Items per second from when items were worked on, not when they were written.

A chunk run writes its rows together (a bulk chunk is 512 items), so counting items at their
write draws a steady job as spikes of hundreds between zeros, and a rate over a window swings
with how many writes fell inside it. Instead each run's items are counted as worked evenly over
the run: from its lease to its write for items written (a `Span` per run: the items share both
times), and from its start to now for rows answered and not yet written.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """`items` worked on from `start` to `end` (seconds since the epoch). A span of no length
    (an item ended without being leased: a job's failure ending what waits) is its end."""

    start: float
    end: float
    items: int


def worked(spans: Iterable[Span], low: float, high: float) -> float:
    """Items worked in (`low`, `high`]: each span's items spread evenly over it."""
    total = 0.0
    for span in spans:
        length = span.end - span.start
        if length <= 0:
            total += span.items if low < span.end <= high else 0
            continue
        overlap = min(high, span.end) - max(low, span.start)
        if overlap > 0:
            total += span.items * overlap / length
    return total


def rate(spans: Iterable[Span], low: float, high: float) -> float | None:
    """Items per second over (`low`, `high`]; None over no time."""
    if high <= low:
        return None
    return worked(spans, low, high) / (high - low)


def series(
    spans: Sequence[Span], start: float, end: float, steps: int
) -> tuple[list[float], list[float]]:
    """Items per second from `start` to `end` in at most `steps` steps of at least a second:
    the times each step ends at, and its rate; first `start` itself at 0, so a job done
    within one step is still a line."""
    width = max(1.0, (end - start) / steps)
    count = max(1, math.ceil((end - start) / width - 1e-9))
    edges = [start + i * width for i in range(count + 1)]
    rates = [worked(spans, low, high) / width for low, high in itertools.pairwise(edges)]
    return edges, [0.0] + [round(r, 2) for r in rates]
