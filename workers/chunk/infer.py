"""A chunk's rows answered: each through the job's model — what the content cache already
knows first, the rest prep → batch → engine (`answer.py`) — then those it failed or refused
through the job's fallback model, fetched afresh, in the same run, before anything is written.
(An item already run `max_attempts` times is never leased: the lease fails it, `leases.give_up`.)
"""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack

import numpy as np

from kiln.app.catalog.catalog import ModelInfo
from kiln.app.core.errors import TransientError
from kiln.app.db import content_cache as cache_rows
from kiln.app.families.fallback import FAILED
from kiln.workers.chunk import content_cache
from kiln.workers.chunk.answer import drop_held, read_all, run_model
from kiln.workers.chunk.pump import ModelPass
from kiln.workers.chunk.rows import ChunkRows
from kiln.workers.chunk.stats import ChunkReport
from kiln.workers.close.fallback import Fallback
from kiln.workers.close.lease import Lease
from kiln.workers.models.loader import output_fields
from kiln.workers.ops.keeper import Held
from kiln.workers.runtime import WorkerRuntime

log = logging.getLogger(__name__)


def answer_chunk(
    runtime: WorkerRuntime, lease: Lease, held: Held, urgent: bool, report: ChunkReport
) -> ChunkRows:
    """Every leased input through the job's model, then those it failed or refused through the
    job's fallback model (if it names one and takes them)."""
    rows = ChunkRows(lease.items)
    _run(runtime, lease, lease.model, rows, rows.open(), held, urgent, report)
    if lease.fallback is not None:
        _fall_back(runtime, lease, lease.fallback, rows, held, urgent, report)
    report.seconds["fetch"] = float(rows.seconds[:, 0].sum())
    report.seconds["decode"] = float(rows.seconds[:, 1].sum())
    return rows


def _run(
    runtime: WorkerRuntime,
    lease: Lease,
    model: ModelInfo,
    rows: ChunkRows,
    indices: np.ndarray,
    held: Held,
    urgent: bool,
    report: ChunkReport,
) -> None:
    """Load `model` (kept loaded while this runs), then run `indices` through it; a model
    that cannot load fails them with the reason."""
    if not len(indices):
        return
    started = time.monotonic()
    with ExitStack() as stack:
        try:
            runner = stack.enter_context(runtime.models.using(model))  # not unloaded while in use
        except TransientError:
            raise
        except Exception as error:
            where = {"job_id": lease.job_id, "chunk": lease.chunk, "model": model.ref}
            log.exception("model %s failed to load", model.ref, extra=where)
            for row in indices.tolist():
                sentence = f"Model {model.ref!r} could not be loaded: {error}."
                rows.fail(row, sentence, FAILED, blameless=True)
            return
        model_pass = ModelPass(
            model, runner, runtime.prep, runtime.settings.max_upload_bytes, held, urgent,
            lease.sampling,
        )  # fmt: skip
        holder: dict[int, int] = {}
        if runtime.settings.content_cache:
            holder = read_all(model_pass, rows, indices)
            indices = _use_cache(runtime, lease.tenant, model, runner.info, rows, indices, report)
            drop_held(model_pass, rows, [r for r in holder if rows.cached[r]], holder)
        run_model(model_pass, rows, indices, holder)
    report.seconds["infer"] += time.monotonic() - started


def _use_cache(
    runtime: WorkerRuntime,
    tenant: str,
    model: ModelInfo,
    loaded: ModelInfo,
    rows: ChunkRows,
    indices: np.ndarray,
    report: ChunkReport,
) -> np.ndarray:
    """One lookup for the rows read: what this model version has already answered for this
    tenant (or anyone, when the cache is shared) becomes a piece of the results. `loaded`
    is the runner's registration, identical to the job's (the same cache key and scope).
    Returns the rows still to run."""
    going = [r for r in indices.tolist() if rows.errors[r] is None and not rows.cancelled[r]]
    readable = [row for row in going if rows.sha256[row]]
    # Videos and their frames are not hashed whole: they run without the cache.
    unhashed = [row for row in going if not rows.sha256[row]]
    if not readable:
        return np.asarray(unhashed, dtype=np.int64)
    settings = runtime.settings
    with runtime.sessions() as session:
        known = cache_rows.cached_results(
            session,
            content_cache.scope_key(settings, tenant, loaded),
            [rows.sha256[row] or "" for row in readable],
            settings.content_cache_ttl_s,
        )
    hits = [row for row in readable if rows.sha256[row] in known]
    if hits:
        rows.cached[hits] = True
        entries = [known[rows.sha256[row] or ""] for row in hits]
        piece = content_cache.hits_piece(np.asarray(hits), entries, output_fields(model), model)
        rows.answer(piece)
        report.cached += len(hits)
    hit = set(hits)
    return np.asarray(sorted(unhashed + [r for r in readable if r not in hit]), dtype=np.int64)


def _fall_back(
    runtime: WorkerRuntime,
    lease: Lease,
    fallback: Fallback,
    rows: ChunkRows,
    held: Held,
    urgent: bool,
    report: ChunkReport,
) -> None:
    """The inputs the job's model failed or refused (as `fallback.on` says) run again through
    the fallback model, fetched afresh: the model's own decoded rows are gone, and the two may
    prepare inputs differently. Its load failures, memory budget and batching apply as to any
    model; what it cannot answer fails with both reasons."""
    taken = [row for row in range(len(rows)) if fallback.takes(rows.failure[row])]
    if not taken or held.stopping():
        return  # nothing to take, or nothing this run may still start
    first = {row: rows.errors[row] for row in taken}
    blameless = {row: bool(rows.blameless[row]) for row in taken}
    for row in taken:
        rows.errors[row] = rows.failure[row] = None
        rows.blameless[row] = False
    _run(runtime, lease, fallback.model, rows, np.asarray(taken), held, urgent, report)
    for row in taken:
        if rows.cancelled[row]:  # cancelled before the fallback started it: the first stands
            rows.cancelled[row] = False
            rows.fail(row, first[row] or "", None, blameless[row])
            continue
        rows.fallback_reason[row] = first[row]
        report.fell_back += 1
        if rows.answered_by[row] is None:
            again = rows.errors[row]
            ref = fallback.model.ref
            either = blameless[row] or bool(rows.blameless[row])  # one may say nothing of it
            rows.fail(
                row, f"{first[row]} The fallback model {ref!r} failed too: {again}", None, either
            )
