"""The limit counters: each one window of one limit, taken from atomically by every web process.

Two stores, chosen by configuration:

- Redis (``REDIS_URL`` set): one Lua script checks and increments all counters of a request
  in one atomic step; keys expire with their window. A reservation of tokens leaves a marker
  naming its request, and its correction (or, where the take's answer was lost, its release)
  is applied only while the marker is there: sent twice, it counts once, so a correction Redis
  did not take is sent again once it answers.
- The database otherwise (the embedded default): one guarded upsert per counter, in one
  transaction; a counter that would pass its limit rolls the whole reservation back.

A take is all or nothing: a request takes every counter of its limits or none of them. Which
counters a request takes, and what a refusal says, is :mod:`gateway.identity.limits`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import redis as redis_sync
from django.conf import settings
from django.db import connection, transaction
from redis import asyncio as redis_asyncio
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway import dbthread
from llmgw_site.config import counter_redis_options

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Counter:
    """One window of one limit, and what this request takes from it."""

    name: str
    kind: str  # "rpm", "tpm" or "budget"
    limit: int
    amount: int
    window_end: float  # Unix time
    owner: str = "this key"  # whose limit it is, as a refusal names it


class Store(Protocol):
    # Whether a named correction (adjust, release) counts once however often it is sent, so
    # that one whose answer was lost may be sent again.
    corrects_once: bool

    async def take(self, counters: Sequence[Counter], request_id: str = "") -> Counter | None:
        """Take every counter's amount, or none of them: returns the first that would overflow."""

    async def adjust(self, counters: Sequence[Counter], delta: int, request_id: str = "") -> None:
        """Add ``delta`` (negative gives tokens back) to counters taken before."""

    async def release(self, counters: Sequence[Counter], request_id: str) -> None:
        """Give back a take whose answer was lost, if it was taken at all."""


# KEYS: counter names, then a reservation marker (optional). ARGV: amount, limit, ttl for each
# counter in turn, then the marker's ttl. The marker says "request R holds a reservation here",
# so that its correction, or its release, is applied exactly once (_ONCE_LUA).
_TAKE_LUA = """
local counters = math.floor(#ARGV / 3)
for i = 1, counters do
  local used = tonumber(redis.call('GET', KEYS[i]) or '0')
  if used + tonumber(ARGV[3 * i - 2]) > tonumber(ARGV[3 * i - 1]) then return i end
end
for i = 1, counters do
  redis.call('INCRBY', KEYS[i], ARGV[3 * i - 2])
  redis.call('EXPIRE', KEYS[i], ARGV[3 * i])
end
if #KEYS > counters then redis.call('SET', KEYS[#KEYS], '1', 'EX', ARGV[#ARGV]) end
return 0
"""
# KEYS: counter names, then the reservation's marker. ARGV: what to add to each counter. Applied
# only while the marker is there, which it removes: sent twice (its first answer lost), or for
# a take that never happened, it changes nothing.
_ONCE_LUA = """
if redis.call('DEL', KEYS[#KEYS]) == 0 then return 0 end
for i = 1, #KEYS - 1 do redis.call('INCRBY', KEYS[i], ARGV[i]) end
return 1
"""
# A marker outlives any request (a stream of hours); it is removed when its request settles.
MARKER_TTL_S = 86_400


