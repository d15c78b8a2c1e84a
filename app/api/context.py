"""What the API process holds: built by `create_app`, disposed at shutdown."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from kiln.app.core.config import Settings
from kiln.app.db.notify import JobWaiters
from kiln.app.db.session import engine_for, make_session_factory
from kiln.app.quotas import TenantLimiter
from kiln.app.storage import ObjectStore, open_store
from kiln.workers.celery_app import CeleryDispatcher, KilnCelery, make_celery


@dataclass
class ApiContext:
    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    store: ObjectStore
    celery: KilnCelery
    dispatcher: CeleryDispatcher
    waiters: JobWaiters
    limiter: TenantLimiter

    @classmethod
    def build(cls, settings: Settings) -> ApiContext:
        # Creating these objects opens no connection; the first request does.
        engine = engine_for(settings)
        celery = make_celery(settings)
        return cls(
            settings=settings,
            engine=engine,
            sessions=make_session_factory(engine),
            store=open_store(settings),
            celery=celery,
            dispatcher=CeleryDispatcher(celery),
            waiters=JobWaiters(settings.database_url),
            limiter=TenantLimiter.for_settings(settings),
        )

    def close(self) -> None:
        self.waiters.close()
        self.engine.dispose()
        self.celery.close()
