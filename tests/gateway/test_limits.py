"""Limits: the counters a request takes (pure) and their atomic stores (the database on both
backends, and Redis)."""

from __future__ import annotations

import asyncio
import secrets
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from gateway.errors import ApiError
from gateway.identity import counters, limits
from gateway.identity.keys import KeyInfo, Scope, narrowest_models
from gateway.relay import counting
from tests.harness.live import close_db_thread
from tests.harness.proxy import TcpProxy
from tests.harness.redis import RedisServer
from tests.harness.waits import await_until


@pytest.fixture(autouse=True)
def _db_thread_closed() -> Iterator[None]:
    yield
    close_db_thread()


def key(*people: Scope, **limits_: Any) -> KeyInfo:
    prefix = "llmgw-" + secrets.token_hex(4)
    own = Scope(
        f"key:{prefix}",
        "this key",
        limits_.get("rpm"),
        limits_.get("tpm"),
        limits_.get("budget"),
        limits_.get("period", "month"),
    )
    return KeyInfo(
        id=1,
        user_id=1,
        prefix=prefix,
        allowed_models=frozenset(),
        rpm_limit=own.rpm_limit,
        tpm_limit=own.tpm_limit,
        token_budget=own.token_budget,
        budget_period=own.budget_period,
        expires_at=None,
        revoked=False,
        scopes=tuple(s for s in (own, *people) if s.limited),
    )


NOW = datetime(2026, 3, 18, 12, 30, 45, tzinfo=UTC).timestamp()  # a Wednesday


def test_a_key_without_limits_takes_no_counter() -> None:
    assert limits.counters_for(key(), 100, NOW) == ()


def test_rpm_takes_one_and_tpm_and_budget_take_the_estimate() -> None:
    taken = limits.counters_for(key(rpm=5, tpm=1000, budget=10**6), 120, NOW)
    assert [(c.kind, c.amount, c.limit) for c in taken] == [
        ("rpm", 1, 5),
        ("tpm", 120, 1000),
        ("budget", 120, 10**6),
    ]
    minute_end = datetime(2026, 3, 18, 12, 31, tzinfo=UTC).timestamp()
    assert taken[0].window_end == taken[1].window_end == minute_end


@pytest.mark.parametrize(
    ("period", "start", "end"),
    [
        ("day", datetime(2026, 3, 18, tzinfo=UTC), datetime(2026, 3, 19, tzinfo=UTC)),
        ("week", datetime(2026, 3, 16, tzinfo=UTC), datetime(2026, 3, 23, tzinfo=UTC)),
        ("month", datetime(2026, 3, 1, tzinfo=UTC), datetime(2026, 4, 1, tzinfo=UTC)),
    ],
)
def test_budget_periods_are_calendar_windows(period: str, start: datetime, end: datetime) -> None:
    assert limits.period_bounds(period, NOW) == (start.timestamp(), end.timestamp())


def test_the_reservation_covers_the_prompt_and_every_choice(settings: Any) -> None:
    settings.LLMGW_DEFAULT_MAX_TOKENS = 100
    assert limits.plan(400, None, 1, generates=True) == limits.Plan(200, 100)
    assert limits.plan(400, 10, 3, generates=True) == limits.Plan(130, 10)
    # With no max-token field, the context the model leaves after the prompt is reserved.
    assert limits.plan(400, None, 2, generates=True, context_length=1100) == limits.Plan(2100, 1000)
    assert limits.plan(400, None, 1, generates=False) == limits.Plan(100, None)


def test_what_cannot_fit_the_context_is_a_400_naming_it_and_the_rest_may_pass() -> None:
    too_long = limits.context_refusal("chat", 10, 100, 100)
    assert too_long is not None and too_long.status == 400
    assert too_long.code == "context_length_exceeded" and too_long.param == "messages"
    assert too_long.type == "invalid_request_error"
    assert "maximum context length is 100 tokens" in too_long.message
    assert limits.context_refusal("chat", 10, 90, 100) is None, "exactly full fits"
    # With no max-token field, only a prompt that leaves no room for one token is refused.
    assert limits.context_refusal("completions", 99, None, 100) is None
    alone = limits.context_refusal("completions", 100, None, 100)
    assert alone is not None and alone.param == "prompt"
    assert limits.context_refusal("responses", 10**6, 10**6, None) is None, "context unknown"


def test_the_prompt_floor_never_exceeds_what_a_tokenizer_could_count() -> None:
    chat = counting.prompt_of("chat", {"messages": [{"role": "user", "content": "x" * 80}]})
    assert counting.prompt_floor(chat) == 80 // counting.FLOOR_BYTES_PER_TOKEN
    batch = counting.prompt_of("completions", {"prompt": ["a" * 16, "b" * 800]})
    assert counting.prompt_floor(batch) == 100, "the longest prompt, each its own sequence"
    assert counting.prompt_floor(counting.Prompt()) == 0


