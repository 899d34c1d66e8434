"""A gRPC agent listener that stops (SIGTERM, as ``manage.py run`` stops its child) exits
cleanly and ends its agents' streams with 1012, service restart: each agent goes to its next
control plane at once rather than after its backoff (scenario S3 over gRPC, in
docs/scenarios.md). Real processes on loopback: Redis, two control planes each with a web
process and a gRPC listener requiring mutual TLS, and one agent with simulated GPUs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.utils import timezone
from pytest_django import DjangoDbBlocker

from control.models import Node
from tests.harness.cluster import GRPC, Cluster, heartbeat_after, node_health
from tests.harness.procs import alive, connections_to
from tests.harness.store import module_store
from tests.harness.waits import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.store, pytest.mark.timeout(300)]

# So long that an agent that backed off could not reconnect within any wait below: the
# reconnect this module sees can only be the at-once one a stopping close asks for.
BACKOFF = ("--backoff-base", "600", "--backoff-max", "1200")


@pytest.fixture
def cluster(
    django_db_setup: None, django_db_blocker: DjangoDbBlocker, tmp_path_factory: Any
) -> Iterator[Cluster]:
    with module_store(django_db_blocker):
        c = Cluster(tmp_path_factory.mktemp("grpc-failover"), transport=GRPC)
        try:
            c.start_redis()
            c.add_control_plane(reconciler=False)
            c.add_control_plane(reconciler=False)
            yield c
        finally:
            c.stop()


def test_a_stopping_grpc_listener_sends_its_agents_to_another_control_plane_at_once(
    cluster: Cluster,
) -> None:
    first, second = cluster.control_planes
    assert first.grpc is not None and second.grpc is not None
    agent = cluster.add_agent("f1", *BACKOFF)
    assert agent.proc is not None
    pid = agent.proc.pid
    wait_until(lambda: node_health("f1") == "ready", what="f1 ready", logs=cluster.processes())
    # The agent dials its control planes in order: the first one serves it.
    wait_until(lambda: connections_to(pid, first.agent_port), what="f1 on the first listener")
    assert not connections_to(pid, second.agent_port)

    # The listener's stop is clean: exit code 0, within the supervisor's patience.
    assert first.grpc.stop(timeout=20) == 0
    stopped_at = timezone.now()

    wait_until(
        lambda: connections_to(pid, second.agent_port) and heartbeat_after("f1", stopped_at),
        timeout=60,
        what="f1 served by the second control plane",
        logs=[agent.proc, first.grpc, second.grpc],
    )
    assert alive(pid)
    assert Node.objects.get(name="f1").health == "ready"
