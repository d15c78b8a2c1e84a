"""The Kiln console: jobs, results, near-duplicate groups, the fleet, models and schedules in a
browser, served by `kiln api` itself at `/console` (docs/console.md).

Server-rendered (Jinja2) with htmx for the parts that update live and a few lines of our own
JavaScript for drag and drop and the charts (uPlot); every asset is served from
`console/static`, nothing from a CDN. Pages read through the same service functions as the
API (`app/jobs/jobs`, `app/db/queries`, `app/catalog/catalog`, `app/jobs/schedules`,
`app/api/fleet`).
"""

from __future__ import annotations

import secrets

from fastapi import FastAPI, Request
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles
from starlette.middleware.sessions import SessionMiddleware

from kiln.app.console.pages import ConsoleState, error_page
from kiln.app.console.render import HERE
from kiln.app.console.routes import auth, catalog, fleet, job, jobs, try_model
from kiln.app.console.security import SecurityHeaders
from kiln.app.core.config import Settings

PREFIX = "/console"
COOKIE = "kiln_console"
SESSION_MAX_AGE_S = 12 * 3600  # a working day and a night shift


def install_console(app: FastAPI, settings: Settings) -> None:
    secret = settings.console_secret.get_secret_value() if settings.console_secret else None
    app.add_middleware(SecurityHeaders, prefix=PREFIX)
    app.add_middleware(
        SessionMiddleware,
        secret_key=secret or secrets.token_urlsafe(32),
        session_cookie=COOKIE,
        max_age=SESSION_MAX_AGE_S,
        path=PREFIX,
        same_site="lax",
        https_only=settings.console_secure_cookie,
    )
    app.state.console = ConsoleState.build()
    app.state.error_page = error_page
    app.mount(f"{PREFIX}/static", StaticFiles(directory=HERE / "static"), name="console-static")
    for module in (auth, jobs, job, try_model, fleet, catalog):
        app.include_router(module.router)

    @app.get("/", include_in_schema=False)
    def root(_request: Request) -> RedirectResponse:
        return RedirectResponse(f"{PREFIX}/", status_code=307)
