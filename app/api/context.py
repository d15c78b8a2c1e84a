"""What the API process holds: built by `create_app`, disposed at shutdown."""

from __future__ import annotations

from dataclasses import dataclass

from celery import Celery
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from kiln.app.core.config import Settings
from kiln.app.db.notify import JobWaiters
from kiln.app.db.session import engine_for, make_session_factory
from kiln.app.dispatch.producer import CeleryDispatcher, make_producer
from kiln.app.jobs.jobs import JobRequest, Submitted, submit_job
from kiln.app.results.index_cache import IndexCache
from kiln.app.storage import ObjectStore, open_store
from kiln.app.tenants.quotas import TenantLimiter


@dataclass
class ApiContext:
    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    store: ObjectStore
    celery: Celery  # a producer: it sends by task name and holds no task code
    dispatcher: CeleryDispatcher
    waiters: JobWaiters
    limiter: TenantLimiter
    indexes: IndexCache  # vector indexes loaded for search, least recently used out first

    @classmethod
    def build(cls, settings: Settings) -> ApiContext:
        # Creating these objects opens no connection; the first request does.
        engine = engine_for(settings)
        celery = make_producer(settings)
        return cls(
            settings=settings,
            engine=engine,
            sessions=make_session_factory(engine),
            store=open_store(settings),
            celery=celery,
            dispatcher=CeleryDispatcher(celery),
            waiters=JobWaiters(settings.database_url),
            limiter=TenantLimiter.for_settings(settings),
            indexes=IndexCache(settings.search_cache_bytes),
        )

    def submit_job(self, session: Session, request: JobRequest) -> Submitted:
        """A job of inputs, as the API and the console submit it: within the tenant's limit of
        open jobs, its chunks sent through this process's dispatcher."""
        return submit_job(
            session, self.store, self.dispatcher, self.settings, request,
            self.settings.tenant_max_open_jobs,
        )  # fmt: skip

    def close(self) -> None:
        self.waiters.close()
        self.engine.dispose()
        self.celery.close()
        self.indexes.close()
