"""A model under several profiles, end to end: ``m@p2`` asked for while nothing runs is placed
with ``p2``'s settings and served only by ``p2``'s replica, with a real control plane, an
agent with simulated GPUs, ``sim`` engines and the official ``openai`` client. The two
profiles' engines answer differently (their arguments differ), so the answer says which
profile served it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from control.models import Replica
from tests.harness.cluster import Cluster, node_health
from tests.harness.factories import make_key, make_model, make_profile
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


def answer(client: openai.OpenAI, model: str) -> list[str]:
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}]
    )
    return (reply.choices[0].message.content or "").split()


def test_model_at_profile_cold_is_placed_with_that_profile_and_served_only_by_it(
    cluster: Cluster,
) -> None:
    plane = cluster.add_control_plane()
    cluster.add_agent("a", gpus="3x80GiB")
    wait_until(lambda: node_health("a") == "ready", what="the agent", logs=cluster.processes())
    p1 = make_profile("p1", args=["--output-tokens", "3"], startup_timeout_s=30)
    p2 = make_profile("p2", args=["--output-tokens", "5"], gpus_per_shard=2, startup_timeout_s=30)
    model = make_model("m", profile=p1, min_replicas=0, max_replicas=1, idle_timeout_s=600)
    model.profiles.add(p2)
    key, _ = make_key("client")
    client = openai.OpenAI(base_url=plane.url + "/v1", api_key=key, max_retries=0, timeout=120)

    assert answer(client, "m@p2") == ["tok1", "tok2", "tok3", "tok4", "tok5"], "p2's engine"
    (replica,) = Replica.objects.filter(model=model)
    assert replica.profile_id == p2.pk
    assert len(replica.shards.get().gpu_indices) == 2, "placed with p2's GPUs per shard"
    for _ in range(3):
        assert len(answer(client, "m@p2")) == 5
    assert list(Replica.objects.filter(model=model).values_list("profile_id", flat=True)) == [
        p2.pk
    ], "nothing was placed under p1 for m@p2"

    # Plain `m` prefers its default profile: a request for it starts p1, then p1 serves it.
    assert answer(client, "m@p1") == ["tok1", "tok2", "tok3"]
    assert answer(client, "m") == ["tok1", "tok2", "tok3"]
    assert len(answer(client, "m@p2")) == 5, "p2 still serves m@p2 only"