class RedisStore:
    """Counters in Redis. No call is retried (a call whose answer was lost may have counted,
    and counting it again would count twice), and one that Redis does not answer fails within
    ``LLMGW_STORE_WAIT``, as a call to the store would: the wait is wall time on a busy
    event loop (at 1 s, fifty requests at once on a loaded 2-core machine had six answered 503
    ``limits_unavailable`` by a Redis that was there all along)."""

    corrects_once = True

    def __init__(self, url: str) -> None:
        self._client: Any = redis_asyncio.Redis.from_url(
            url, **counter_redis_options(settings.LLMGW_STORE_WAIT, for_asyncio=True)
        )
        pool = self._client.connection_pool
        pool.connection_class = _reconnecting_if_lost(pool.connection_class)
        self._take: Any = self._client.register_script(_TAKE_LUA)
        self._once: Any = self._client.register_script(_ONCE_LUA)

    async def take(self, counters: Sequence[Counter], request_id: str = "") -> Counter | None:
        now = time.time()
        keys = [f"llmgw:{c.name}" for c in counters]
        args: list[int] = []
        for c in counters:
            args += [c.amount, c.limit, max(1, int(c.window_end - now) + 60)]
        if _marked(counters, request_id):
            keys.append(_marker(request_id))
            args.append(MARKER_TTL_S)
        with _transport_errors():
            failed = int(await self._take(keys=keys, args=args))
        return counters[failed - 1] if failed else None

    async def adjust(self, counters: Sequence[Counter], delta: int, request_id: str = "") -> None:
        if request_id:
            await self._apply_once(counters, [delta] * len(counters), request_id)
            return
        with _transport_errors():
            async with self._client.pipeline(transaction=False) as pipe:
                for c in counters:
                    pipe.incrby(f"llmgw:{c.name}", delta)
                await pipe.execute()

    async def release(self, counters: Sequence[Counter], request_id: str) -> None:
        if _marked(counters, request_id):
            await self._apply_once(counters, [-c.amount for c in counters], request_id)

    async def _apply_once(
        self, counters: Sequence[Counter], deltas: list[int], request_id: str
    ) -> None:
        keys = [f"llmgw:{c.name}" for c in counters] + [_marker(request_id)]
        with _transport_errors():
            await self._once(keys=keys, args=deltas)


def _reconnecting_if_lost(base: Any) -> Any:
    """``base`` (the connection class the URL chose: TCP, TLS or a Unix socket), connecting
    afresh before it sends on a connection that was closed while idle in the pool (a firewall
    reset it, Redis restarted). redis-py's asyncio pool hands such a connection out, and the
    first write on it fails ("Connection lost"): as no call is retried, a request would be
    refused 503 seconds after Redis came back, by a connection the outage left behind (CI saw
    one four seconds after). Nothing of the command has been written then, so sending it on a
    new connection cannot count it twice."""

    class ReconnectingIfLost(base):  # type: ignore[misc]
        async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            # Redis never half-closes a connection it still serves: at EOF, it is gone.
            reader, writer = self._reader, self._writer
            if reader is not None and (
                reader.at_eof() or reader.exception() or writer.transport.is_closing()
            ):
                await self.disconnect(nowait=True)
            await super().send_packed_command(command, check_health)

    return ReconnectingIfLost


def _marked(counters: Sequence[Counter], request_id: str) -> bool:
    """A take is marked where it has token counters to correct (rpm alone needs none: each
    minute's counter is gone the next, and a marker per request would outlive it)."""
    return bool(request_id) and any(c.kind != "rpm" for c in counters)


def _marker(request_id: str) -> str:
    return f"llmgw:reservation:{request_id}"


@contextmanager
def _transport_errors() -> Iterator[None]:
    """A connection lost under redis-py can surface as the event loop's own error (uvloop:
    RuntimeError "the handler is closed", measured with Redis cut mid-call) or an OSError
    rather than its ConnectionError: all the same, Redis did not answer."""
    try:
        yield
    except (OSError, RuntimeError) as exc:
        raise RedisConnectionError(f"{type(exc).__name__}: {exc}") from exc


# The guard sits in DO UPDATE's WHERE: a conflicting row that would pass its limit is left
# alone and RETURNING yields nothing, which is how "refused" is seen, in one statement.
_UPSERT_SQL = """
INSERT INTO gateway_limitcounter (name, used, window_end) VALUES (%s, %s, %s)
ON CONFLICT (name) DO UPDATE SET used = gateway_limitcounter.used + excluded.used
WHERE gateway_limitcounter.used + excluded.used <= %s
RETURNING used
"""
_ADJUST_SQL = "UPDATE gateway_limitcounter SET used = used + %s WHERE name = %s"
_PURGE_SQL = "DELETE FROM gateway_limitcounter WHERE window_end < %s"


class _Refused(Exception):
    def __init__(self, counter: Counter) -> None:
        self.counter = counter


