"""Per-key limits: requests per minute, tokens per minute, and a token budget per period.

A request reserves what it may use *before* it is relayed — one request against rpm, and its
estimated prompt plus its output cap times ``n`` against tpm and the budget (``plan``) —
atomically across every web process, so N processes cannot let N times the limit through.
Where a token limit applies, the body sent to the engine is bound to that cap, so the engine
cannot produce more than was admitted. When the request ends the reservation is corrected to
the tokens really used.

Windows are fixed (the current UTC minute, day, ISO week or month): exact and cheap to share.
Two stores, chosen by configuration:

- Redis (``REDIS_URL`` set): one Lua script checks and increments all counters of a request
  in one atomic step; keys expire with their window.
- The database otherwise (the embedded default): one guarded upsert per counter, in one
  transaction; a counter that would pass its limit rolls the whole reservation back.

Keys without limits cost nothing here: no counter, no round trip.
"""

from __future__ import annotations

import asyncio
import calendar
import logging
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any, Protocol

import redis as redis_sync
from django.conf import settings
from django.db import DatabaseError, connection, transaction
from redis import asyncio as redis_asyncio
from redis.exceptions import RedisError

from gateway import dbthread
from gateway.errors import ApiError
from gateway.identity.keys import KeyInfo

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


@dataclass(frozen=True)
class Reservation:
    counters: tuple[Counter, ...]
    reserved_tokens: int

    def token_counters(self) -> tuple[Counter, ...]:
        return tuple(c for c in self.counters if c.kind != "rpm")


NO_RESERVATION = Reservation((), 0)


def period_bounds(period: str, now: float) -> tuple[float, float]:
    """Start and end (Unix time, UTC) of the budget period containing ``now``."""
    moment = datetime.fromtimestamp(now, tz=UTC)
    day = moment.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        start, end = day, day + timedelta(days=1)
    elif period == "week":
        start = day - timedelta(days=day.weekday())
        end = start + timedelta(days=7)
    else:
        start = day.replace(day=1)
        days = calendar.monthrange(start.year, start.month)[1]
        end = start + timedelta(days=days)
    return start.timestamp(), end.timestamp()


