"""Kiln's application side: what a job is, and the API and CLI that take them.

Who commits — one rule for app/ and workers/:

- A *service function* is one unit of work. It takes a Session (on the worker side a step
  opens its own) and writes inside `with unit_of_work(session):` (app/db/session.py), which
  commits when the block ends and rolls back if it raises: it never returns with its writes
  half done or left for its caller. A long task is several units in a row, each a block of its
  own (a bulk ingest step: the claim, then one per page).
- Broker messages are sent only after the commit that made the rows they name visible. A
  submission whose message the broker refuses fails its job (`jobs.failing_unqueued`).
- Query helpers in app/db never commit or roll back: they run inside the caller's unit.
- Routes, CLI commands and Celery tasks never commit: they open a session and call services.
- When one unit must hold another service's writes (a schedule's run: the schedule advanced
  and its bulk job; a new API key and its buckets), it calls that service's `stage_…`
  function, which checks everything first, then adds rows to the caller's unit and never
  commits.

`unit_of_work` is the only code that calls `commit()` or `rollback()`;
tests/test_transactions.py keeps it so.
"""
