"""A worker's courier: one thread that claims due deliveries and a pool that sends them, so a
slow or failing receiver holds one of the courier's threads, never a chunk's task thread nor a
job's close.

Woken when this worker closes a job (its delivery is due at once) and by beat's sweep
(`kiln.deliver_webhooks`), and looking on its own every `KILN_WEBHOOK_SWEEP_S` once started, so
retries go out even while the control queue waits behind a bulk backlog. A claim is a lease
(`app/db/webhooks.claim_due`): a worker killed mid-send leaves its rows to be claimed again by
any courier once the lease ends: at-least-once, and the receiver de-duplicates by
`webhook-id`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any

import httpx
from sqlalchemy.orm import Session, sessionmaker

from kiln.app.core.config import Settings
from kiln.app.core.errors import KilnError
from kiln.app.db import webhooks as db
from kiln.app.db.models import utcnow
from kiln.app.db.session import unit_of_work
from kiln.app.jobs.webhooks import check_url, job_event_body
from kiln.app.tenants.webhook_secret import tenant_secret
from kiln.workers.webhooks.backoff import retry_at
from kiln.workers.webhooks.send import body_of, post, signed_headers

log = logging.getLogger(__name__)

Post = Callable[[httpx.Client, str, dict[str, str], str], db.Outcome]


class Courier:
    """Sends this worker's share of the due deliveries, at most `webhook_concurrency` at once."""

    def __init__(
        self, sessions: sessionmaker[Session], settings: Settings, send: Post = post
    ) -> None:
        self.sessions = sessions
        self.settings = settings
        self._send = send
        self._client = httpx.Client(timeout=settings.webhook_timeout_s, follow_redirects=False)
        self._pool = ThreadPoolExecutor(
            settings.webhook_concurrency, thread_name_prefix="kiln-webhook"
        )
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._in_flight = 0
        self._thread: threading.Thread | None = None

    def wake(self) -> None:
        """Look for due deliveries now (starting the courier's thread on first use). A worker
        without the signing secret claims none: a delivery it took could only fail and wait
        out a backoff, so it is left to the workers that can sign it."""
        if self.settings.webhook_secret is None:
            return
        with self._lock:
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(
                    target=self._run, name="kiln-webhook-courier", daemon=True
                )
                self._thread.start()
        self._wake.set()

    def stop(self) -> None:
        """Stop claiming; sends under way finish (their rows' leases cover a cut one)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.settings.webhook_sweep_s)
            self._wake.clear()
            try:
                self.claim_and_send()
            except Exception:  # a database restart: the next wake or sweep tries again
                log.exception("webhooks: could not claim due deliveries")

    def claim_and_send(self) -> int:
        """Claim as many due deliveries as there are free senders and hand them over; the
        number claimed. A finished send wakes the courier to fill its place."""
        claimed_total = 0
        while not self._stop.is_set():
            with self._lock:
                free = self.settings.webhook_concurrency - self._in_flight
            if free <= 0:
                break
            with self.sessions() as session, unit_of_work(session):
                claimed = db.claim_due(session, free, self.settings.webhook_lease_s)
            with self._lock:
                self._in_flight += len(claimed)
            for delivery in claimed:
                self._pool.submit(self._deliver, delivery)
            claimed_total += len(claimed)
            if len(claimed) < free:
                break
        return claimed_total

    def _deliver(self, delivery: db.Claimed) -> None:
        try:
            outcome = self.attempt(delivery)
            with self.sessions() as session, unit_of_work(session):
                recorded = db.record_attempt(session, delivery, outcome)
            _log(delivery, outcome, recorded)
        except Exception:  # its lease ends and another attempt follows
            log.exception("webhooks: delivery %s of job %s failed", delivery.id, delivery.job_id)
        finally:
            with self._lock:
                self._in_flight -= 1
            self._wake.set()

    def attempt(self, delivery: db.Claimed) -> db.Outcome:
        """One attempt: the body (built once, kept for the retries), the URL checked again
        (a name may have come to point inside since the job was submitted), signed, POSTed."""
        now = utcnow()
        try:
            payload = self._payload(delivery)
            secret = tenant_secret(self.settings.webhook_secret, delivery.tenant)
            check_url(delivery.url, self.settings.webhook_allow_private)
        except KilnError as error:
            return self._failed(delivery, db.Outcome(False, error=str(error)), now)
        body = body_of(payload)
        headers = signed_headers(secret, delivery.id, body, now)
        outcome = self._send(self._client, delivery.url, headers, body)
        return outcome if outcome.delivered else self._failed(delivery, outcome, now)

    def _failed(self, delivery: db.Claimed, outcome: db.Outcome, now: datetime) -> db.Outcome:
        when = retry_at(delivery.attempt, self.settings.webhook_backoff_s, now)
        return db.Outcome(False, outcome.http_status, outcome.error, when)

    def _payload(self, delivery: db.Claimed) -> dict[str, Any]:
        if "data" in delivery.payload:
            return delivery.payload
        at = delivery.payload.get("timestamp")
        when = datetime.fromisoformat(at) if isinstance(at, str) else utcnow()
        with self.sessions() as session, unit_of_work(session):
            payload = job_event_body(session, delivery.job_id, delivery.event, when)
            db.set_payload(session, delivery.id, payload)
        return payload


def _log(delivery: db.Claimed, outcome: db.Outcome, recorded: bool) -> None:
    facts = {"job_id": delivery.job_id, "delivery": delivery.id, "attempt": delivery.attempt}
    if outcome.delivered:
        log.info("webhook %s of job %s delivered", delivery.event, delivery.job_id, extra=facts)
    elif outcome.retry_at is None:
        log.warning(
            "webhook %s of job %s: gave up after %d attempts: %s",
            delivery.event, delivery.job_id, delivery.attempt, outcome.error, extra=facts,
        )  # fmt: skip
    else:
        log.info(
            "webhook %s of job %s: attempt %d failed (%s); again at %s",
            delivery.event, delivery.job_id, delivery.attempt, outcome.error,
            outcome.retry_at.isoformat(), extra=facts,
        )  # fmt: skip
    if not recorded:
        log.info("webhook delivery %s was claimed again meanwhile", delivery.id, extra=facts)
