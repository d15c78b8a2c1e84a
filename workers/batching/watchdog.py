"""The deadline watchdog, for a fleet that runs for weeks: a batch that runs past
`deadline_s` (a wedged GPU call, a deadlocked engine) has its blocks failed with
`BatchDeadlineError`, a transient error, a fresh runner is started in the stuck one's place
(a thread cannot be interrupted) and `on_wedged` is told — the worker then reports itself
unhealthy — and told again, with None, once no batch is stuck any more."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic

from kiln.workers.batching.blocks import B, R, Taken, settle
from kiln.workers.batching.errors import BatchDeadlineError
from kiln.workers.batching.stats import Tally

log = logging.getLogger(__name__)

Wedged = Callable[[str | None], None]  # a sentence when stuck, None when it recovers


@dataclass
class Running(Generic[B, R]):
    """A batch a runner is executing, watched for its deadline."""

    batch: Sequence[Taken[B, R]]
    started: float
    expired: bool = False


class Watchdog(Generic[B, R]):
    """The batches being run, by runner thread; with a deadline, a thread that expires them."""

    def __init__(
        self, name: str, deadline_s: float | None, on_wedged: Wedged | None, tally: Tally
    ) -> None:
        self.name = name
        self.deadline_s = deadline_s
        self._on_wedged = on_wedged
        self._tally = tally
        self._running: dict[int, Running[B, R]] = {}  # runner thread id → its batch
        self._lock = threading.Lock()

    def start(self, closed: Callable[[], bool], replace_runner: Callable[[], None]) -> None:
        """Watch, until `closed()`, if there is a deadline; `replace_runner` starts a runner
        in a stuck one's place."""
        if self.deadline_s is not None:
            thread = threading.Thread(
                target=self._watch,
                args=(self.deadline_s, closed, replace_runner),
                name=f"{self.name}-watchdog",
                daemon=True,
            )
            thread.start()

    @contextmanager
    def watching(self, batch: Sequence[Taken[B, R]], started: float) -> Iterator[Running[B, R]]:
        """This runner thread runs `batch`; `expired` is set on what it yields if the watchdog
        failed it meanwhile (the runner then retires: another took its place)."""
        running: Running[B, R] = Running(batch, started)
        with self._lock:
            self._running[threading.get_ident()] = running
        try:
            yield running
        finally:
            with self._lock:
                del self._running[threading.get_ident()]
                still_stuck = any(r.expired for r in self._running.values())
        if running.expired:
            log.warning("%s: a batch past its deadline returned after %.0f s", self.name,
                        time.monotonic() - started)  # fmt: skip
            if not still_stuck and self._on_wedged is not None:
                self._on_wedged(None)

    def _watch(
        self, deadline_s: float, closed: Callable[[], bool], replace_runner: Callable[[], None]
    ) -> None:
        interval = max(0.01, min(1.0, deadline_s / 4))
        while True:
            time.sleep(interval)
            if closed():
                return
            for running in self._expire(time.monotonic() - deadline_s):
                self._fail(running, deadline_s)
                replace_runner()

    def _expire(self, started_before: float) -> list[Running[B, R]]:
        """Mark every batch started before `started_before` expired, once; return them."""
        with self._lock:
            stuck = [
                r for r in self._running.values() if not r.expired and r.started < started_before
            ]
            for running in stuck:
                running.expired = True
        for _ in stuck:
            self._tally.expired()
        return stuck

    def _fail(self, running: Running[B, R], deadline_s: float) -> None:
        rows = sum(len(t) for t in running.batch)
        sentence = (
            f"{self.name}: a batch of {rows} has run for more than "
            f"{deadline_s:g} s; the engine looks stuck."
        )
        log.error(sentence, extra={"batcher": self.name, "batch_size": rows})
        if self._on_wedged is not None:  # first: a caller woken below finds it reported
            self._on_wedged(sentence)
        for taken in running.batch:  # before a new runner could take their later rows
            settle(taken.queued.future, error=BatchDeadlineError(sentence))
