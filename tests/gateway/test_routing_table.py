"""The routing table loaded from the store: what takes traffic and what never does (G5)."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError

from control import serving
from control.models import Node, Replica, Shard
from gateway.models import Endpoint
from gateway.routing.loading import load_table
from tests.harness.factories import serve_model

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize(
    "url",
    ["http://169.254.169.254/latest/", "http://metadata.google.internal/", "file:///etc/passwd"],
)
def test_an_endpoint_at_a_metadata_or_file_url_is_refused_at_save(url: str) -> None:
    with pytest.raises(ValidationError) as refused:
        Endpoint(slug="bad", url=url, model_names=["m"]).save()
    assert "url" in refused.value.message_dict
    assert not Endpoint.objects.exists()


def test_an_operator_may_allow_a_link_local_endpoint_on_purpose() -> None:
    Endpoint(
        slug="ok", url="http://169.254.10.10:8000", model_names=["m"], allow_private_address=True
    ).save()
    route = load_table().resolve("m")
    assert route is not None and route.upstreams[0].base_url == "http://169.254.10.10:8000"


def test_each_upstream_carries_the_addresses_its_connections_may_reach() -> None:
    """Checked again at connect time (a name may resolve anywhere): an Endpoint row only to
    public addresses, one the operator allowed anywhere, a replica only to node addresses."""
    Endpoint(slug="public", url="http://10.0.0.1:8000", model_names=["e"]).save()
    Endpoint(
        slug="allowed", url="http://10.0.0.2:8000", model_names=["a"], allow_private_address=True
    ).save()
    serve_model("r", [8001])
    table = load_table()
    policies = {
        name: [u.addresses for u in route.upstreams]
        for name in ("e", "a", "r")
        if (route := table.resolve(name)) is not None
    }
    assert policies == {"e": ["public"], "a": ["any"], "r": ["node"]}


def test_a_row_written_around_the_check_is_still_not_routed() -> None:
    Endpoint(slug="sneaky", url="http://10.0.0.1:8000", model_names=["m"]).save()
    Endpoint.objects.filter(slug="sneaky").update(url="http://169.254.169.254/")
    assert load_table().resolve("m") is None


def test_only_ready_running_replicas_on_healthy_undrained_nodes_take_traffic() -> None:
    served = serve_model("m", [8001, 8002, 8003, 8004])
    first, second, third, fourth = served.replicas
    Replica.objects.filter(pk=second.pk).update(observed=Replica.Observed.STARTING)
    Replica.objects.filter(pk=third.pk).update(desired=Replica.Desired.DRAINING)
    Node.objects.filter(shards__replica=fourth).update(schedule=Node.Schedule.DRAINING)
    route = load_table().resolve("m")
    assert route is not None
    assert [u.id for u in route.upstreams] == [f"replica:{first.pk}"]
    Node.objects.filter(shards__replica=first).update(health=Node.Health.UNREACHABLE)
    cold = load_table().resolve("m")
    assert cold is not None and cold.upstreams == () and cold.catalog_id == served.model.pk


def test_a_models_catalog_context_length_reaches_its_route() -> None:
    serve_model("sized", [8001], context_length=4096)
    serve_model("unsized", [8002])
    sized, unsized = load_table().resolve("sized"), load_table().resolve("unsized")
    assert sized is not None and sized.context_length == 4096
    assert unsized is not None and unsized.context_length is None, "left to what the engine says"


def test_a_replicas_cache_size_comes_from_its_head_shard_to_its_upstream() -> None:
    served = serve_model("m", [8001, 8002])
    sized, unsized = served.replicas
    Shard.objects.filter(replica=sized, rank=0).update(cache_tokens=32768)
    snapshot = {r.id: r.cache_tokens for r in serving.routing_snapshot().replicas}
    assert snapshot == {sized.pk: 32768, unsized.pk: None}
    route = load_table().resolve("m")
    assert route is not None
    assert {u.id: u.cache_tokens for u in route.upstreams} == {
        f"replica:{sized.pk}": 32768,
        f"replica:{unsized.pk}": None,  # not reported (an older agent, or an engine without)
    }


def test_each_query_of_a_table_load_reads_one_table() -> None:
    """No statement can hold a lock on one table while it waits for another (the deadlock
    against a migration or TRUNCATE in control.serving.routing_snapshot): a model's default
    ordering by a related name would join that table in."""
    import re

    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    serve_model("m", [8001])
    Endpoint(slug="e", url="http://10.0.0.1:8000", model_names=["e"]).save()
    with CaptureQueriesContext(connection) as queries:
        load_table()
    statements = [q["sql"] for q in queries.captured_queries]
    assert len(statements) == 7
    for sql in statements:
        assert " JOIN " not in sql.upper() and len(re.findall(r"\bFROM\b", sql)) == 1, sql


def test_a_replica_on_a_node_not_connected_over_loopback_may_not_be_reached_on_loopback() -> None:
    """The node's loopback address is refused before routing; the policy its upstream carries
    refuses a name of it that resolves to this machine's loopback as well."""
    served = serve_model("local", [8001])
    remote = serve_model("remote", [8002])
    Node.objects.filter(shards__replica__in=remote.replicas).update(
        addresses=["gpu-7.example"], connected_over_loopback=False
    )
    table = load_table()
    policies = {
        name: [(u.id, u.addresses) for u in route.upstreams]
        for name in ("local", "remote")
        if (route := table.resolve(name)) is not None
    }
    assert policies == {
        "local": [(f"replica:{served.replicas[0].pk}", "node")],
        "remote": [(f"replica:{remote.replicas[0].pk}", "remote_node")],
    }
