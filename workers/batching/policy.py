"""The knobs of one Batcher, fixed when it is built and checked once; and the greedy, bounded
policy every model's Batchers share (`queued_policy`).

Every model's Batcher is greedy (chunks announce their rows, see `workers/chunk`) and lets rows
queue at most QUEUED_BATCHES batches per runner ahead of the engine: object rows (OCR pages)
are big, and rows queued further ahead only hold memory and slots.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.app.core.config import Settings

QUEUED_BATCHES = 4  # rows may run this many batches ahead of the engine (per runner)


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


def queued_policy(settings: Settings, max_batch: int, runners: int) -> BatchPolicy:
    """Batches of `max_batch` rows, or fewer after the worker's `max_delay_s`, run by
    `runners` threads; greedy, and bounded at QUEUED_BATCHES batches per runner."""
    return BatchPolicy(
        max_batch=max_batch,
        max_delay_s=settings.max_delay_s,
        runners=runners,
        greedy=True,
        max_queued=QUEUED_BATCHES * max_batch * runners,
    )
