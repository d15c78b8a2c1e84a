"""What every `kiln` command shares: consoles, settings, a database session, failures."""

from __future__ import annotations

from typing import Any

import typer
from rich.console import Console

from kiln.app.core.config import Settings, get_settings

console = Console()
errors = Console(stderr=True)


def settings() -> Settings:
    return get_settings()


def fail(error: Exception) -> typer.Exit:
    """Print the error's sentence (never a traceback) and exit 1."""
    errors.print(f"[red]error:[/red] {error}")
    return typer.Exit(1)


def session() -> Any:
    from kiln.app.db.session import make_engine, make_session_factory

    current = settings()
    if current.database_url.startswith("sqlite"):
        from kiln.app.db.migrate import upgrade

        upgrade(current)  # the embedded default prepares its own database, as `kiln run` does
    return make_session_factory(make_engine(current.database_url))()


def redact(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)
