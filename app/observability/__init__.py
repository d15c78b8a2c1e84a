"""Traces and logs: set up by each process's entry point (`observe`), never at import."""

from __future__ import annotations

import logging

from kiln.app.core.config import Settings


def observe(settings: Settings, service: str, level: int | str = logging.INFO) -> bool:
    """Configure this process's logging (`KILN_LOG_FORMAT`) and, when an OTLP endpoint is
    set, its tracing; returns whether tracing is on. `service`: api, worker, beat or run."""
    from kiln.app.observability.logs import configure_logging
    from kiln.app.observability.tracing import setup_tracing

    configure_logging(settings.log_format, level)
    return setup_tracing(settings, service)
