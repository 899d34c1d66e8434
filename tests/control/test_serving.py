"""What the gateway gets from the control plane and reports back (``control.serving``): the
stamps the reconciler scales by, written only where older than their precision, the notice of
a changed routing row, and the early tick sent through the site's broker."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from django.conf import settings
from django.utils import timezone

from control import serving
from control.models import Node, Profile, Replica, ServedModel, Shard

pytestmark = pytest.mark.django_db

WINDOW = timedelta(seconds=serving.STAMP_EVERY_S)


def a_model(name: str = "m", **fields: object) -> ServedModel:
    profile = Profile.objects.create(name=f"{name}-sim", engine="sim")
    return ServedModel.objects.create(
        name=name, source=f"sim/{name}", default_profile=profile, **fields
    )


def test_demand_is_recorded_unless_a_stamp_within_the_window_has_it_already() -> None:
    cold = a_model("cold")
    recent = timezone.now() - WINDOW / 2
    just_asked = a_model("just-asked", demand_at=recent)
    serving.record_demand([cold.pk, just_asked.pk])
    cold.refresh_from_db()
    just_asked.refresh_from_db()
    assert cold.demand_at is not None
    assert just_asked.demand_at == recent


def test_requests_stamp_the_model_and_the_replica_that_served_them() -> None:
    long_ago = timezone.now() - 2 * WINDOW
    model = a_model(last_request_at=long_ago)
    replica = Replica.objects.create(model=model, profile=model.default_profile)
    other = a_model("other", last_request_at=long_ago)
    serving.record_requests([model.pk], [replica.pk])
    model.refresh_from_db()
    replica.refresh_from_db()
    other.refresh_from_db()
    assert isinstance(model.last_request_at, datetime) and model.last_request_at > long_ago
    assert replica.last_request_at is not None
    assert other.last_request_at == long_ago


def test_the_catalog_comes_as_plain_rows_with_the_default_profile_among_its_profiles() -> None:
    model = a_model("llama", aliases=["llama-latest"])
    extra = Profile.objects.create(name="vllm", engine="vllm")
    model.profiles.add(extra)
    snapshot = serving.routing_snapshot()
    assert snapshot.replicas == []
    [entry] = snapshot.models
    assert entry.name == "llama" and entry.aliases == ("llama-latest",)
    assert entry.profiles == frozenset({"llama-sim", "vllm"})
    assert serving.catalog_names() == ["llama"]


def test_a_saved_routing_row_calls_the_subscribers_of_this_process() -> None:
    calls: list[None] = []

    def changed() -> None:
        calls.append(None)

    serving.on_routing_change(changed)
    serving.on_routing_change(changed)  # a second subscription is the same one
    try:
        Node.objects.create(name="gpu-1")
        assert len(calls) == 1
    finally:
        serving._listeners.remove(changed)


def test_an_early_tick_is_the_reconcile_task_put_on_the_sites_broker_by_name() -> None:
    """The site registers the sender at start (the control plane never imports the site); the
    message lands on the broker the worker reads, naming the task, with an expiry."""
    folder = Path(settings.CELERY_BROKER_TRANSPORT_OPTIONS["data_folder_out"])
    before = set(folder.glob("*.msg"))
    serving.request_tick()
    sent = sorted(set(folder.glob("*.msg")) - before)
    try:
        messages = [json.loads(path.read_bytes()) for path in sent]
        assert [m["headers"]["task"] for m in messages] == [serving.RECONCILE_TASK]
        assert messages[0]["headers"]["expires"] is not None
    finally:
        for path in sent:
            path.unlink()


def _ready_replica_on(node: Node, model: ServedModel, port: int) -> Replica:
    replica = Replica.objects.create(
        model=model,
        profile=model.default_profile,
        desired=Replica.Desired.RUNNING,
        observed=Replica.Observed.READY,
    )
    Shard.objects.create(replica=replica, node=node, rank=0, port=port, observed="ready")
    return replica


def test_a_loopback_address_is_routed_only_for_a_node_whose_stream_came_over_loopback() -> None:
    """Defence in depth behind the hello's check: a node row that says 127.0.0.1 (written
    around the stream, or left from before) is not routed unless its agent's own stream came
    over loopback."""
    model = a_model()
    remote = Node.objects.create(
        name="remote",
        addresses=["127.0.0.1"],
        health=Node.Health.READY,
        last_heartbeat_at=timezone.now(),
    )
    _ready_replica_on(remote, model, 20001)
    assert serving.routing_snapshot().replicas == []
    local = Node.objects.create(
        name="local",
        addresses=["127.0.0.1"],
        health=Node.Health.READY,
        last_heartbeat_at=timezone.now(),
        connected_over_loopback=True,
    )
    replica = _ready_replica_on(local, model, 20002)
    [routed] = serving.routing_snapshot().replicas
    assert (routed.id, routed.host, routed.local_node) == (replica.pk, "127.0.0.1", True)
    assert routed.engine_key not in repr(routed)
