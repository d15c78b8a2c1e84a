"""What the console keeps in the API process, and how its errors read in a browser."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import pyarrow as pa
from cachetools import LRUCache
from fastapi import Depends, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from kiln.app.console.auth import SignedOut
from kiln.app.console.render import make_templates, page

THUMBNAIL_CACHE_BYTES = 64 * 2**20  # ~6,000 thumbnails of ~10 KB: a few pages of a few jobs
GROUPS_CACHE_JOBS = 8  # closed jobs' groups tables (they never change once written)
VIDEOS_CACHE_JOBS = 1024  # whether a closed job has video frames (it never changes either)
LOGIN = "/console/login"


@dataclass
class ConsoleState:
    templates: Jinja2Templates
    thumbnails: LRUCache[tuple[str, str, str, int, bool], bytes]
    groups: LRUCache[str, pa.Table]
    # closed job → whether it has video frames: a job of images alone is not searched again
    videos: LRUCache[str, bool]

    @classmethod
    def build(cls) -> ConsoleState:
        return cls(
            templates=make_templates(),
            thumbnails=LRUCache(THUMBNAIL_CACHE_BYTES, getsizeof=len),
            groups=LRUCache(GROUPS_CACHE_JOBS),
            videos=LRUCache(VIDEOS_CACHE_JOBS),
        )


def get_console(request: Request) -> ConsoleState:
    state: ConsoleState = request.app.state.console
    return state


ConsoleDep = Annotated[ConsoleState, Depends(get_console)]


def render(request: Request, name: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    return page(get_console(request).templates, request, name, status_code, **context)


def error_page(request: Request, code: int, sentence: str, error: Exception) -> Response | None:
    """The console's answer to an error on one of its routes; None elsewhere (the API's JSON)."""
    if not request.url.path.startswith("/console"):
        return None
    if isinstance(error, SignedOut):
        if request.headers.get("HX-Request"):  # a live part: send the whole page to sign-in
            return Response(status_code=204, headers={"HX-Redirect": LOGIN})
        return RedirectResponse(LOGIN, status_code=303)
    return render(request, "error.html", status_code=code, code=code, sentence=sentence)
