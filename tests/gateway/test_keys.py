"""API keys: issued once, stored hashed, checked through an in-process cache (A6, G1)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext

from gateway import dbthread
from gateway.identity import keys
from gateway.models import ApiKey
from tests.harness.clock import FakeClock
from tests.harness.live import close_db_thread
from tests.harness.store import unreachable_store


@pytest.fixture(autouse=True)
def _db_thread_closed() -> Iterator[None]:
    yield
    close_db_thread()


pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def alice() -> Any:
    return get_user_model().objects.create_user(username="alice")


def test_a_key_is_high_entropy_prefixed_and_stored_only_as_its_hash(alice: Any) -> None:
    issued = keys.issue("alice", models=["b", "a", "a"])
    assert keys.well_formed(issued.key) and len(issued.key) == 49
    row = ApiKey.objects.get()
    assert row.prefix == issued.key[:14] and row.prefix.startswith("llmgw-")
    assert row.key_hash == hashlib.sha256(issued.key.encode()).hexdigest()
    assert issued.key not in str(ApiKey.objects.values().get())
    assert row.allowed_models == ["a", "b"]
    assert keys.issue("alice").key != issued.key


async def test_a_warm_key_costs_no_query_and_revocation_shows_after_the_ttl(
    alice: Any, settings: Any
) -> None:
    from asgiref.sync import sync_to_async

    settings.LLMGW_KEY_CACHE_TTL = 5.0
    clock = FakeClock()
    cache = keys.KeyCache(clock)
    issued = await sync_to_async(keys.issue)("alice")
    assert (await cache.lookup(issued.key)) is not None

    def warm_lookups() -> int:
        with CaptureQueriesContext(connection) as queries:
            return len(queries)

    before = await sync_to_async(warm_lookups)()
    info = await cache.lookup(issued.key)
    assert info is not None and before == 0
    await sync_to_async(keys.revoke)(issued.api_key.pk)
    assert (await cache.lookup(issued.key)) is not None  # still cached
    clock.advance(5.1)
    revoked = await cache.lookup(issued.key)
    assert revoked is not None and revoked.revoked and not revoked.usable(0)


async def test_a_key_in_use_is_reloaded_ahead_of_its_ttl_without_waiting(
    alice: Any, settings: Any
) -> None:
    from asgiref.sync import sync_to_async

    settings.LLMGW_KEY_CACHE_TTL = 4.0
    clock = FakeClock()
    cache = keys.KeyCache(clock)
    issued = await sync_to_async(keys.issue)("alice")
    assert await cache.lookup(issued.key) is not None
    await sync_to_async(keys.revoke)(issued.api_key.pk)
    clock.advance(2.5)  # past half the TTL: answered from the cache, reloaded behind it
    served = await cache.lookup(issued.key)
    assert served is not None and not served.revoked
    await cache.settled()
    reloaded = await cache.lookup(issued.key)
    assert reloaded is not None and reloaded.revoked


def recorded_batches(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The key hashes of every batch load from now on, each sorted."""
    batches: list[list[str]] = []
    real_many = keys._load_many

    def load_many(key_hashes: list[str]) -> dict[str, keys.KeyInfo | None]:
        batches.append(sorted(key_hashes))
        return real_many(key_hashes)

    monkeypatch.setattr(keys, "_load_many", load_many)
    return batches


