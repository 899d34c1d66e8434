"""The live table of one web process (``gateway.routing.upstreams``): a request waiting for a
model's first upstream."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from asgiref.sync import sync_to_async

from control.models import Replica, ServedModel
from gateway.routing.table import CatalogRow, ReplicaRow, build_table
from gateway.routing.upstreams import Upstreams
from tests.harness.factories import serve_model
from tests.harness.waits import await_until


@pytest.mark.django_db(transaction=True)
async def test_a_waiter_notes_demand_and_gets_the_route_once_a_load_brings_an_upstream() -> None:
    served = await sync_to_async(serve_model)("cold", [8001], ready=False)
    [replica] = served.replicas
    upstreams = Upstreams()
    table = await upstreams.ready()  # its refresh task runs from here: loads and stamps
    try:
        route = table.resolve("cold")
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
    finally:
        assert upstreams._task is not None
        upstreams._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await upstreams._task


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
