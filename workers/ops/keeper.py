"""Keep every chunk run's lease alive while it works, and notice a cancel or a lost lease.

One thread per worker process (`Leases`) renews the leases of every run it holds in one
statement every `lease_renew_s` (rewriting only the items whose lease runs low: each row every
few renewals, still well within what a reader takes for a stopped run), and reads their jobs'
statuses every `cancel_check_s` (one statement), so a cancel reaches a running chunk within
about a second: the run is woken (`Held.on_stop`) and stops its work that no batch has taken.
A renewal that fails (the database is restarting) is retried at the next tick: the lease is
long enough to ride out a short outage, and if it does run out, another run takes the items
and this run's results are discarded.

Renewal is bounded: a run older than `max_s` (a deadlocked thread, an engine call that never
returns) is no longer renewed — its lease runs out and the reconciler gives its items to
another run — and the worker's `health` says so until the run ends, so a liveness probe
restarts a worker whose run never does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy.orm import Session, sessionmaker

from kiln.app.db import chunk_runs, leases
from kiln.app.db.chunk_runs import RunTally
from kiln.app.db.models import JobStatus, utcnow
from kiln.app.db.session import unit_of_work
from kiln.app.jobs.jobs import LeaseTiming
from kiln.workers.ops.health import Health

log = logging.getLogger(__name__)


@dataclass
class Held:
    """One chunk run's lease, as the keeper sees it."""

    job_id: str
    owner: str
    # False for a run that leased nothing (a replay that only heals shards and the manifest):
    # nothing to renew, and holding nothing is not losing.
    watched: bool = True
    # Set once its results are being written: they end its items' lease, which is no loss.
    writing: bool = False
    started: float = field(default_factory=time.monotonic)
    started_at: datetime = field(default_factory=utcnow)
    answered: int = 0  # rows answered (or failed) and not yet written: published as progress
    cancelled: threading.Event = field(default_factory=threading.Event)  # stop taking work
    lost: threading.Event = field(default_factory=threading.Event)  # another run has the items

    _wakers: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def stopping(self) -> bool:
        return self.cancelled.is_set() or self.lost.is_set()

    def on_stop(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Call `wake` (from the keeper's thread) when the run must stop; returns the undo."""
        self._wakers.append(wake)
        if self.stopping():
            wake()
        return lambda: self._wakers.remove(wake)

    def stop(self, reason: threading.Event) -> None:
        """Set `reason` (cancelled or lost) and wake whoever waits on this run."""
        if reason.is_set():
            return
        reason.set()
        for wake in list(self._wakers):
            wake()

    @property
    def health_key(self) -> str:
        return f"run:{self.owner}"


def _keep_s(lease_s: float, renew_s: float) -> float:
    """How much lease left spares an item's row its rewrite (`leases.renew_many`). A reader
    takes a lease unrenewed for `LeaseTiming.stale_s` (12 s by default) for a stopped run, so
    a row is rewritten at the latest a tick before that, and never with less than half its
    lease left: with the defaults every 9 s, not every 3 s."""
    stale_s = LeaseTiming(lease_s, renew_s).stale_s
    return max(lease_s / 2, lease_s - (stale_s - 2 * renew_s))


class Leases:
    """The process's one lease keeper; `hold` registers a run for as long as it works."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        lease_s: float,
        renew_s: float,
        max_s: float = float("inf"),
        health: Health | None = None,
        cancel_check_s: float | None = None,
    ) -> None:
        self.lease_s, self.renew_s, self.max_s = lease_s, renew_s, max_s
        self.check_s = min(renew_s, cancel_check_s or renew_s)
        self.keep_s = _keep_s(lease_s, renew_s)
        self._renewed = 0.0  # monotonic time of the last renewal
        self._published: dict[str, int] = {}  # owner → answered, as last published
        self._ended: list[str] = []  # runs gone since the last tick: their progress rows go
        self.health = health or Health()
        self._sessions = sessions
        self._held: dict[str, Held] = {}  # by owner
        self._lock = threading.Lock()
        self._wake = threading.Event()  # close() ends the thread at once
        self._thread: threading.Thread | None = None
        self._closed = False

    @contextmanager
    def hold(self, job_id: str, owner: str, watched: bool = True) -> Iterator[Held]:
        held = Held(job_id, owner, watched)
        with self._lock:
            self._held[owner] = held
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="kiln-leases", daemon=True)
                self._thread.start()
        try:
            yield held
        finally:
            with self._lock:
                self._held.pop(owner, None)
                if self._published.pop(owner, None) is not None:
                    self._ended.append(owner)
            self.health.clear(held.health_key)

    def renew_once(self) -> None:
        """One tick: every held lease pushed out in one statement; cancels and losses seen."""
        self._tick(renew=True)

    def _tick(self, renew: bool) -> None:
        """Read the held runs' job statuses (a cancel stops them); with `renew`, also push out
        their leases in one statement (a run whose items are gone has lost them)."""
        with self._lock:
            runs = [h for h in self._held.values() if h.watched and not self._overran(h)]
            ended, self._ended = self._ended, []
            tallies = self._progress(runs, renew)
            # A run writing its results publishes no more (its write deletes its row), but its
            # row stays fresh: a slow write must not drop its rows from the job's progress.
            writing = [h.owner for h in runs if h.writing] if renew else []
        if not runs and not ended:
            return
        with self._sessions() as session, unit_of_work(session):
            owners = [h.owner for h in runs]
            held = leases.renew_many(session, owners, self.lease_s, self.keep_s) if renew else {}
            statuses = leases.job_statuses(session, {h.job_id for h in runs})
            chunk_runs.forget(session, ended)
            chunk_runs.publish(session, tallies)
            chunk_runs.touch(session, writing)
        if renew:
            self._renewed = time.monotonic()
        for run in runs:
            if statuses.get(run.job_id) == JobStatus.CANCELLING:
                run.stop(run.cancelled)
            if renew and not held.get(run.owner):
                with self._lock:  # a run ending, or writing its results, holds nothing
                    still = run.owner in self._held and not run.writing
                if still:
                    log.warning("chunk run %s of job %s lost its lease", run.owner, run.job_id)
                    run.stop(run.lost)

    def _progress(self, runs: list[Held], renew: bool) -> list[RunTally]:
        """Under `_lock`: the runs whose answered rows changed (all of them on a renewal tick,
        so a job's reader sees them alive), less those writing their results (which delete
        their row)."""
        tallies = []
        for run in runs:
            if run.writing or not run.answered:
                continue
            if renew or self._published.get(run.owner) != run.answered:
                self._published[run.owner] = run.answered
                tallies.append(RunTally(run.owner, run.job_id, run.answered, run.started_at))
        return tallies

    def _renewal_due(self) -> bool:
        """Renew on the tick nearest `renew_s` after the last renewal (ticks come every
        `check_s`, a cancel check each)."""
        return time.monotonic() - self._renewed >= self.renew_s - self.check_s / 2

    def _overran(self, held: Held) -> bool:
        """Past its longest lease: stop renewing, give the items up, report it (once)."""
        if time.monotonic() - held.started <= self.max_s:
            return False
        if not held.lost.is_set():
            sentence = (
                f"a chunk run of job {held.job_id} has held its items for more than "
                f"{self.max_s:g} s (KILN_RUN_MAX_S); its lease is left to run out"
            )
            log.error(sentence, extra={"job_id": held.job_id})
            self.health.fail(held.health_key, sentence)
            held.stop(held.lost)  # whatever it finishes is not written: the items went elsewhere
        return True

    def _run(self) -> None:
        while not self._wake.wait(self.check_s):
            try:
                self._tick(renew=self._renewal_due())
            except Exception as error:  # the database is away: try again next tick
                log.warning("could not renew leases: %s", error)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            thread = self._thread
        self._wake.set()
        if thread is not None:
            thread.join(5)
