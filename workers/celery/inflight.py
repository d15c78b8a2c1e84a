"""Which chunk messages the broker holds right now: queued, or delivered and not yet acked.

The reconciler compares this with Postgres: a pending chunk with no message anywhere was lost
(Redis flushed or restarted, a send that never happened) and is sent again. Only the Redis
transport can be read this way; for others the answer is "unknown" and nothing is re-sent on
this ground (expired leases are still re-sent).
"""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from celery import Celery

if TYPE_CHECKING:  # the reconciler's own type; importing it at run time would load the close
    from kiln.workers.jobs.periodic import Chunk

log = logging.getLogger(__name__)

MAX_MESSAGES = 100_000  # beyond this, reading the queues costs more than a duplicate send


def chunks_in_flight(
    app: Celery, queues: Iterable[str], task: str, delivered_within_s: float
) -> set[Chunk] | None:
    """Chunks of `task` queued in `queues` or delivered less than `delivered_within_s` ago.

    A message delivered earlier and still unacknowledged may sit with a killed worker until
    the visibility timeout; its chunk counts as not in flight (a duplicate is harmless).
    None when the broker cannot be read (not Redis, too many messages, an error).
    """
    if not app.conf.broker_url or not str(app.conf.broker_url).startswith(("redis", "rediss")):
        return None
    try:
        with app.connection_for_read() as connection:
            channel = connection.default_channel
            payloads = _queued(channel, queues) + _recently_delivered(channel, delivered_within_s)
    except _TooMany:
        log.warning("more than %d messages queued; not reading them this time", MAX_MESSAGES)
        return None
    except Exception as error:
        log.warning("could not read the broker's queues: %s", error)
        return None
    return {chunk for raw in payloads if (chunk := _chunk_of(raw, task)) is not None}


class _TooMany(Exception):
    pass


def _queued(channel: Any, queues: Iterable[str]) -> list[bytes]:
    client = channel.client
    keys = [channel._q_for_pri(q, p) for q in queues for p in channel.priority_steps]
    if sum(client.llen(key) for key in keys) > MAX_MESSAGES:
        raise _TooMany
    return [raw for key in keys for raw in client.lrange(key, 0, -1)]


def _recently_delivered(channel: Any, within_s: float) -> list[bytes]:
    client = channel.client
    tags = client.zrangebyscore(channel.unacked_index_key, time.time() - within_s, "+inf")
    if len(tags) > MAX_MESSAGES:
        raise _TooMany
    if not tags:
        return []
    return [raw for raw in client.hmget(channel.unacked_key, tags) if raw is not None]


def _chunk_of(raw: bytes, task: str) -> Chunk | None:
    """(job, chunk) of a `task` message; unacked entries wrap it as [message, exchange, key]."""
    try:
        message = json.loads(raw)
        if isinstance(message, list):
            message = message[0]
        if message.get("headers", {}).get("task") != task:
            return None
        body = message["body"]
        if message.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]
        return str(args[0]), int(args[1])
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None
