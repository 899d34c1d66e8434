"""Budget counters put right from the records (``gateway.identity.budgets``): a counter that was
lost (Redis restarted without persistence, a flushed table) must not let a key, a user or a team
spend its budget a second time; a refresh never gives back what running requests reserved."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth.models import Group, User
from django.utils import timezone

from control import leases
from control.reconciler.runner import process_reconciler
from gateway import tasks
from gateway.errors import ApiError
from gateway.identity import budgets, counters, keys, limits
from gateway.models import LimitCounter, TeamLimits, UserLimits
from tests.harness.factories import make_key, make_usage
from tests.harness.live import close_db_thread
from tests.harness.redis import RedisServer

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(params=["store", "redis"])
def counters_in(
    request: pytest.FixtureRequest, settings: Any, redis_server: RedisServer
) -> Iterator[str]:
    """Each test on both counter stores: the database (the embedded default) and Redis."""
    settings.REDIS_URL = redis_server.url if request.param == "redis" else ""
    counters._store = None
    yield request.param
    if request.param == "redis":
        asyncio.run(_flush(redis_server.url))
    counters._store = None
    close_db_thread()


async def _flush(url: str) -> None:
    from redis import asyncio as redis_asyncio

    client: Any = redis_asyncio.Redis.from_url(url)
    await client.flushall()
    await client.aclose()


def lose_every_counter(store: str, settings: Any) -> None:
    """What a Redis restart without persistence (or a truncated table) does."""
    if store == "redis":
        asyncio.run(_flush(settings.REDIS_URL))
    else:
        LimitCounter.objects.all().delete()
    counters._store = None


def spend(key: Any, tokens: int) -> None:
    """Usage the records hold for ``key`` this period (prompt + completion = ``tokens``)."""
    make_usage(
        model="m", api_key=key, started_at=timezone.now(), prompt_tokens=tokens, completion_tokens=0
    )


def reserve(raw_key: str, tokens: int) -> limits.Reservation:
    async def go() -> limits.Reservation:
        info = await keys.authenticate(f"Bearer {raw_key}")
        assert info is not None
        return await limits.reserve(info, tokens)

    try:
        return asyncio.run(go())
    finally:
        counters._store = None  # its client belongs to the loop that just ended


def test_a_lost_key_counter_is_lifted_to_the_recorded_spend(
    counters_in: str, settings: Any
) -> None:
    raw, key = make_key("alice", budget=1000)
    reserve(raw, 900)  # taken from the counter, then ...
    spend(key, 900)  # ... recorded when the request ended
    lose_every_counter(counters_in, settings)
    reserve(raw, 500)  # the lost counter admits what the records say was already spent

    assert budgets.refresh() == 1  # 500 on the counter, 900 in the records: lifted to 900
    with pytest.raises(ApiError) as refused:
        reserve(raw, 101)
    assert refused.value.status == 429 and refused.value.code == "insufficient_quota"
    assert reserve(raw, 100).reserved_tokens == 100


def test_a_refresh_never_gives_back_what_running_requests_reserved(
    counters_in: str, settings: Any
) -> None:
    raw, key = make_key("alice", budget=1000)
    reserve(raw, 300)
    spend(key, 300)  # the first request ended and was recorded (its reservation settled)
    reserve(raw, 600)  # another still running: reserved, not recorded
    assert budgets.refresh() == 0, "the counter (900) is above the records (300)"
    with pytest.raises(ApiError):
        reserve(raw, 200)
    assert reserve(raw, 100).reserved_tokens == 100


def test_users_and_teams_spread_over_keys_are_lifted_too(counters_in: str, settings: Any) -> None:
    first_raw, first = make_key("bob")
    second_raw, second = make_key("bob")
    bob = User.objects.get(username="bob")
    team = Group.objects.create(name="research")
    bob.groups.add(team)
    UserLimits.objects.create(user=bob, token_budget=2000)
    TeamLimits.objects.create(team=team, token_budget=5000)
    spend(first, 1000)
    spend(second, 900)
    lose_every_counter(counters_in, settings)

    assert budgets.refresh() == 2  # the user's counter and the team's
    with pytest.raises(ApiError) as refused:
        reserve(first_raw, 200)  # the user has 100 left, whichever key asks
    assert "account" in str(refused.value)
    assert reserve(second_raw, 100).reserved_tokens == 100


def test_the_beat_task_acts_only_on_the_leader(
    counters_in: str, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw, key = make_key("alice", budget=1000)
    spend(key, 1000)
    reconciler = process_reconciler()
    monkeypatch.setattr(reconciler, "leadership", None)
    assert tasks.refresh_budgets() == 0
    reserve(raw, 10)  # nothing was lifted: a follower leaves counters alone
    lose_every_counter(counters_in, settings)
    monkeypatch.setattr(reconciler, "leadership", leases.claim())
    assert tasks.refresh_budgets() == 1
    with pytest.raises(ApiError):
        reserve(raw, 1)
