"""What a job's close adds before its status closes: a pipeline run's library update, the
model family's job-closed step (its near-duplicate groups), then byte-identical inputs joined
into them — over the whole library for a pipeline run.

A worker hashes every input it reads (sha256: the results' column and the content cache's key),
so items whose digests match are duplicates for the cost of one query at close. They join the
near-duplicate groups the family found (phash, embeddings), or form groups of their own, in
the same groups.parquet: one mechanism, whatever the model.

The steps run before the job's status closes, so whoever sees it closed finds its groups and
index; two chunks finishing at once may both run them, and they write the same objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

from sqlalchemy.orm import Session

from kiln.app.catalog.catalog import ModelInfo
from kiln.app.db import queries
from kiln.app.db.models import Job
from kiln.app.results import results
from kiln.app.storage import ObjectStore
from kiln.workers.models.base import ClosedJob
from kiln.workers.models.grouping import groups_in, merge
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
    summary = join_identical(place, same, summary)
    return summary | ({"library": library.summary()} if library else {})


def join_identical(
    place: results.Place, identical: Sequence[tuple[str, str]], summary: dict[str, Any]
) -> dict[str, Any]:
    """Merge `identical` ((sha256, key) of items sharing their bytes) into the job's groups;
    returns the manifest's part (`summary`, from the family's step, with its group counts
    made true again, and an `identical` summary)."""
    if not identical:
        return summary
    digest_of = {key: digest for digest, key in identical}
    merged = merge(groups_in(results.read_groups(place)), identical)
    key = results.write_groups(place, merged.members, merged.similarities, digest_of)
    groups = {
        **summary.get("groups", {}),
        "key": key,
        "groups": len(merged.members),
        "items_in_groups": sum(len(g) for g in merged.members),
    }
    same = {"groups": len(set(digest_of.values())), "items": len(identical)}
    return {**summary, "groups": groups, "identical": same}
