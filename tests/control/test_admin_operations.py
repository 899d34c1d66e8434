"""The operator actions' domain functions (control.operations), and what the console's pages
cost in queries as the fleet grows."""

from __future__ import annotations

from typing import Any

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.core.cache import cache
from django.db import transaction
from django.test import Client

from control import nudges, operations
from control.models import Event, Node, Replica
from tests.harness.factories import (
    make_key,
    make_model,
    make_node,
    make_replica,
    make_usage,
    make_user,
)

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def fresh_cache() -> None:
    """The dashboard caches minutes that are over; each test starts without them."""
    cache.clear()


def test_a_schedule_change_happens_once_and_is_recorded_once() -> None:
    node = make_node("gpu-1")
    assert operations.drain_node(node.pk, actor="cli:ops") is True
    assert operations.drain_node(node.pk, actor="cli:ops") is False
    assert Node.objects.get(pk=node.pk).schedule == Node.Schedule.DRAINING
    (event,) = Event.objects.filter(kind=Event.Kind.OPERATOR)
    assert event.subject == "node/gpu-1" and event.data == {
        "actor": "cli:ops",
        "schedule": "draining",
    }


def test_schedule_changes_leave_the_agents_desired_revision_alone() -> None:
    node = make_node("gpu-1")
    operations.cordon_node(node.pk, actor="t")
    operations.undrain_node(node.pk, actor="t")
    assert Node.objects.get(pk=node.pk).desired_revision == 0


def test_operations_on_missing_rows_say_so() -> None:
    with pytest.raises(operations.NotFound, match="node 999"):
        operations.cordon_node(999, actor="t")
    with pytest.raises(operations.NotFound, match="replica 999"):
        operations.restart_replica(999, actor="t")


@pytest.mark.parametrize("desired", [Replica.Desired.DRAINING, Replica.Desired.STOPPED])
def test_only_replicas_wanted_running_are_restarted(desired: str) -> None:
    node = make_node("gpu-1")
    replica = make_replica(make_model("llama3"), [(node, [0])], desired=desired)
    assert operations.restart_replica(replica.pk, actor="t") is False
    replica.refresh_from_db()
    assert replica.generation == 1 and replica.observed == Replica.Observed.READY
    assert not Event.objects.exists()
    assert Node.objects.get(pk=node.pk).desired_revision == 0


def test_restart_clears_the_backoff_and_resets_every_shard() -> None:
    a = make_node("gpu-a")
    b = make_node("gpu-b")
    replica = make_replica(make_model("big"), [(a, [0]), (b, [0])], observed="failed")
    Replica.objects.filter(pk=replica.pk).update(failures=4, failure_class="oom")
    assert operations.restart_replica(replica.pk, actor="t") is True
    replica.refresh_from_db()
    assert (replica.generation, replica.failures, replica.backoff_until) == (2, 0, None)
    assert set(replica.shards.values_list("observed", flat=True)) == {"pending"}
    assert [n.desired_revision for n in Node.objects.order_by("name")] == [1, 1]


@pytest.mark.django_db(transaction=True)
def test_restart_tells_the_nodes_streams_only_after_commit() -> None:
    node = make_node("gpu-1")
    replica = make_replica(make_model("llama3"), [(node, [0])])
    layer = get_channel_layer()
    assert layer is not None
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(nudges.node_group(node.pk), channel)

    with transaction.atomic():
        operations.restart_replica(replica.pk, actor="t")
        # Not yet: the agent must not read a desired state that is not committed.
        with pytest.raises(TimeoutError):
            async_to_sync(_receive)(layer, channel, 0.2)
    message = async_to_sync(_receive)(layer, channel, 2.0)
    assert message["type"] == nudges.DESIRED_CHANGED


async def _receive(layer: Any, channel: str, timeout: float) -> Any:
    import asyncio

    return await asyncio.wait_for(layer.receive(channel), timeout)


# --------------------------------------------------------------------------- query budgets


def test_console_pages_cost_the_same_queries_for_3_or_30_rows(
    django_assert_max_num_queries: Any,
) -> None:
    client = Client()
    client.force_login(make_user("root", superuser=True))
    make_user("alice")
    _, key = make_key("alice")

    def fleet(n: int, start: int) -> None:
        for i in range(start, start + n):
            node = make_node(f"gpu-{i}", gpus=[(81920, 0)] * 2)
            make_replica(make_model(f"model-{i}"), [(node, [0, 1])])
            make_usage(model=f"model-{i}", api_key=key)

    pages = [
        "/admin/control/node/",
        "/admin/control/replica/",
        "/admin/control/servedmodel/",
        "/admin/gateway/usagerecord/",
        "/admin/gateway/apikey/",
        "/admin/dashboard.json",
    ]
    fleet(3, 0)
    small = {}
    for page in pages:
        with django_assert_max_num_queries(1000) as captured:
            assert client.get(page).status_code == 200
        small[page] = len(captured)
    fleet(27, 3)
    for page in pages:
        with django_assert_max_num_queries(small[page], info=page) as captured:
            assert client.get(page).status_code == 200, page
