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
  in one atomic step; keys expire with their window. A reservation of tokens leaves a marker
  naming its request, and its correction (or, where the take's answer was lost, its release)
  is applied only while the marker is there: sent twice, it counts once, so a correction Redis
  did not take is sent again once it answers.
- The database otherwise (the embedded default): one guarded upsert per counter, in one
  transaction; a counter that would pass its limit rolls the whole reservation back.

Keys without limits cost nothing here: no counter, no round trip. A limit that cannot be checked
(Redis or the store unreachable) is not waived: the request is refused at once, 503
``limits_unavailable`` with Retry-After.
"""

from __future__ import annotations

import asyncio
import calendar
import logging
import time
from collections.abc import Coroutine, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any, Protocol

import redis as redis_sync
from django.conf import settings
from django.db import DatabaseError, connection, transaction
from redis import asyncio as redis_asyncio
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from gateway import dbthread
from gateway.errors import ApiError
from gateway.identity.keys import KeyInfo
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


@dataclass(frozen=True)
class Reservation:
    counters: tuple[Counter, ...]
    reserved_tokens: int
    request_id: str = ""  # whose: its correction is applied once, however often it is sent

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
    ``COUNTER_REDIS_TIMEOUT_S``."""

    corrects_once = True

    def __init__(self, url: str) -> None:
        self._client: Any = redis_asyncio.Redis.from_url(
            url, **counter_redis_options(for_asyncio=True)
        )
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
        client: Any = redis_sync.Redis.from_url(settings.REDIS_URL, **counter_redis_options())
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


async def reserve(
    key: KeyInfo, tokens: int, now: float | None = None, *, request_id: str = ""
) -> Reservation:
    """Take this request's share of every limit of its key, or raise 429. ``request_id``
    names the reservation, so that its correction counts once however often it is sent."""
    if not key.scopes:
        return NO_RESERVATION
    now = time.time() if now is None else now
    counters = counters_for(key, tokens, now)
    try:
        refused = await store().take(counters, request_id)
    except (DatabaseError, RedisError) as exc:
        # Fail closed: a limit that cannot be checked is not waived. Keys without limits are
        # not affected (they never get here). The take may have counted before its answer was
        # lost: it is given back (if it was taken) once the counters answer again.
        logger.warning("limit counters unavailable: %s", type(exc).__name__)
        owed.add(_Owed(tuple(counters), None, request_id))
        raise ApiError(
            503,
            "This key's limits cannot be checked right now.",
            "limits_unavailable",
            retry_after=5,
        ) from None
    if refused is not None:
        raise refusal(refused, now)
    return Reservation(counters, tokens, request_id)


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
    """Correct the token counters to what the request really used, off the request path (a
    named reservation is settled even with nothing to correct: that clears its marker)."""
    token_counters = reservation.token_counters()
    delta = used_tokens - reservation.reserved_tokens
    if not token_counters or (delta == 0 and not reservation.request_id):
        return
    _in_background(owed.pay(_Owed(token_counters, delta, reservation.request_id)))


@dataclass(frozen=True)
class _Owed:
    """A correction owed to the counters: ``delta`` added to each of ``counters`` (None: the
    reservation given back whole)."""

    counters: tuple[Counter, ...]
    delta: int | None
    request_id: str


class Corrections:
    """Corrections the counters could not take when they were made, tried again until they
    do. Only named ones (applied once, however often sent) are kept: a bare increment whose
    answer was lost may have counted, and sending it again could count it twice."""

    RETRY_EVERY_S = 1.0
    KEEP = 100_000  # the oldest are dropped past this many (an outage of hours)

    def __init__(self) -> None:
        self.pending: list[_Owed] = []
        self._task: asyncio.Task[None] | None = None

    async def pay(self, correction: _Owed) -> None:
        try:
            await _apply(correction)
        except (DatabaseError, RedisError) as exc:
            logger.warning(
                "could not correct %d limit counters (%s); %s",
                len(correction.counters),
                type(exc).__name__,
                "tried again when they answer"
                if correction.request_id and store().corrects_once
                else "left as reserved",
            )
            self.add(correction)
        except Exception:
            logger.exception("could not correct %d limit counters", len(correction.counters))

    def add(self, correction: _Owed) -> None:
        if not (correction.request_id and store().corrects_once):
            return  # the counter keeps the reservation: charged what it reserved, never less
        self.pending = [*self.pending[-(self.KEEP - 1) :], correction]
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._retry())

    async def _retry(self) -> None:
        while self.pending:
            await asyncio.sleep(self.RETRY_EVERY_S)
            while self.pending:
                try:
                    await _apply(self.pending[0])
                except (DatabaseError, RedisError):
                    break  # still away: the next round
                except Exception:
                    logger.exception("a limit counter correction failed; dropped")
                del self.pending[0]


owed = Corrections()


async def _apply(correction: _Owed) -> None:
    if correction.delta is None:
        await store().release(correction.counters, correction.request_id)
    else:
        await store().adjust(correction.counters, correction.delta, correction.request_id)
