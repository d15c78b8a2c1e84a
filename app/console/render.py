"""Pages from templates: Jinja2 with autoescape on (every value a user or a model wrote — file
names, OCR text, error sentences — is escaped; no template marks such a value safe)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates

from kiln.app.console.auth import csrf_token

HERE = Path(__file__).parent
ASSET_VERSION = "2"  # bump when a static file changes: assets are cached for a day


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    seconds = max(0.0, float(seconds))
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 90:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 90:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def _when(moment: datetime | None) -> str:
    if moment is None:
        return "–"
    aware = moment if moment.tzinfo else moment.replace(tzinfo=UTC)
    return aware.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _seconds(value: float | None) -> str:
    """A moment of a video as its key names it (three decimals), less trailing zeros: 12.5."""
    if value is None:
        return "–"
    return f"{value:.3f}".rstrip("0").rstrip(".")


def _count(value: int | float | None) -> str:
    return "–" if value is None else f"{value:,}"


def _mib(value: int | float | None) -> str:
    return "–" if value is None else f"{value / 2**20:,.0f} MiB"


def make_templates() -> Jinja2Templates:
    templates = Jinja2Templates(directory=HERE / "templates")
    env = templates.env
    env.filters.update(duration=_duration, when=_when, count=_count, mib=_mib, seconds=_seconds)
    env.globals["asset_version"] = ASSET_VERSION
    return templates


def page(
    templates: Jinja2Templates,
    request: Request,
    name: str,
    status_code: int = 200,
    **context: Any,
) -> HTMLResponse:
    """Template `name` with the request, its CSRF token and `context`."""
    context.setdefault("tenant", None)
    return templates.TemplateResponse(
        request, name, {"csrf": csrf_token(request), **context}, status_code=status_code
    )
