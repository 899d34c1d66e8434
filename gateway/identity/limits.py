"""Per-key limits: requests per minute, tokens per minute, and a token budget per period.

A request reserves what it may use *before* it is relayed — one request against rpm, and its
estimated prompt plus its output cap times ``n`` against tpm and the budget (``plan``) —
atomically across every web process, so N processes cannot let N times the limit through.
Where a token limit applies, the body sent to the engine is bound to that cap, so the engine
cannot produce more than was admitted. When the request ends the reservation is corrected to
the tokens really used.

Windows are fixed (the current UTC minute, day, ISO week or month): exact and cheap to share.
The counters live in Redis or in the store (:mod:`gateway.identity.counters`).

Keys without limits cost nothing here: no counter, no round trip. A limit that cannot be checked
(Redis or the store unreachable) is not waived: the request is refused at once, 503
``limits_unavailable`` with Retry-After.
"""

from __future__ import annotations

import asyncio
import calendar
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import DatabaseError
from redis.exceptions import RedisError

from gateway.errors import ApiError
from gateway.identity.counters import Counter, store
from gateway.identity.keys import KeyInfo

logger = logging.getLogger(__name__)


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