def _take_in_store(counters: Sequence[Counter]) -> Counter | None:
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            for c in counters:
                if c.amount > c.limit:
                    raise _Refused(c)
                cursor.execute(_UPSERT_SQL, [c.name, c.amount, c.window_end, c.limit])
                if cursor.fetchone() is None:
                    raise _Refused(c)  # rolls back the counters taken before this one
    except _Refused as refused:
        return refused.counter
    return None


def _adjust_in_store(counters: Sequence[Counter], delta: int) -> None:
    with transaction.atomic(), connection.cursor() as cursor:
        for c in counters:
            cursor.execute(_ADJUST_SQL, [delta, c.name])


def _give_back_in_store(counters: Sequence[Counter], refused: Counter | None) -> None:
    """Undo a take whose request was answered 503 before the store answered it."""
    if refused is None:
        with transaction.atomic(), connection.cursor() as cursor:
            for c in counters:
                cursor.execute(_ADJUST_SQL, [-c.amount, c.name])


def purge_expired(now: float) -> int:
    with connection.cursor() as cursor:
        cursor.execute(_PURGE_SQL, [now - 60])
        return int(cursor.rowcount)


# KEYS: counter names. ARGV: floor, ttl for each key in turn. Raises, never lowers: a
# counter also holds the reservations of requests still running.
_RAISE_LUA = """
local raised = 0
for i = 1, #KEYS do
  local used = tonumber(redis.call('GET', KEYS[i]) or '0')
  if used < tonumber(ARGV[2 * i - 1]) then
    redis.call('SET', KEYS[i], ARGV[2 * i - 1], 'EX', ARGV[2 * i])
    raised = raised + 1
  end
end
return raised
"""
_RAISE_SQL = """
INSERT INTO gateway_limitcounter (name, used, window_end) VALUES (%s, %s, %s)
ON CONFLICT (name) DO UPDATE SET used = excluded.used
WHERE gateway_limitcounter.used < excluded.used
"""


def raise_counters(counters: Sequence[Counter]) -> int:
    """Lift each counter to at least its ``amount`` (what the records say was spent), in the
    store requests take from; returns how many were below. Synchronous: for the beat task."""
    if not counters:
        return 0
    if settings.REDIS_URL:
        client: Any = redis_sync.Redis.from_url(
            settings.REDIS_URL, **counter_redis_options(settings.LLMGW_STORE_WAIT)
        )
        try:
            now = time.time()
            args: list[int] = []
            for c in counters:
                args += [c.amount, max(1, int(c.window_end - now) + 60)]
            script = client.register_script(_RAISE_LUA)
            return int(script(keys=[f"llmgw:{c.name}" for c in counters], args=args))
        finally:
            client.close()
    raised = 0
    with transaction.atomic(), connection.cursor() as cursor:
        for c in counters:
            cursor.execute(_RAISE_SQL, [c.name, c.amount, c.window_end])
            raised += cursor.rowcount
    return raised


class DatabaseStore:
    """Counters in the store: a request waits for its take (and, every ``PURGE_EVERY_S``, the
    purge of ended windows before it) in the request lane of ``gateway.dbthread``, refused at
    once while the store is unreachable; corrections go to the background lane."""

    PURGE_EVERY_S = 300.0
    # A correction is one UPDATE adding to the counter: sent again after its answer was lost,
    # it could count twice. So a failed one is not sent again (the reservation stays counted).
    corrects_once = False

    def __init__(self) -> None:
        self._next_purge = 0.0

    async def take(self, counters: Sequence[Counter], request_id: str = "") -> Counter | None:
        now = time.time()
        if now >= self._next_purge:
            self._next_purge = now + self.PURGE_EVERY_S
            await dbthread.for_request(purge_expired, now)
        return await dbthread.for_request(
            _take_in_store, counters, undo=partial(_give_back_in_store, counters)
        )

    async def adjust(self, counters: Sequence[Counter], delta: int, request_id: str = "") -> None:
        await dbthread.in_background(_adjust_in_store, counters, delta)

    async def release(self, counters: Sequence[Counter], request_id: str) -> None:
        """A take the store did not answer was rolled back with its transaction (one given up
        on while it ran is undone by the request lane itself)."""


_store: Store | None = None


def store() -> Store:
    global _store
    if _store is None:
        _store = RedisStore(settings.REDIS_URL) if settings.REDIS_URL else DatabaseStore()
    return _store