def counters_for(key: KeyInfo, tokens: int, now: float) -> tuple[Counter, ...]:
    """The counters a request of ``tokens`` estimated tokens takes from (pure): those of every
    scope with a limit (the key, its owner, the owner's teams). Named by the scope (a key by
    its prefix, which is random, so counters never outlive a key into a different one), so
    all keys of one user or team take from the same counters in every web process."""
    minute = int(now // 60)
    minute_end = (minute + 1) * 60.0
    counters = []
    for scope in key.scopes:
        if scope.rpm_limit is not None:
            counters.append(
                Counter(
                    f"rpm:{scope.name}:{minute}", "rpm", scope.rpm_limit, 1, minute_end, scope.owner
                )
            )
        if scope.tpm_limit is not None:
            counters.append(
                Counter(
                    f"tpm:{scope.name}:{minute}",
                    "tpm",
                    scope.tpm_limit,
                    tokens,
                    minute_end,
                    scope.owner,
                )
            )
        if scope.token_budget is not None:
            counters.append(
                budget_counter(
                    scope.name,
                    scope.token_budget,
                    scope.budget_period,
                    tokens,
                    now,
                    owner=scope.owner,
                )
            )
    return tuple(counters)


def budget_counter(
    scope: str, limit: int, period: str, amount: int, now: float, *, owner: str = "this key"
) -> Counter:
    """The budget counter of ``scope`` ("key:PREFIX", "user:ID", "team:ID") for the period
    containing ``now`` (pure): what requests take from, and what a refresh puts right."""
    start, end = period_bounds(period, now)
    return Counter(f"budget:{scope}:{int(start)}", "budget", limit, amount, end, owner)


@dataclass(frozen=True)
class Plan:
    """What a request reserves: ``tokens`` in all, of which ``output_cap`` per choice is the
    output it may generate (None for routes that generate nothing)."""

    tokens: int
    output_cap: int | None


def plan(
    body_length: int,
    max_tokens: int | None,
    n: int,
    *,
    generates: bool,
    context_length: int | None = None,
) -> Plan:
    """A deliberately generous reservation (pure): ~4 bytes of JSON per prompt token, plus the
    output cap for each choice. The cap is the largest max-token field the client sent; with
    none, what the model's context leaves after the prompt, or ``LLMGW_DEFAULT_MAX_TOKENS``
    when the context length is not known. It is corrected to the real count when the request
    ends."""
    prompt = body_length // 4
    if not generates:
        return Plan(prompt, None)
    if max_tokens is not None:
        cap = max_tokens
    elif context_length is not None:
        cap = max(1, context_length - prompt)
    else:
        cap = int(settings.LLMGW_DEFAULT_MAX_TOKENS)
    return Plan(prompt + cap * n, cap)


# The field a too-long prompt is named by, per route kind (as OpenAI names it).
_PROMPT_PARAM = {"chat": "messages", "completions": "prompt", "responses": "input"}


def context_refusal(
    kind: str, prompt_floor: int, max_tokens: int | None, context_length: int | None
) -> ApiError | None:
    """The OpenAI-shaped 400 for a request that cannot fit the model's context (pure): its
    prompt (at least ``prompt_floor`` tokens) plus the output it asks for, or, asking for none,
    the prompt alone with no room for one output token. None when it may fit, or when the
    context length is not known."""
    if context_length is None:
        return None
    output = max_tokens if max_tokens is not None else 1
    if prompt_floor + output <= context_length:
        return None
    asked = (
        f"at least {prompt_floor + output} tokens ({prompt_floor} or more in the prompt, "
        f"{output} in the completion)"
        if max_tokens is not None
        else f"a prompt of at least {prompt_floor} tokens, leaving no room for the completion"
    )
    return ApiError(
        400,
        f"This model's maximum context length is {context_length} tokens. However, you "
        f"requested {asked}. Please reduce the length of the prompt or the completion.",
        "context_length_exceeded",
        param=_PROMPT_PARAM.get(kind, "messages"),
    )


def refusal(counter: Counter, now: float) -> ApiError:
    """The OpenAI-shaped 429 for the counter that would overflow, naming the limit."""
    retry = max(1.0, counter.window_end - now)
    if counter.kind == "budget":
        if counter.amount > counter.limit:
            return ApiError(
                429,
                f"This request may use {counter.amount} tokens, more than {counter.owner}'s "
                f"token budget of {counter.limit} per period; lower max_tokens (without it the "
                "whole output the model allows is reserved).",
                "insufficient_quota",
            )
        return ApiError(
            429,
            f"{counter.owner[:1].upper()}{counter.owner[1:]}'s token budget for the period "
            "is used up.",
            "insufficient_quota",
            retry_after=retry,
        )
    if counter.amount > counter.limit:
        return ApiError(
            429,
            f"This request may use {counter.amount} tokens, more than {counter.owner}'s "
            f"{counter.limit} tokens per minute; lower max_tokens (without it the whole output "
            "the model allows is reserved).",
            "rate_limit_exceeded",
        )
    what = "requests" if counter.kind == "rpm" else "tokens"
    return ApiError(
        429,
        f"Rate limit reached: {counter.limit} {what} per minute for {counter.owner}.",
        "rate_limit_exceeded",
        retry_after=retry,
    )


class Store(Protocol):
    async def take(self, counters: Sequence[Counter]) -> Counter | None:
        """Take every counter's amount, or none of them: returns the first that would overflow."""

    async def adjust(self, counters: Sequence[Counter], delta: int) -> None:
        """Add ``delta`` (negative gives tokens back) to counters taken before."""


# KEYS: counter names. ARGV: amount, limit, ttl for each key in turn.
_TAKE_LUA = """
for i = 1, #KEYS do
  local used = tonumber(redis.call('GET', KEYS[i]) or '0')
  if used + tonumber(ARGV[3 * i - 2]) > tonumber(ARGV[3 * i - 1]) then return i end
end
for i = 1, #KEYS do
  redis.call('INCRBY', KEYS[i], ARGV[3 * i - 2])
  redis.call('EXPIRE', KEYS[i], ARGV[3 * i])
end
return 0
"""


class RedisStore:
    def __init__(self, url: str) -> None:
        self._client: Any = redis_asyncio.Redis.from_url(url)
        self._take: Any = self._client.register_script(_TAKE_LUA)

    async def take(self, counters: Sequence[Counter]) -> Counter | None:
        now = time.time()
        args: list[int] = []
        for c in counters:
            args += [c.amount, c.limit, max(1, int(c.window_end - now) + 60)]
        failed = int(await self._take(keys=[f"llmgw:{c.name}" for c in counters], args=args))
        return counters[failed - 1] if failed else None

    async def adjust(self, counters: Sequence[Counter], delta: int) -> None:
        async with self._client.pipeline(transaction=False) as pipe:
            for c in counters:
                pipe.incrby(f"llmgw:{c.name}", delta)
            await pipe.execute()


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
        client: Any = redis_sync.Redis.from_url(settings.REDIS_URL)
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

    def __init__(self) -> None:
        self._next_purge = 0.0

    async def take(self, counters: Sequence[Counter]) -> Counter | None:
        now = time.time()
        if now >= self._next_purge:
            self._next_purge = now + self.PURGE_EVERY_S
            await dbthread.for_request(purge_expired, now)
        return await dbthread.for_request(
            _take_in_store, counters, undo=partial(_give_back_in_store, counters)
        )

    async def adjust(self, counters: Sequence[Counter], delta: int) -> None:
        await dbthread.in_background(_adjust_in_store, counters, delta)


_store: Store | None = None


def store() -> Store:
    global _store
    if _store is None:
        _store = RedisStore(settings.REDIS_URL) if settings.REDIS_URL else DatabaseStore()
    return _store


async def reserve(key: KeyInfo, tokens: int, now: float | None = None) -> Reservation:
    """Take this request's share of every limit of its key, or raise 429."""
    if not key.scopes:
        return NO_RESERVATION
    now = time.time() if now is None else now
    counters = counters_for(key, tokens, now)
    try:
        refused = await store().take(counters)
    except (DatabaseError, RedisError) as exc:
        # Fail closed: a limit that cannot be checked is not waived. Keys without limits are
        # not affected (they never get here).
        logger.warning("limit counters unavailable: %s", type(exc).__name__)
        raise ApiError(
            503,
            "This key's limits cannot be checked right now.",
            "limits_unavailable",
            retry_after=5,
        ) from None
    if refused is not None:
        raise refusal(refused, now)
    return Reservation(counters, tokens)


_background: set[asyncio.Task[Any]] = set()


def _in_background(work: Coroutine[Any, Any, Any]) -> None:
    """Run ``work`` off the request path; its failure is logged, never raised."""
    task = asyncio.get_running_loop().create_task(_logged(work))
    _background.add(task)
    task.add_done_callback(_background.discard)


async def _logged(work: Coroutine[Any, Any, Any]) -> None:
    try:
        await work
    except DatabaseError as exc:
        logger.warning("limit counters: background work failed: %s", type(exc).__name__)


def settle(reservation: Reservation, used_tokens: int) -> None:
    """Correct the token counters to what the request really used, off the request path."""
    token_counters = reservation.token_counters()
    delta = used_tokens - reservation.reserved_tokens
    if not token_counters or delta == 0:
        return
    _in_background(_adjust(token_counters, delta))


async def _adjust(counters: Sequence[Counter], delta: int) -> None:
    try:
        await store().adjust(counters, delta)
    except Exception:
        logger.exception("could not settle %d token counters", len(counters))
