"""What travels between the API and the workers: queue names, task names, one `Dispatcher`.

Messages carry ids as JSON, never bytes or pickles: a chunk is `[job_id, chunk, item_ids]`, an
ingest step `[job_id, owner]`. Producers send by task name, so the API never imports task code.
"""

from __future__ import annotations

from typing import Protocol

INTERACTIVE = "interactive"
INGEST = "ingest"
BULK = "bulk"
CONTROL = "control"
# In priority order: a worker takes interactive chunks before anything else, then ingest
# steps (short, and they keep bulk fed), then bulk chunks, then periodic control tasks.
QUEUES = (INTERACTIVE, INGEST, BULK, CONTROL)

CHUNK_TASK = "kiln.process_chunk"
INGEST_TASK = "kiln.ingest"
RECONCILE_TASK = "kiln.reconcile"
SCHEDULES_TASK = "kiln.run_schedules"
WEBHOOKS_TASK = "kiln.deliver_webhooks"  # beat's sweep: wakes a worker's webhook courier


class Dispatcher(Protocol):
    """Sends work to the workers: chunks of item ids and steps of a bucket's listing."""

    def enqueue_chunk(self, job_id: str, chunk: int, item_ids: list[int], queue: str) -> None: ...

    def enqueue_ingest(
        self, job_id: str, owner: str | None = None, countdown: float = 0
    ) -> None: ...
