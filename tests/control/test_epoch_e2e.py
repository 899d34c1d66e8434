"""A restored or reset store never locks agents out, end to end.

An agent that has seen leader epoch 12 (from the store before it was reset) connects to a
control plane whose store starts again from nothing: with default settings the control plane
competes for the lease, takes it at a low epoch, hears the agent's epoch in its hello, moves
its lease above it and only then sends desired state, which the agent accepts. A model is
placed on that node and answers through the gateway with the official ``openai`` client.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from agents.adoption import STATE_FILE
from control.models import Node
from tests.harness.cluster import Cluster, lease_state, node_health, ready_replicas
from tests.harness.factories import make_key, make_model
from tests.harness.waits import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path)
    cluster.start_redis()
    try:
        yield cluster
    finally:
        cluster.stop()


def test_an_agent_that_saw_epoch_12_is_served_by_a_fresh_store(cluster: Cluster) -> None:
    plane = cluster.add_control_plane()
    agent = cluster.add_agent("a", gpus="1x80GiB")
    wait_until(lambda: node_health("a") == "ready", what="the agent", logs=cluster.processes())
    # The same agent, as it would be after serving a store that has since been reset: its
    # record of what it ran says it has seen epoch 12.
    assert agent.proc is not None
    agent.proc.stop()
    agent.state_dir.mkdir(parents=True, exist_ok=True)
    (agent.state_dir / STATE_FILE).write_text(json.dumps({"highest_epoch": 12, "shards": []}))
    _, epoch = lease_state()
    assert epoch < 12, "the fresh store's lease starts low"
    agent.start()
    wait_until(
        lambda: Node.objects.filter(name="a", agent_epoch=12).exists(),
        what="the agent's hello with epoch 12",
        logs=cluster.processes(),
    )

    make_model("m", min_replicas=1, max_replicas=1, startup_timeout_s=30)
    wait_until(lambda: ready_replicas("m") == 1, what="m ready on a", logs=cluster.processes())
    assert lease_state()[1] > 12, "the leader moved its epoch above the agent's"
    assert Node.objects.get(name="a").stale_desired_rejected == 0, "nothing was refused"

    key, _ = make_key("client")
    client = openai.OpenAI(base_url=plane.url + "/v1", api_key=key, max_retries=0, timeout=60)
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content
