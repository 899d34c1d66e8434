"""The gateway's store lanes (``gateway.dbthread``): what a request waits for never queues
behind background work, and while the store cannot be reached a request is told so at once
(L6, U3)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import OperationalError

from gateway import dbthread
from gateway.models import ApiKey
from tests.harness.live import close_db_thread
from tests.harness.store import unreachable_store
from tests.harness.waits import await_until


@pytest.fixture(autouse=True)
def _lanes_closed() -> Iterator[None]:
    yield
    close_db_thread()


def count_keys() -> int:
    return ApiKey.objects.count()


@pytest.mark.django_db(transaction=True)
async def test_during_an_outage_a_requests_call_is_refused_at_once_and_a_probe_ends_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(dbthread, "PROBE_EVERY_S", 0.0)
    calls: list[str] = []

    def counted() -> int:
        calls.append("ran")
        return count_keys()

    with unreachable_store(dbthread.close):  # the lanes' connections, not this thread's
        with pytest.raises(OperationalError):
            await dbthread.in_background(count_keys)
        assert dbthread.store_down()
        with pytest.raises(dbthread.StoreUnavailable):
            await dbthread.for_request(counted)
        assert calls == [], "a refused call never runs"
        with pytest.raises(OperationalError):  # the background lane is never refused
            await dbthread.in_background(count_keys)
    # Back: the refused request had the background lane try again, and that ends the outage.
    with pytest.raises(dbthread.StoreUnavailable):
        await dbthread.for_request(counted)
    await await_until(lambda: not dbthread.store_down(), what="the probe to find the store")
    assert await dbthread.for_request(counted) == 0 and calls == ["ran"]


async def test_a_call_unanswered_past_the_store_wait_is_given_up_and_its_late_success_undone(
    settings: Any,
) -> None:
    settings.LLMGW_STORE_WAIT = 0.2
    release = threading.Event()
    undone: list[str] = []

    def hung() -> str:
        release.wait(30)
        return "a slot"

    with pytest.raises(dbthread.StoreUnavailable):
        await dbthread.for_request(hung, undo=undone.append)
    assert dbthread.store_down(), "a store that does not answer begins an outage"
    release.set()
    await await_until(lambda: undone == ["a slot"], what="the late success undone")
    assert not dbthread.store_down(), "it answered in the end: the outage is over"


async def test_a_request_never_waits_behind_background_work(settings: Any) -> None:
    settings.LLMGW_STORE_WAIT = 30.0
    release = threading.Event()
    background = asyncio.ensure_future(dbthread.in_background(release.wait, 30.0))
    try:
        assert await asyncio.wait_for(dbthread.for_request(lambda: "answered"), 10) == "answered"
        assert not background.done()
    finally:
        release.set()
        await background
