"""A job's end when its output refuses every write: failed at once, its items with it.

A shard that cannot be stored makes the inference that produced it a waste, and so would every
retry of it: the job fails with the output's sentence (`OutputError`), its open items fail
with it, its listing stops and its pipeline is free; the chunks still queued find nothing to
take, and runs under way lose their items at their next renewal and write nothing.
"""

from __future__ import annotations

import logging

from sqlalchemy.exc import OperationalError
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_random

from kiln.app.core.errors import OutputError
from kiln.app.db import failures
from kiln.app.db.models import JobStatus
from kiln.app.db.session import unit_of_work
from kiln.workers.runtime import WorkerRuntime

log = logging.getLogger(__name__)


def fail_for_output(runtime: WorkerRuntime, job_id: str, error: OutputError) -> str | None:
    """Fail the job with the output's sentence (one unit of work); "failed" if this call
    failed it, None if it had ended already."""
    if not _fail(runtime, job_id, str(error)):
        return None
    log.warning("job %s failed: %s", job_id, error, extra={"job_id": job_id})
    return str(JobStatus.FAILED)


# Its items are locked in id order, but another run's results statement may hold some of them
# in its own order: Postgres breaks such a deadlock by refusing one side. Tried again here,
# the run that cannot store its shard still ends the job; raised, its task would retry the
# whole chunk — inference included.
@retry(
    retry=retry_if_exception_type(OperationalError),
    stop=stop_after_attempt(3),
    wait=wait_random(0.05, 0.5),
    reraise=True,
)
def _fail(runtime: WorkerRuntime, job_id: str, reason: str) -> bool:
    with runtime.sessions() as session, unit_of_work(session):
        return failures.fail_job(session, job_id, reason)
