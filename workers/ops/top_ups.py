"""The process's one fair-share top-up thread (app/jobs/fair_share.py).

A bulk chunk's end frees a place in the bulk window; sending the next chunks takes a few round
trips to Postgres (tens of ms on a loaded database). Done on the chunk's own task thread, that
wait kept the thread from its next chunk: a lone tenant's job ran ~30% slower with 32-item
chunks. So a chunk only asks (`request`, which returns at once) and this thread tops up;
requests made while it runs are folded into one more run after it, so a burst of chunks
ending together costs one or two top-ups, not one each. A request lost with the process (a
stop) costs nothing: the next chunk's end, the ingest or the reconciler tops up instead.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kiln.app.dispatch.contract import Dispatcher


class TopUps:
    """Runs `top_up(dispatcher)` on its own daemon thread, once per batch of requests."""

    def __init__(self, top_up: Callable[[Dispatcher], object]) -> None:
        self._top_up = top_up
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._dispatcher: Dispatcher | None = None
        self._thread: threading.Thread | None = None
        self.runs = 0  # top-ups done (tests and logs)

    def request(self, dispatcher: Dispatcher) -> None:
        """Ask for a top-up through `dispatcher` (the latest request's is used)."""
        with self._lock:
            self._dispatcher = dispatcher
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="fair-share", daemon=True)
                self._thread.start()
        self._wake.set()

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()  # a request from now on wakes one more run
            with self._lock:
                dispatcher = self._dispatcher
            if dispatcher is not None:
                self._top_up(dispatcher)
                self.runs += 1
