"""`create_app(settings)`: the HTTP face of Kiln."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from kiln.app.api.context import ApiContext
from kiln.app.api.errors import install_error_handlers
from kiln.app.api.metrics import install_metrics
from kiln.app.api.routes import (
    estimate,
    health,
    jobs,
    models,
    pipelines,
    retry,
    schedules,
    search,
    webhooks,
)
from kiln.app.console import install_console
from kiln.app.core.config import Settings, get_settings, redact_url

log = logging.getLogger(__name__)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Redacted: URLs may carry passwords, and this line lands in every log collector.
        log.info(
            "Kiln API: database %s, broker %s, storage %s",
            redact_url(settings.database_url),
            redact_url(settings.broker_url),
            redact_url(settings.storage_url),
        )
        app.state.kiln = ApiContext.build(settings)
        app.state.kiln.waiters.start()
        try:
            yield
        finally:
            app.state.kiln.close()

    app = FastAPI(
        title="Kiln",
        version="0.1.0",
        summary="Batch inference: submit jobs, poll status, fetch results.",
        lifespan=lifespan,
    )
    install_error_handlers(app)
    install_metrics(app)  # GET /metrics, and the per-request counters
    app.include_router(health.router)
    app.include_router(jobs.router)
    app.include_router(estimate.router)
    app.include_router(retry.router)
    app.include_router(models.router)
    app.include_router(pipelines.router)
    app.include_router(schedules.router)
    app.include_router(search.router)
    app.include_router(search.pipeline_router)
    app.include_router(webhooks.router)
    install_console(app, settings)  # the browser console at /console (docs/console.md)
    return app
