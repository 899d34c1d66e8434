"""How often one node may open a stream, counted across every web process and agent listener.

Each stream a node opens brings a fresh message allowance (the per-stream rate of
:class:`control.agent_plumbing.TokenBucket`) and costs the store a hello: a registration and a
full desired state. So the streams themselves are counted, per node, where every process that
may hold one sees the count: past ``LLMGW_AGENT_HELLO_LIMIT`` streams in a window of
``LLMGW_AGENT_HELLO_WINDOW`` seconds, a stream is refused (4429) until the window ends. The
count is taken at the handshake, once the credential named the node and before the stream
takes over from the node's open one or costs anything else. A stream refused for its
credential never reaches it: no node is known then.

Windows are fixed (the window's number is Unix time divided by its length), as the gateway's
limits are: exact and cheap to share. Every stream counts, refused ones too, but a refusal never
moves the window's end, so a node is let in again at most one window after its first refusal.
Two stores, chosen by configuration, like the gateway's counters:

- Redis (``REDIS_URL`` set): one ``INCR`` of the window's key, which expires after the window.
  Where Redis cannot be reached the store counts instead (logged): an outage of Redis, which no
  stream needs otherwise, must neither lock the fleet out nor let a looping node through.
- The database otherwise: one upsert per stream (:class:`control.models.StreamCounter`) that
  returns the new count; rows of ended windows are deleted now and then.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Final

import redis
from django.conf import settings
from django.db import connection
from redis.exceptions import RedisError

from control.models import StreamCounter
from control.node_tokens import NodeIdentity
from llmgw_site.config import counter_redis_options

logger = logging.getLogger(__name__)

# A handshake waits this long on a Redis that does not answer before the store counts.
REDIS_TIMEOUT_S: Final = 1.0
PURGE_EVERY_S: Final = 300.0


@dataclass(frozen=True)
class Refusal:
    """A stream past its node's limit: what the agent and the log are told."""

    node: str
    limit: int
    window: float
    retry_after: float

    @property
    def message(self) -> str:
        return (
            f"more than {self.limit} streams of node {self.node!r} within {self.window:g}s; "
            f"reconnect in {math.ceil(self.retry_after)}s"
        )


def admit(identity: NodeIdentity, now: float | None = None) -> Refusal | None:
    """Count one stream of ``identity``'s node, opened ``now`` (Unix time): None when it is
    within the limit. Raises DatabaseError when nothing can count it (the store down, and
    Redis too where it is set)."""
    limit = int(settings.LLMGW_AGENT_HELLO_LIMIT)
    window = float(settings.LLMGW_AGENT_HELLO_WINDOW)
    now = time.time() if now is None else now
    number = int(now // window)
    window_end = (number + 1) * window
    used = _count(f"streams:{identity.id}:{number}", window_end, now)
    if used <= limit:
        return None
    refusal = Refusal(identity.name, limit, window, window_end - now)
    # Once per node and window at warning (the count passes limit + 1 once, whichever process
    # sees it); the retries that follow are refused as quietly as they are cheaply.
    logger.log(
        logging.WARNING if used == limit + 1 else logging.DEBUG,
        "node %s: %d streams opened within %gs, more than %d; refusing its streams for %.0fs",
        identity.name,
        used,
        window,
        limit,
        refusal.retry_after,
    )
    return refusal


def _count(name: str, window_end: float, now: float) -> int:
    """One more in the counter ``name``; the count it reaches."""
    url = str(settings.REDIS_URL or "")
    if url:
        try:
            return _count_in_redis(url, name, math.ceil(window_end - now))
        except RedisError as exc:
            logger.warning(
                "stream counts cannot reach Redis (%s); counting in the store meanwhile",
                type(exc).__name__,
            )
    return _count_in_store(name, window_end, now)


# --------------------------------------------------------------------------- Redis

_clients: dict[str, Any] = {}


def _client(url: str) -> Any:
    if url not in _clients:
        _clients[url] = redis.Redis.from_url(url, **counter_redis_options(REDIS_TIMEOUT_S))
    return _clients[url]


def _count_in_redis(url: str, name: str, ttl: int) -> int:
    pipe = _client(url).pipeline(transaction=True)
    pipe.incr(f"llmgw:{name}")
    # A little past the window's end, so a clock a second apart between processes still
    # finds the key of its window.
    pipe.expire(f"llmgw:{name}", max(1, ttl) + 60)
    used, _ = pipe.execute()
    return int(used)


# --------------------------------------------------------------------------- the store

_TABLE = StreamCounter._meta.db_table
# One statement that counts and says the count, so two processes cannot both read the same.
_UPSERT_SQL = f"""
INSERT INTO {_TABLE} (name, used, window_end) VALUES (%s, 1, %s)
ON CONFLICT (name) DO UPDATE SET used = {_TABLE}.used + 1
RETURNING used
"""  # noqa: S608 - the table is the model's own name, not input
_next_purge = 0.0


def _count_in_store(name: str, window_end: float, now: float) -> int:
    global _next_purge
    if now >= _next_purge:
        _next_purge = now + PURGE_EVERY_S
        StreamCounter.objects.filter(window_end__lte=now).delete()
    with connection.cursor() as cursor:
        cursor.execute(_UPSERT_SQL, [name, window_end])
        row = cursor.fetchone()
    return int(row[0])
