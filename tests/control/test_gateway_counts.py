"""What the web processes hold, counted across all of them, in both stores: the database (the
embedded default) and Redis (``REDIS_URL`` set). Processes are told apart by their id only, as
real web processes are, so one test plays several of them."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from control import gateway_counts
from control.models import GatewayCount
from tests.harness.factories import make_model
from tests.harness.redis import RedisServer

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(params=["store", "redis"])
def counts(request: pytest.FixtureRequest, settings: Any) -> Iterator[str]:
    """Each test once on the database, once on a private Redis (emptied first)."""
    gateway_counts._redis = None
    if request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        settings.REDIS_URL = server.url
        gateway_counts._client().flushall()
    else:
        settings.REDIS_URL = ""
    yield request.param
    gateway_counts._redis = None


def test_max_waiting_is_counted_across_processes(counts: str) -> None:
    model = make_model("cold")
    assert gateway_counts.take_waiting_slot("web-1", model.pk, 3)
    assert gateway_counts.take_waiting_slot("web-1", model.pk, 3)
    assert gateway_counts.take_waiting_slot("web-2", model.pk, 3)
    assert gateway_counts.waiting_for(model.pk) == 3
    assert not gateway_counts.take_waiting_slot("web-2", model.pk, 3), "three wait in all"
    assert not gateway_counts.take_waiting_slot("web-3", model.pk, 3)
    gateway_counts.leave_waiting_slot("web-1", model.pk)
    assert gateway_counts.take_waiting_slot("web-3", model.pk, 3)
    assert gateway_counts.waiting_for(model.pk) == 3


def test_a_zero_limit_lets_nobody_wait(counts: str) -> None:
    model = make_model("cold")
    assert not gateway_counts.take_waiting_slot("web-1", model.pk, 0)


def test_in_flight_is_summed_over_processes_and_forgotten_when_reported_done(counts: str) -> None:
    gateway_counts.report_in_flight("web-1", {7: 2, 8: 1})
    gateway_counts.report_in_flight("web-2", {7: 1, 9: 0})
    assert gateway_counts.in_flight_by_replica() == {7: 3, 8: 1}
    gateway_counts.report_in_flight("web-1", {8: 1})
    assert gateway_counts.in_flight_by_replica() == {7: 1, 8: 1}
    gateway_counts.report_in_flight("web-2", {})
    gateway_counts.report_in_flight("web-1", {})
    assert gateway_counts.in_flight_by_replica() == {}


def test_a_process_that_stopped_reporting_holds_nothing(settings: Any) -> None:
    """A killed web process cannot keep a replica up or a model's queue full (store rows)."""
    settings.REDIS_URL = ""
    model = make_model("cold")
    gateway_counts.report_in_flight("dead", {7: 4})
    assert gateway_counts.take_waiting_slot("dead", model.pk, 1)
    assert not gateway_counts.take_waiting_slot("alive", model.pk, 1)
    long_ago = timezone.now() - timedelta(seconds=gateway_counts.STALE_AFTER_S + 1)
    GatewayCount.objects.filter(process="dead").update(seen_at=long_ago)
    assert gateway_counts.in_flight_by_replica() == {}
    assert gateway_counts.take_waiting_slot("alive", model.pk, 1)


def test_a_process_whose_marker_expired_holds_nothing_in_redis(
    settings: Any, redis_server: RedisServer
) -> None:
    gateway_counts._redis = None
    settings.REDIS_URL = redis_server.url
    client = gateway_counts._client()
    client.flushall()
    try:
        model = make_model("cold")
        gateway_counts.report_in_flight("dead", {7: 4})
        assert gateway_counts.take_waiting_slot("dead", model.pk, 1)
        assert not gateway_counts.take_waiting_slot("alive", model.pk, 1)
        client.delete("llmgw:gw:alive:dead")  # what its expiry does when it stops reporting
        assert gateway_counts.in_flight_by_replica() == {}
        assert gateway_counts.take_waiting_slot("alive", model.pk, 1)
    finally:
        gateway_counts._redis = None


def test_processes_racing_for_the_last_slots_never_overfill_the_queue(counts: str) -> None:
    """Eight processes at once for three places: exactly three get one."""
    model = make_model("cold")
    start = threading.Barrier(8)
    taken: list[bool] = []

    def race(n: int) -> None:
        try:
            start.wait()
            taken.append(gateway_counts.take_waiting_slot(f"web-{n}", model.pk, 3))
        finally:
            connection.close()

    threads = [threading.Thread(target=race, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(taken) == [False] * 5 + [True] * 3
    assert gateway_counts.waiting_for(model.pk) == 3
