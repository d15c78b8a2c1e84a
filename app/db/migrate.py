"""Run Alembic migrations programmatically: `kiln db upgrade` is the only caller in production."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

from kiln import migrations
from kiln.app.core.config import Settings


def alembic_config(settings: Settings) -> Config:
    config = Config()
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    config.set_main_option("sqlalchemy.url", settings.database_url.replace("%", "%%"))
    return config


def _ensure_sqlite_folder(settings: Settings) -> None:
    if settings.database_url.startswith("sqlite:///"):
        path = Path(settings.database_url.removeprefix("sqlite:///"))
        path.parent.mkdir(parents=True, exist_ok=True)


def upgrade(settings: Settings, revision: str = "head") -> None:
    _ensure_sqlite_folder(settings)
    command.upgrade(alembic_config(settings), revision)


def revision(settings: Settings, message: str) -> None:
    _ensure_sqlite_folder(settings)
    command.revision(alembic_config(settings), message=message, autogenerate=True)
