"""What a job's close adds before its status closes: a pipeline run's library update, the
model family's job-closed step (its near-duplicate groups), then byte-identical inputs joined
into them — over the whole library for a pipeline run. Run before the job's status closes, so
whoever sees it closed finds its groups and index; two chunks finishing at once may both run
them, and they write the same objects.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from sqlalchemy.orm import Session

from kiln.app import results
from kiln.app.catalog import ModelInfo
from kiln.app.db import queries
from kiln.app.db.models import Job
from kiln.app.storage import ObjectStore
from kiln.workers.close import identical
from kiln.workers.models.base import ClosedJob
from kiln.workers.models.library import library_place
from kiln.workers.models.library import update as update_library
from kiln.workers.models.loader import job_closed, library_columns


def close_steps(
    store: ObjectStore, session: Session, job: Job, model: ModelInfo, place: results.Place
) -> dict[str, Any]:
    """Run the steps; what they add to the manifest."""
    library = None
    if job.pipeline_id is not None:
        where = library_place(store, job.pipeline_id, model.ref)
        library = update_library(where, place, library_columns(model))
    summary: dict[str, Any] = {}
    if (step := job_closed(model)) is not None:
        outputs = partial(queries.item_outputs, session, job.id)
        summary = step(ClosedJob(job, outputs, place, library))
    same = library.identical() if library else queries.identical_inputs(session, job.id)
    summary = identical.close_job(place, same, summary)
    return summary | ({"library": library.summary()} if library else {})
