"""Idle means idle, end to end: a control plane (web, worker, beat), an agent with a simulated
GPU and a ``sim`` engine that streams slowly, and the official ``openai`` client.

One stream runs four times longer than the model's idle timeout plus the drain timeout while
the model has no other traffic. It must finish whole, on the replica it started on; only
afterwards is the replica scaled down.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from control.models import Event, Replica
from tests.harness.cluster import FAST, Cluster, node_health, ready_replicas
from tests.harness.factories import make_key, make_model
from tests.harness.waits import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e, pytest.mark.timeout(300)]

IDLE_TIMEOUT_S = 2
DRAIN_TIMEOUT_S = float(FAST["LLMGW_DRAIN_TIMEOUT"])
TOKENS = 100
GAP_MS = 4 * (IDLE_TIMEOUT_S + DRAIN_TIMEOUT_S) * 1000 / TOKENS  # the whole stream: 4 × both


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path)
    cluster.start_redis()
    try:
        yield cluster
    finally:
        cluster.stop()


def test_a_stream_longer_than_idle_and_drain_timeouts_finishes_then_the_replica_scales_down(
    cluster: Cluster,
) -> None:
    plane = cluster.add_control_plane()
    cluster.add_agent("a", gpus="1x80GiB")
    wait_until(lambda: node_health("a") == "ready", what="the agent", logs=cluster.processes())
    make_model(
        "slow",
        min_replicas=0,
        max_replicas=1,
        idle_timeout_s=IDLE_TIMEOUT_S,
        startup_timeout_s=30,
        args=["--itl-ms", f"{GAP_MS:g}", "--output-tokens", str(TOKENS)],
    )
    key, _ = make_key("client")
    client = openai.OpenAI(base_url=plane.url + "/v1", api_key=key, max_retries=0, timeout=120)

    stream = client.chat.completions.create(
        model="slow", messages=[{"role": "user", "content": "take your time"}], stream=True
    )
    pieces: list[str] = []
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        pieces.append(chunk.choices[0].delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
        # Throughout the stream, its replica is the model's one replica, meant to run.
        assert Replica.objects.filter(model__name="slow").exclude(desired="running").count() == 0
    text = "".join(pieces)
    assert finish == "stop"
    assert text.split() == [f"tok{i}" for i in range(1, TOKENS + 1)], "the stream is whole"
    (replica,) = Replica.objects.filter(model__name="slow")

    # Now idle: the replica is scaled down once the idle timeout has passed since the end.
    wait_until(
        lambda: Event.objects.filter(
            message__contains=f"replica #{replica.pk} → draining: idle: scaling down"
        ).exists(),
        what="the replica scaled down after the stream",
        logs=cluster.processes(),
    )
    wait_until(
        lambda: Replica.objects.filter(pk=replica.pk, desired="stopped").exists(),
        timeout=120,
        what="the drained replica stopped",
        logs=cluster.processes(),
    )
    assert ready_replicas("slow") == 0
    replica.refresh_from_db()
    assert replica.last_request_at is not None, "the gateway reported when it last finished"