def test_refusals_are_429_with_retry_after_until_the_window_ends() -> None:
    rpm, _, budget = limits.counters_for(key(rpm=1, tpm=10, budget=10), 5, NOW)
    assert limits.refusal(rpm, NOW).retry_after == pytest.approx(15)
    assert limits.refusal(budget, NOW).code == "insufficient_quota"
    too_big = counters.Counter("x", "tpm", 10, 50, NOW + 15)
    error = limits.refusal(too_big, NOW)
    assert error.status == 429 and error.retry_after is None  # waiting would not help


def run_in_threads(count: int, work: Any) -> list[Any]:
    results: list[Any] = []
    lock = threading.Lock()

    def one() -> None:
        value = work()
        with lock:
            results.append(value)

    threads = [threading.Thread(target=one) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


@pytest.mark.django_db(transaction=True)
def test_the_database_store_never_lets_racers_past_the_limit() -> None:
    """Eight threads, each its own connection, forty reservations against a limit of 15."""
    from django.db import connection

    taken = limits.counters_for(key(rpm=15, tpm=10**6), 10, NOW)

    def take() -> bool:
        try:
            return counters._take_in_store(taken) is None
        finally:
            connection.close()

    results = run_in_threads(40, take)
    assert results.count(True) == 15


@pytest.mark.django_db(transaction=True)
def test_a_refused_counter_rolls_back_the_ones_taken_before_it() -> None:
    rpm, tpm = limits.counters_for(key(rpm=10, tpm=100), 60, NOW)
    assert counters._take_in_store([rpm, tpm]) is None
    assert counters._take_in_store([rpm, tpm]) == tpm  # 120 > 100
    from gateway.models import LimitCounter

    used = dict(LimitCounter.objects.values_list("name", "used"))
    assert used == {rpm.name: 1, tpm.name: 60}
    counters._adjust_in_store([tpm], -50)  # the request used 10 of its 60
    assert LimitCounter.objects.get(name=tpm.name).used == 10
    assert counters._take_in_store([rpm, tpm]) is None


@pytest.mark.django_db(transaction=True)
async def test_reserve_raises_429_when_a_limit_is_reached(settings: Any) -> None:
    settings.REDIS_URL = ""
    counters._store = None
    limited = key(rpm=2)
    await limits.reserve(limited, 1, NOW)
    await limits.reserve(limited, 1, NOW)
    with pytest.raises(ApiError) as refused:
        await limits.reserve(limited, 1, NOW)
    assert refused.value.status == 429
    assert await limits.reserve(limited, 1, NOW + 60) is not None  # the next minute


async def test_the_redis_store_is_atomic_under_concurrency(redis_server: RedisServer) -> None:
    store = counters.RedisStore(redis_server.url)
    rpm, tpm = limits.counters_for(key(rpm=25, tpm=10**6), 7, NOW)
    results = await asyncio.gather(*(store.take([rpm, tpm]) for _ in range(60)))
    assert sum(r is None for r in results) == 25
    refused = {r.name for r in results if r is not None}
    assert refused == {rpm.name}
    await store.adjust([tpm], -7 * 25)
    assert int(await store._client.get(f"llmgw:{tpm.name}")) == 0
    assert 0 < await store._client.ttl(f"llmgw:{rpm.name}") <= 120
    await store._client.aclose()


async def test_a_named_correction_counts_once_however_often_it_is_sent(
    redis_server: RedisServer,
) -> None:
    """G21: a correction (or a release) whose answer was lost is sent again: it counts once,
    and a release for a take that never happened changes nothing."""
    store = counters.RedisStore(redis_server.url)
    rpm, tpm = limits.counters_for(key(rpm=100, tpm=10**6), 50, NOW + 7200)

    async def used(counter: counters.Counter) -> int:
        return int(await store._client.get(f"llmgw:{counter.name}") or 0)

    assert await store.take([rpm, tpm], "req_a") is None
    for _ in range(3):  # settled: 30 of the 50 reserved were used
        await store.adjust([tpm], -20, "req_a")
    assert (await used(rpm), await used(tpm)) == (1, 30)
    await store.release([rpm, tpm], "req_a")  # already settled: nothing left to give back
    assert (await used(rpm), await used(tpm)) == (1, 30)

    assert await store.take([rpm, tpm], "req_b") is None  # taken, but its answer "lost"
    for _ in range(2):
        await store.release([rpm, tpm], "req_b")
    assert (await used(rpm), await used(tpm)) == (1, 30)
    await store.release([rpm, tpm], "req_never_taken")
    assert (await used(rpm), await used(tpm)) == (1, 30)
    assert not await store._client.keys("llmgw:reservation:*"), "no marker outlives its request"
    await store._client.aclose()


async def test_a_connection_lost_while_idle_is_replaced_not_refused(
    redis_server: RedisServer,
) -> None:
    """G21: a firewall resets every connection to Redis, then lets new ones through again.
    The connections the pool kept idle are dead; the next takes connect afresh instead of
    failing on them (a request refused 503 while Redis answers, seen in CI four seconds after
    an outage), and each counts once."""
    proxy = TcpProxy(redis_server.port)
    store = counters.RedisStore(f"redis://127.0.0.1:{proxy.port}/0")
    (rpm,) = limits.counters_for(key(rpm=100), 1, NOW)
    pool = store._client.connection_pool
    try:
        assert await asyncio.gather(*(store.take([rpm]) for _ in range(4))) == [None] * 4
        assert len(pool._available_connections) == 4
        proxy.cut()
        proxy.restore()
        await await_until(
            lambda: all(c._reader.at_eof() for c in pool._available_connections),
            what="the pool's idle connections closed",
        )
        assert await asyncio.gather(*(store.take([rpm]) for _ in range(4))) == [None] * 4
        assert int(await store._client.get(f"llmgw:{rpm.name}")) == 8
    finally:
        await store._client.aclose()
        proxy.close()


async def test_corrections_redis_did_not_take_are_sent_again_once_it_answers(
    settings: Any, monkeypatch: pytest.MonkeyPatch, redis_server: RedisServer
) -> None:
    """G21: Redis cut off when a request settles; the correction waits and lands, once."""
    proxy = TcpProxy(redis_server.port)
    settings.REDIS_URL = f"redis://127.0.0.1:{proxy.port}/0"
    monkeypatch.setattr(counters, "_store", None)
    monkeypatch.setattr(limits.Corrections, "RETRY_EVERY_S", 0.05)
    try:
        reservation = await limits.reserve(key(tpm=10**6), 50, NOW + 7200, request_id="req_c")
        proxy.cut()
        limits.settle(reservation, 10)
        await await_until(lambda: limits.owed.pending, what="the correction kept")
        proxy.restore()
        await await_until(lambda: not limits.owed.pending, what="the correction sent again")
        (counter,) = reservation.token_counters()
        store = counters.store()
        assert isinstance(store, counters.RedisStore)
        assert int(await store._client.get(f"llmgw:{counter.name}")) == 10
        limits.settle(reservation, 10)  # sent again: changes nothing
        await await_until(lambda: not limits._background, what="the second settle")
        assert int(await store._client.get(f"llmgw:{counter.name}")) == 10
        await store._client.aclose()
    finally:
        proxy.close()


@pytest.mark.django_db(transaction=True)
async def test_limits_that_cannot_be_checked_are_not_waived(
    settings: Any, request: pytest.FixtureRequest
) -> None:
    settings.REDIS_URL = ""
    counters._store = None
    close_db_thread()
    # In the database thread: that is the connection the lookups use.
    await sync_to_async(request.getfixturevalue)("store_unreachable")
    with pytest.raises(ApiError) as unavailable:
        await limits.reserve(key(rpm=5), 1, NOW)
    assert unavailable.value.status == 503
    assert await limits.reserve(key(), 1, NOW) is limits.NO_RESERVATION  # no limits, no store


def test_a_users_and_a_teams_limits_take_counters_shared_by_all_their_keys() -> None:
    user = Scope("user:7", "your account", rpm_limit=5, token_budget=1000)
    team = Scope("team:3", "team 'ml'", tpm_limit=50)
    first, second = key(user, team, budget=100), key(user, team)
    names = [c.name for c in limits.counters_for(first, 10, NOW)]
    assert names[0].startswith(f"budget:key:{first.prefix}:")
    shared = [c.name for c in limits.counters_for(second, 10, NOW)]
    assert names[1:] == shared  # the user's and the team's: the same for both keys
    assert [c.owner for c in limits.counters_for(second, 10, NOW)] == [
        "your account",
        "your account",
        "team 'ml'",
    ]


@pytest.mark.parametrize(
    ("lists", "expected"),
    [
        ([[], [], []], (False, frozenset())),
        ([["a", "b"], [], ["b", "c"]], (True, frozenset({"b"}))),
        ([[], ["a"]], (True, frozenset({"a"}))),
        ([["a"], ["b"]], (True, frozenset())),  # nothing left: no model at all
    ],
)
def test_the_narrowest_model_list_wins(
    lists: list[list[str]], expected: tuple[bool, frozenset[str]]
) -> None:
    assert narrowest_models(lists) == expected
