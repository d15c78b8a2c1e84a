"""Traces and logs: set up by each process's entry point (`observe`), never at import."""

from __future__ import annotations

from kiln.app.core.config import Settings


def observe(
    settings: Settings, service: str, flag: str | None = None, default: str = "INFO"
) -> bool:
    """Configure this process's logging (`KILN_LOG_FORMAT`; its level: the command's
    `--loglevel` flag, else `KILN_LOG_LEVEL`, else the command's `default`) and, when an OTLP
    endpoint is set, its tracing; returns whether tracing is on. `service`: api, worker, beat
    or run."""
    from kiln.app.observability.logs import configure_logging
    from kiln.app.observability.tracing import setup_tracing

    configure_logging(settings.log_format, log_level(settings, flag, default))
    return setup_tracing(settings, service)


def log_level(settings: Settings, flag: str | None, default: str = "INFO") -> str:
    """A command's `--loglevel` flag, else `KILN_LOG_LEVEL`, else the command's default."""
    if flag is not None:
        return flag.upper()
    return (settings.log_level or default).upper()
