"""The knobs of one Batcher, fixed when it is built and checked once."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchPolicy:
    """How a Batcher cuts, paces and guards its batches.

    - `max_batch`: rows per batch at most (an out-of-memory batch lowers the live cap below it);
    - `max_delay_s`: how long a partial batch waits after its first row;
    - `runners`: threads running batches at once;
    - `greedy`: a partial batch waits only while announced rows are still on their way;
    - `max_queued`: `submit` blocks while that many bulk rows wait (None: never);
    - `deadline_s`: a batch running longer is failed and its runner replaced (None: no watch);
    - `oom_recovery_s`: a cap lowered by an out-of-memory batch doubles back once per quiet
      period this long (None: it stays lowered).
    """

    max_batch: int
    max_delay_s: float
    runners: int = 1
    greedy: bool = False
    max_queued: int | None = None
    deadline_s: float | None = None
    oom_recovery_s: float | None = None

    def __post_init__(self) -> None:
        if (
            self.max_batch < 1
            or self.runners < 1
            or self.max_delay_s < 0
            or (self.max_queued is not None and self.max_queued < 1)
        ):
            raise ValueError("max_batch, runners and max_queued must be >= 1, max_delay_s >= 0.")
