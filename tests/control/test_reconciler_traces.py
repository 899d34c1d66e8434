"""The reconciler's spans: a tick is one, each placement in it a child, exported over OTLP/HTTP to
a real receiver (``tests.harness.otlp``); in this process, then from a control plane's Celery
worker, which starts its tracing in the process that runs the ticks."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.utils import timezone

from control import leases
from control.models import Node, Replica
from telemetry import tracing
from tests.harness.cluster import Cluster, node_health
from tests.harness.factories import gib, make_model, make_node
from tests.harness.otlp import ReceivedSpan, Receiver, otlp_receiver
from tests.harness.store import child_env
from tests.harness.waits import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("election_on")]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with otlp_receiver() as receiver:
        yield receiver


@pytest.fixture
def traced(receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> Iterator[Receiver]:
    """This process tracing to ``receiver`` for one test."""
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    assert tracing.start("test")
    try:
        yield receiver
    finally:
        tracing.shutdown()
    assert not tracing.active()


def by_name(spans: list[ReceivedSpan], name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == name]


def test_a_tick_is_a_span_and_each_placement_its_child(traced: Receiver) -> None:
    from control.reconciler.tick import tick

    lead = leases.claim(owner="leader", ttl=60, renew_deadline=40)
    make_node("a", gpus=gib(80, 80))
    make_model("m", min_replicas=2, max_replicas=2)
    Node.objects.update(last_heartbeat_at=timezone.now())
    result = tick(lead)
    assert result.placed == 2
    tracing.shutdown()  # exports what is queued

    spans = traced.received()
    (tick_span,) = by_name(spans, "reconcile tick")
    placements = by_name(spans, "place replica")
    assert tick_span.parent_span_id == ""
    assert tick_span.attributes == {
        "llmgw.lease.epoch": lead.epoch,
        "llmgw.tick.placed": 2,
        "llmgw.tick.changed": 0,
    }
    assert tick_span.resource["llmgw.process"] == "test"
    replicas = sorted(Replica.objects.filter(model__name="m").values_list("pk", flat=True))
    assert sorted(p.attributes["llmgw.replica.id"] for p in placements) == replicas
    for placement in placements:
        assert placement.trace_id == tick_span.trace_id
        assert placement.parent_span_id == tick_span.span_id
        assert placement.attributes["llmgw.model"] == "m"
        assert placement.attributes["llmgw.placement.nodes"] == ["a"]
        assert placement.attributes["llmgw.profile"]
        assert placement.attributes["llmgw.placement.reason"]
        assert tick_span.start_ns <= placement.start_ns <= placement.end_ns <= tick_span.end_ns


def test_a_tick_that_loses_the_lease_ends_its_span_with_the_error(traced: Receiver) -> None:
    from control.reconciler.tick import tick

    lead = leases.claim(owner="leader", ttl=60, renew_deadline=40)
    make_node("a", gpus=gib(80))
    make_model("m", min_replicas=1)
    Node.objects.update(last_heartbeat_at=timezone.now())
    deposed = dataclasses.replace(lead, epoch=lead.epoch - 1)  # another took over since
    with pytest.raises(leases.LeadershipLost):
        tick(deposed)
    tracing.shutdown()
    (tick_span,) = by_name(traced.received(), "reconcile tick")
    assert tick_span.status == "error"
    assert tick_span.status_message.startswith("LeadershipLost")
    assert not Replica.objects.exists()


def test_reconcile_once_exports_its_tick_before_it_exits(
    tmp_path: Path, receiver: Receiver
) -> None:
    """``manage.py reconcile --once`` ends right after its tick: the spans go out at its exit."""
    make_node("a", gpus=gib(80))
    make_model("m", min_replicas=1)
    Node.objects.update(last_heartbeat_at=timezone.now())
    env = child_env(LLMGW_VAR_DIR=str(tmp_path), OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint)
    argv = [sys.executable, "manage.py", "reconcile", "--once"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    # Exported before the process exited: no wait.
    (tick_span,) = by_name(receiver.received(), "reconcile tick")
    (placement,) = by_name(receiver.received(), "place replica")
    assert placement.parent_span_id == tick_span.span_id
    assert tick_span.resource["llmgw.process"] == "reconciler"


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_control_planes_worker_exports_its_ticks_and_placements(
    tmp_path: Path, receiver: Receiver
) -> None:
    cluster = Cluster(tmp_path)
    cluster.start_redis()
    try:
        cluster.add_control_plane(
            OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=receiver.endpoint + "/v1/traces",
            OTEL_BSP_SCHEDULE_DELAY="50",
            OTEL_SERVICE_NAME="llmgw-control",
        )
        cluster.add_agent("a", gpus="1x80GiB")
        wait_until(lambda: node_health("a") == "ready", what="the agent", logs=cluster.processes())
        make_model("m", min_replicas=1, max_replicas=1)
        placement: ReceivedSpan = receiver.wait_for(
            lambda got: next(iter(by_name(got, "place replica")), None),
            "a placement's span",
            logs=cluster.processes(),
        )
        (replica,) = Replica.objects.filter(model__name="m")
        assert placement.attributes["llmgw.replica.id"] == replica.pk
        assert placement.resource["llmgw.process"] == "worker"
        assert placement.resource["service.name"] == "llmgw-control"
        (parent,) = receiver.wait_for(
            lambda got: [s for s in got if s.span_id == placement.parent_span_id],
            "the span of the tick that placed it",
            logs=cluster.processes(),
        )
        assert parent.name == "reconcile tick"
        assert parent.attributes["llmgw.tick.placed"] == 1
        assert parent.resource["process.pid"] == placement.resource["process.pid"]
    finally:
        cluster.stop()
