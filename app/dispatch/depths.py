"""How many messages wait in each of Kiln's broker queues: read for `GET /metrics` and for the
console's fleet page. Only a Redis broker can be read (one pipelined LLEN round trip); the
embedded broker answers None."""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery

log = logging.getLogger(__name__)


def queue_lengths(channel: Any, queues: tuple[str, ...]) -> dict[str, int]:
    """LLEN of every priority list of each queue, summed per queue, in one round trip."""
    keys = [(q, channel._q_for_pri(q, p)) for q in queues for p in channel.priority_steps]
    pipe = channel.client.pipeline()
    for _queue, key in keys:
        pipe.llen(key)
    lengths = dict.fromkeys(queues, 0)
    for (queue, _key), length in zip(keys, pipe.execute(), strict=True):
        lengths[queue] += int(length)
    return lengths


def read_queue_lengths(
    celery: Celery, broker_url: str, queues: tuple[str, ...]
) -> dict[str, int] | None:
    """The lengths, or None where they cannot be read (not Redis, or Redis not answering: one
    quick try, since a page or a scrape waits on it)."""
    if not broker_url.startswith(("redis", "rediss")):
        return None
    try:
        with celery.connection_for_read() as connection:
            connection.ensure_connection(max_retries=1)
            return queue_lengths(connection.default_channel, queues)
    except Exception as error:  # kombu raises per transport; a missing figure is not an outage
        log.warning("could not read the broker's queue lengths: %s", error)
        return None
