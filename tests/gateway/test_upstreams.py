"""The live table of one web process (``gateway.routing.upstreams``): a request waiting for a
model's first upstream."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from control.models import Replica, ServedModel, Shard
from gateway.routing import prefix
from gateway.routing.table import CatalogRow, ReplicaRow, build_table
from gateway.routing.upstreams import Upstreams
from tests.harness.factories import serve_model
from tests.harness.waits import await_until


@contextlib.asynccontextmanager
async def refreshing() -> AsyncIterator[Upstreams]:
    """A process's live table, its refresh task running (loads and stamps) until the end."""
    upstreams = Upstreams()
    await upstreams.ready()
    try:
        yield upstreams
    finally:
        assert upstreams._task is not None
        upstreams._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await upstreams._task


@pytest.mark.django_db(transaction=True)
async def test_a_waiter_notes_demand_and_gets_the_route_once_a_load_brings_an_upstream() -> None:
    served = await sync_to_async(serve_model)("cold", [8001], ready=False)
    [replica] = served.replicas
    async with refreshing() as upstreams:
        route = upstreams.table.resolve("cold")
        assert route is not None and route.upstreams == ()
        waiter = asyncio.create_task(
            upstreams.wait_for_upstream(route, "cold", until=time.monotonic() + 3600)
        )

        async def demand_stamped() -> bool:
            return await ServedModel.objects.filter(
                pk=served.model.pk, demand_at__isnull=False
            ).aexists()

        await await_until(demand_stamped, what="the model's demand stamp")
        assert not waiter.done(), "no upstream yet: still waiting"

        await Replica.objects.filter(pk=replica.pk).aupdate(observed=Replica.Observed.READY)
        upstreams.request_refresh()
        ready = await waiter
        assert ready is not None and ready.name == "cold"
        assert [u.id for u in ready.upstreams] == [f"replica:{replica.pk}"]


@pytest.mark.django_db(transaction=True)
async def test_a_model_added_after_the_last_load_is_found_by_its_first_request() -> None:
    """Another process added the model (no signal reaches this one): the request that names it
    waits for a table load that began after it came, instead of a 404 until the next refresh."""
    async with refreshing() as upstreams:
        assert await upstreams.resolve("added-elsewhere") is None
        await sync_to_async(serve_model)("added-elsewhere", [8002])
        route = await upstreams.resolve("added-elsewhere")
        assert route is not None and len(route.upstreams) == 1


@pytest.mark.django_db(transaction=True)
async def test_requests_for_names_nobody_serves_cost_a_load_per_interval_not_one_each(
    monkeypatch: pytest.MonkeyPatch, settings: Any
) -> None:
    """A client sending made-up model names (a typo in a loop, or on purpose) must not turn
    each request into a load of the table: a hundred at once share the load that begins after
    them, and each is answered with no route."""
    from gateway.routing import loading
    from gateway.routing import upstreams as module

    loads = 0
    load_table = loading.load_table

    def counted(version: int) -> object:
        nonlocal loads
        loads += 1
        return load_table(version)

    monkeypatch.setattr(module, "load_table", counted)
    settings.LLMGW_ROUTING_REFRESH = 3600  # no periodic load: only the misses' count
    async with refreshing() as upstreams:
        first = loads
        answers = await asyncio.gather(*(upstreams.resolve(f"made-up-{n}") for n in range(100)))
        assert answers == [None] * 100
        assert loads - first == 1
        # And the next ones, each after the last was answered: one load each, not sooner than
        # MISS_RELOAD_EVERY_S after the one before (loads in a second, not requests).
        began = time.monotonic()
        for n in range(5):
            assert await upstreams.resolve(f"made-up-again-{n}") is None
        assert loads - first == 6
        assert time.monotonic() - began >= 4 * module.MISS_RELOAD_EVERY_S


@pytest.mark.django_db(transaction=True)
async def test_with_the_store_down_a_name_the_table_lacks_is_answered_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No load can say more while the store is away: the request is not held for one (nor
    does it make the refresh task try the store again and again)."""
    from gateway import dbthread

    async with refreshing() as upstreams:
        monkeypatch.setattr(dbthread, "store_down", lambda: True)
        woken = upstreams._wake
        assert woken is not None
        woken.clear()
        assert await upstreams.resolve("added-elsewhere") is None
        assert not woken.is_set() and not upstreams._miss_wanted


async def test_a_waiter_gets_none_at_its_time_limit_and_no_sooner() -> None:
    upstreams = Upstreams()
    upstreams.table = build_table([CatalogRow(id=1, name="cold")], [], [])
    route = upstreams.table.resolve("cold")
    assert route is not None and route.upstreams == ()
    until = time.monotonic() + 0.2
    assert await upstreams.wait_for_upstream(route, "cold", until=until) is None
    assert time.monotonic() >= until


async def test_a_route_that_has_an_upstream_comes_back_at_once_even_past_the_limit() -> None:
    upstreams = Upstreams()
    upstreams.table = build_table(
        [CatalogRow(id=1, name="warm")], [ReplicaRow(10, 1, "", "10.0.0.1", 8000)], []
    )
    route = upstreams.table.resolve("warm")
    assert route is not None
    ready = await upstreams.wait_for_upstream(route, "warm", until=time.monotonic() - 1)
    assert ready is not None and [u.id for u in ready.upstreams] == ["replica:10"]


@pytest.mark.django_db(transaction=True)
async def test_what_is_remembered_of_a_replica_follows_the_cache_size_its_engine_reported() -> None:
    served = await sync_to_async(serve_model)("m", [8001, 8002])
    small, untold = (f"replica:{r.pk}" for r in served.replicas)
    upstreams = Upstreams()
    await upstreams.refresh()
    keys = tuple(range(400))  # some 1.6 megabytes of prompt in 4 KiB blocks
    for uid in (small, untold):
        upstreams.placer.mirrors.hold(uid, keys)
    # 10,240 tokens at the first estimate of four bytes a token: 40 KiB of prompt.
    await Shard.objects.filter(replica=served.replicas[0]).aupdate(cache_tokens=10240)
    await upstreams.refresh()
    mirror = upstreams.placer.mirrors.by_upstream[small]
    assert mirror.ceiling == 40960 and 36 * 1024 < mirror.held <= 40960
    assert mirror.depth(keys) == len(mirror), "the head kept"
    # An engine that never said (an older agent) keeps the default bound, and all it held.
    other = upstreams.placer.mirrors.by_upstream[untold]
    assert (other.ceiling, len(other)) == (upstreams.placer.mirrors.default_ceiling, 400)

    # Engines count eight bytes of this prompt a token: the same cache holds more of it.
    dense = prefix.chain(b"x" * 8192, 1024, 64)
    for _ in range(200):
        upstreams.placer.measure(dense, 1024)
    await upstreams.refresh()
    assert 70_000 < mirror.ceiling <= 81_920
    # ...and at two bytes a token, less.
    for _ in range(400):
        upstreams.placer.measure(dense, 4096)
    await upstreams.refresh()
    assert 20_000 <= mirror.ceiling < 25_600
    assert mirror.held <= mirror.ceiling