async def test_keys_in_use_are_reloaded_in_one_batch_so_none_waits_past_its_ttl(
    alice: Any, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key used now and then is reloaded with the others in use: a request on it, even past
    the TTL since it was first loaded, finds it fresh without a load of its own, and a
    revocation made meanwhile is there. A key not used within KEEP_WARM_S is not reloaded."""
    from asgiref.sync import sync_to_async

    settings.LLMGW_KEY_CACHE_TTL = 5.0
    clock = FakeClock()
    cache = keys.KeyCache(clock)
    used, idle, other = [await sync_to_async(keys.issue)("alice") for _ in range(3)]
    for issued in (used, idle, other):
        assert await cache.lookup(issued.key) is not None
    await sync_to_async(keys.revoke)(used.api_key.pk)
    clock.advance(keys.KEEP_WARM_S - 1)
    assert (await cache.lookup(used.key)) is not None  # past the TTL: loaded again, waited for
    assert (await cache.lookup(other.key)) is not None
    clock.advance(4)  # `idle` was last used KEEP_WARM_S + 3 ago
    await sync_to_async(keys.revoke)(other.api_key.pk)
    batches = recorded_batches(monkeypatch)
    assert await cache.refresh_in_use() == 2
    assert batches == [sorted(keys.hash_key(i.key) for i in (used, other))]
    clock.advance(2.4)  # past the TTL since its own load; within half of it since the batch
    info = await cache.lookup(other.key)
    assert info is not None and info.revoked
    await cache.settled()
    assert len(batches) == 1  # no load of its own, not even behind the answer
    clock.advance(keys.KEEP_WARM_S)
    assert await cache.refresh_in_use() == 0  # none used since


async def test_only_the_most_recently_used_keys_are_kept_warm(
    alice: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asgiref.sync import sync_to_async

    monkeypatch.setattr(keys, "KEEP_WARM_MAX", 2)
    clock = FakeClock()
    cache = keys.KeyCache(clock)
    issued = [await sync_to_async(keys.issue)("alice") for _ in range(3)]
    for one in issued:
        clock.advance(1)
        assert await cache.lookup(one.key) is not None
    batches = recorded_batches(monkeypatch)
    assert await cache.refresh_in_use() == 2
    assert batches == [sorted(keys.hash_key(one.key) for one in issued[1:])]


def test_a_batch_of_keys_is_four_queries(alice: Any) -> None:
    hashes = [keys.hash_key(keys.issue("alice").key) for _ in range(3)]
    with CaptureQueriesContext(connection) as queries:
        found = keys._load_many([*hashes, "0" * 64])
    assert len(queries) == 4 and len([i for i in found.values() if i is not None]) == 3


async def test_a_batch_load_gives_each_key_what_a_load_of_it_alone_gives(alice: Any) -> None:
    """Owners in different teams, an inactive owner, a deleted key: the batch's joins give
    every key its own owner's and teams' limits and nothing of another's."""
    from asgiref.sync import sync_to_async
    from django.contrib.auth.models import Group

    from gateway.models import TeamLimits, UserLimits

    def fleet() -> list[str]:
        bob = get_user_model().objects.create_user(username="bob")
        get_user_model().objects.create_user(username="carol", is_active=False)
        ml, web = Group.objects.create(name="ml"), Group.objects.create(name="web")
        TeamLimits.objects.create(team=ml, rpm_limit=10, allowed_models=["a", "b"])
        TeamLimits.objects.create(team=web, tpm_limit=20, allowed_models=["b"])
        UserLimits.objects.create(user=bob, token_budget=30)
        alice.groups.add(ml)
        bob.groups.add(ml, web)
        issued = [keys.issue(name, rpm=5) for name in ("alice", "alice", "bob", "carol")]
        gone = keys.issue("bob")
        gone.api_key.delete()
        return [i.key for i in (*issued, gone)] + ["llmgw-" + "C" * 43]

    raw = await sync_to_async(fleet)()
    hashes = [keys.hash_key(key) for key in raw]
    together = await sync_to_async(keys._load_many)(hashes)
    alone = {h: await sync_to_async(keys._load)(h) for h in hashes}
    assert together == alone
    first, second, bobs, carols, gone, unknown = (together[h] for h in hashes)
    assert gone is None and unknown is None
    assert first is not None and second is not None and bobs is not None and carols is not None
    assert [s.owner for s in first.scopes] == ["this key", "team 'ml'"]
    assert first.allowed_models == {"a", "b"} and first.models_limited
    owners = {"this key", "your account", "team 'ml'", "team 'web'"}
    assert {s.owner for s in bobs.scopes} == owners
    assert bobs.allowed_models == {"b"}
    assert carols.revoked and not first.revoked and first.user_id == second.user_id


async def test_a_burst_of_misses_for_one_key_is_one_load_and_a_hang_up_cancels_none(
    alice: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1,000 streams opened at once on a fresh process: one load of the key, not 1,000."""
    import asyncio

    from asgiref.sync import sync_to_async

    issued = await sync_to_async(keys.issue)("alice")
    loads: list[str] = []
    release = asyncio.Event()
    real_load = keys._load

    async def slow_load(key_hash: str) -> keys.KeyInfo | None:
        loads.append(key_hash)
        await release.wait()
        return await sync_to_async(real_load)(key_hash)

    async def load_in_loop(fn: Any, *args: Any, **kwargs: Any) -> Any:
        assert fn is keys._load
        return await slow_load(*args)

    monkeypatch.setattr(dbthread, "for_request", load_in_loop)
    cache = keys.KeyCache(FakeClock())
    waiters = [asyncio.ensure_future(cache.lookup(issued.key)) for _ in range(50)]
    await asyncio.sleep(0)
    waiters[0].cancel()  # the first client hangs up: the load it started goes on for the rest
    release.set()
    answers = await asyncio.gather(*waiters[1:])
    assert len(loads) == 1
    assert {a.id for a in answers if a is not None} == {issued.api_key.pk}
    assert None not in answers and waiters[0].cancelled()
    assert await cache.lookup(issued.key) is answers[0] and len(loads) == 1  # stored


async def test_unknown_and_malformed_keys_are_none(alice: Any) -> None:
    assert await keys.authenticate(None) is None
    assert await keys.authenticate("Basic abc") is None
    assert await keys.authenticate("Bearer llmgw-short") is None
    assert await keys.authenticate("Bearer llmgw-" + "Z" * 43) is None


async def test_expiry_applies_to_the_second_even_when_cached(alice: Any) -> None:
    from asgiref.sync import sync_to_async

    soon = datetime.now(tz=UTC) + timedelta(seconds=30)
    issued = await sync_to_async(keys.issue)("alice", expires_at=soon)
    info = await keys.cache.lookup(issued.key)
    assert info is not None
    assert info.usable(soon.timestamp() - 1)
    assert not info.usable(soon.timestamp())


async def test_a_deactivated_owners_keys_stop_working(alice: Any) -> None:
    from asgiref.sync import sync_to_async

    issued = await sync_to_async(keys.issue)("alice")
    await sync_to_async(get_user_model().objects.filter(pk=alice.pk).update)(is_active=False)
    keys.cache.clear()
    assert await keys.authenticate(f"Bearer {issued.key}") is None


def test_expiry_accepts_dates_and_durations() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert keys.parse_expiry("30d", now=now) == now + timedelta(days=30)
    assert keys.parse_expiry("12h", now=now) == now + timedelta(hours=12)
    assert keys.parse_expiry("2027-01-01").year == 2027
    with pytest.raises(ValueError):
        keys.parse_expiry("soon")


def test_create_api_key_prints_the_key_once(alice: Any, capsys: Any) -> None:
    call_command("create_api_key", "alice", "--models", "m1,m2", "--rpm", "5", "--expires", "30d")
    out, err = capsys.readouterr()
    key = out.strip()
    row = ApiKey.objects.get()
    assert keys.hash_key(key) == row.key_hash
    assert (row.allowed_models, row.rpm_limit) == (["m1", "m2"], 5)
    assert row.expires_at is not None
    assert key not in err and row.prefix in err
    with pytest.raises(CommandError):
        call_command("create_api_key", "nobody")
    with pytest.raises(CommandError):
        call_command("create_api_key", "alice", "--expires", "tomorrow-ish")


async def test_a_known_key_keeps_working_within_the_ttl_while_the_store_is_down(
    alice: Any, settings: Any, request: pytest.FixtureRequest
) -> None:
    """U3's choice for keys: loaded within the TTL, trusted; never seen, or not confirmed
    within the TTL, 503 (the bound on revocation holds through an outage)."""
    from asgiref.sync import sync_to_async

    from gateway.errors import ApiError

    settings.LLMGW_KEY_CACHE_TTL = 1.0
    clock = FakeClock()
    cache = keys.KeyCache(clock)
    issued = await sync_to_async(keys.issue)("alice")
    assert await cache.lookup(issued.key) is not None
    close_db_thread()  # its open connection would otherwise hide the outage
    # In the database thread: that is the connection the lookups use.
    await sync_to_async(request.getfixturevalue)("store_unreachable")
    clock.advance(0.5)
    assert await cache.lookup(issued.key) is not None
    await cache.settled()
    with pytest.raises(ApiError) as unknown:
        await cache.lookup("llmgw-" + "B" * 43)
    assert unknown.value.status == 503 and unknown.value.retry_after
    clock.advance(0.6)
    with pytest.raises(ApiError):
        await cache.lookup(issued.key)


async def test_while_reloads_fail_a_key_works_within_the_ttl_and_is_refused_after_it(
    alice: Any, settings: Any
) -> None:
    """Revocation is visible within LLMGW_KEY_CACHE_TTL whatever the store does: a key not
    confirmed by a load within it is refused (503, the gateway cannot confirm keys now: the
    key may well be valid, so not 401), and counted; once the store answers again the key
    works again, or is refused as revoked if it was revoked meanwhile."""
    from asgiref.sync import sync_to_async
    from prometheus_client import REGISTRY

    from gateway.errors import ApiError
    from telemetry import metrics

    def refusals() -> float:
        metrics.write_tallies()
        return REGISTRY.get_sample_value("llmgw_keys_unconfirmed_total", {"key": "known"}) or 0.0

    settings.LLMGW_KEY_CACHE_TTL = 1.0
    clock = FakeClock()
    cache = keys.KeyCache(clock)
    kept, revoked = [await sync_to_async(keys.issue)("alice") for _ in range(2)]
    for issued in (kept, revoked):
        assert await cache.lookup(issued.key) is not None
    await sync_to_async(keys.revoke)(revoked.api_key.pk)
    close_db_thread()
    with unreachable_store(dbthread.close):  # the store lanes' connections: the lookups'
        clock.advance(0.9)  # within the TTL: answered from the cache, its reload fails behind
        info = await cache.lookup(kept.key)
        assert info is not None and info.usable(0)
        await cache.settled()
        clock.advance(0.2)  # past the TTL since the last load that succeeded
        before = refusals()
        for issued in (revoked, kept):
            with pytest.raises(ApiError) as refused:
                await cache.lookup(issued.key)
            assert refused.value.status == 503 and refused.value.retry_after
            assert "cannot confirm API keys" in refused.value.message
            assert issued.key not in refused.value.message
        assert refusals() == before + 2
    dbthread.outage.answered()  # the store is back (as the next call to reach it would say)
    info = await cache.lookup(kept.key)
    assert info is not None and info.usable(0)
    again = await cache.lookup(revoked.key)
    assert again is not None and again.revoked and not again.usable(0)
