"""Who is signed in to the console, and whether a form was sent by the console's own page.

Signing in trades an API key for a session cookie (Starlette's `SessionMiddleware`: signed,
HttpOnly, SameSite=Lax). The cookie holds the key's SHA-256 digest, never the key, and every
request looks the digest up again, so revoking the key signs its sessions out at once.

Every form that changes state carries the session's CSRF token, checked in constant time; the
SameSite cookie already keeps other sites' forms out, the token keeps out what SameSite lets
through (a sibling subdomain, an old browser).
"""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Form, Request
from sqlalchemy import select

from kiln.app.api.deps import ContextDep
from kiln.app.core.errors import ForbiddenError, KilnError
from kiln.app.db.models import ApiKey
from kiln.app.tenants.auth import digest

KEY = "key"  # session field: the signed-in key's digest
CSRF = "csrf"  # session field and form field: the anti-forgery token


class SignedOut(KilnError):
    """No session, or its key was revoked: the console answers with the sign-in page."""


def csrf_token(request: Request) -> str:
    """The session's token, made on first use (the sign-in form needs one before a session)."""
    token = request.session.get(CSRF)
    if not isinstance(token, str):
        token = secrets.token_urlsafe(32)
        request.session[CSRF] = token
    return token


def check_csrf(request: Request, sent: str | None) -> None:
    expected = request.session.get(CSRF)
    if not isinstance(expected, str) or not sent or not secrets.compare_digest(expected, sent):
        raise ForbiddenError(
            "This form is out of date or was not sent by the console; "
            "reload the page and try again."
        )


def tenant_of_digest(context: ContextDep, key_digest: str) -> str | None:
    with context.sessions() as session:
        row = session.scalar(
            select(ApiKey.tenant).where(ApiKey.key_hash == key_digest, ApiKey.revoked_at.is_(None))
        )
    return row


def sign_in(request: Request, context: ContextDep, key: str) -> str | None:
    """The key's tenant, with the session now signed in; None for a key Kiln does not know."""
    key_digest = digest(key.strip())
    tenant = tenant_of_digest(context, key_digest)
    if tenant is not None:
        request.session.clear()  # a fresh session: no token from before sign-in carries over
        request.session[KEY] = key_digest
        csrf_token(request)
    return tenant


def sign_out(request: Request) -> None:
    request.session.clear()


def console_tenant(request: Request, context: ContextDep) -> str:
    """The signed-in tenant, or `SignedOut` (answered with the sign-in page)."""
    key_digest = request.session.get(KEY)
    tenant = tenant_of_digest(context, key_digest) if isinstance(key_digest, str) else None
    if tenant is None:
        raise SignedOut("Sign in with an API key.")
    return tenant


def checked_form(request: Request, csrf: Annotated[str | None, Form()] = None) -> None:
    """A dependency of every state-changing route: the form's token is the session's."""
    check_csrf(request, csrf)


ConsoleTenant = Annotated[str, Depends(console_tenant)]


def acting_tenant(tenant: ConsoleTenant, context: ContextDep) -> str:
    """The signed-in tenant about to change something: counted against its rate, as every
    API request is (page views and polls are not: watching a job must not use the rate up)."""
    context.limiter.hit(tenant)
    return tenant


ActingTenant = Annotated[str, Depends(acting_tenant)]
CheckedForm = Annotated[None, Depends(checked_form)]
