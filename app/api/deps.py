"""Request dependencies as `Annotated` aliases, the one place routes get their tools from."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from kiln.app.api.context import ApiContext
from kiln.app.core.config import Settings
from kiln.app.storage import ObjectStore
from kiln.app.storage.base import S3Factory
from kiln.app.storage.s3 import make_s3_client
from kiln.app.tenants.auth import tenant_for_key


def get_context(request: Request) -> ApiContext:
    context: ApiContext = request.app.state.kiln
    return context


ContextDep = Annotated[ApiContext, Depends(get_context)]


def get_session(context: ContextDep) -> Iterator[Session]:
    with context.sessions() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


def get_settings_dep(context: ContextDep) -> Settings:
    return context.settings


SettingsDep = Annotated[Settings, Depends(get_settings_dep)]


def get_store(context: ContextDep) -> ObjectStore:
    return context.store


StoreDep = Annotated[ObjectStore, Depends(get_store)]


def get_s3(settings: SettingsDep) -> S3Factory:
    """A maker of S3 clients on Kiln's credentials, not a client: nothing is built until a
    route reads a bucket (local storage never does)."""
    return partial(make_s3_client, settings)


S3Dep = Annotated[S3Factory, Depends(get_s3)]

_bearer = HTTPBearer(auto_error=False, description="An API key from `kiln keys create`.")


def get_tenant(
    context: ContextDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> str:
    """The key's tenant, looked up on a connection returned at once.

    Not the request's `SessionDep`: a route that opens its own session (job submission) would
    then hold two connections, and a burst of such requests deadlocks the pool.
    """
    if credentials is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "Send an API key as 'Authorization: Bearer <key>'.",
            headers={"WWW-Authenticate": "Bearer"},
        )
    with context.sessions() as session:
        tenant = tenant_for_key(session, credentials.credentials)
    if tenant is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "The API key is unknown or revoked.",
            headers={"WWW-Authenticate": "Bearer"},
        )
    context.limiter.hit(tenant)  # every authenticated route counts against the tenant's rate
    return tenant


TenantDep = Annotated[str, Depends(get_tenant)]
