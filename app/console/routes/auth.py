"""Sign in with an API key; sign out."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, RedirectResponse

from kiln.app.api.deps import ContextDep
from kiln.app.console import auth
from kiln.app.console.auth import CheckedForm
from kiln.app.console.pages import render

router = APIRouter(prefix="/console", include_in_schema=False)


@router.get("/login")
def login_page(request: Request) -> HTMLResponse:
    return render(request, "login.html")


@router.post("/login", response_model=None)
async def login(
    request: Request,
    context: ContextDep,
    _form: CheckedForm,
    key: Annotated[str, Form(max_length=256)] = "",
) -> HTMLResponse | RedirectResponse:
    tenant = await run_in_threadpool(auth.sign_in, request, context, key) if key else None
    if tenant is None:
        sentence = "That API key is not one Kiln knows (or it was revoked)."
        return render(request, "login.html", status_code=401, problem=sentence)
    return RedirectResponse("/console/", status_code=303)


@router.post("/logout")
def logout(request: Request, _form: CheckedForm) -> RedirectResponse:
    auth.sign_out(request)
    return RedirectResponse("/console/login", status_code=303)
