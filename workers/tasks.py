"""Thin Celery adapters over plain functions: the logic lives in `workers.chunk`."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from sqlalchemy.exc import OperationalError

from app.core.errors import TransientError

if TYPE_CHECKING:
    from workers.celery_app import KilnCelery

log = logging.getLogger(__name__)


def register(app: KilnCelery) -> None:
    @app.task(  # type: ignore[untyped-decorator]
        name="kiln.process_chunk",
        bind=True,
        shared=False,  # shared tasks join every later app: a second app would run this one's
        autoretry_for=(TransientError, OperationalError),  # a DB restart is transient too
        retry_backoff=2,
        retry_backoff_max=120,
        retry_jitter=True,
        max_retries=8,
    )
    def process_chunk(task: Any, job_id: str, chunk: int, item_ids: list[int]) -> dict[str, Any]:
        from workers.chunk import process_chunk as run

        report = run(app.runtime(), job_id, chunk, item_ids)
        log.info(
            "chunk %s/%d: %d ok, %d failed, %s",
            job_id,
            chunk,
            report.succeeded,
            report.failed,
            {k: round(v, 3) for k, v in report.seconds.items()},
        )
        return {"processed": report.processed, "job_status": report.job_status}
