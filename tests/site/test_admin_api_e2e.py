"""An operator's script against a real cluster, through the admin API only.

One control plane (web process, Celery worker and beat, Redis) and two agents with simulated
GPUs run on loopback. The script, holding a read-write admin token made by ``manage.py
create_admin_token``, adds a profile and a model that scales from zero, issues an API key for
a new user; a request through ``/v1`` with the official ``openai`` client activates the model;
the script drains the node the replica landed on and watches (through the API) the replica
come up on the other node while nothing is left running on the drained one; it undrains it.
Every observation is what the API answers, cross-checked against the store.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from django.core.management import call_command

from control.models import Event, Replica
from tests.harness.cluster import Cluster, node_health
from tests.harness.waits import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True), pytest.mark.timeout(420)]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path / "cluster")
    cluster.start_redis()
    try:
        cluster.add_control_plane()
        cluster.add_agent("gpu-a", gpus="2x80GiB")
        cluster.add_agent("gpu-b", gpus="2x80GiB")
        wait_until(
            lambda: node_health("gpu-a") == "ready" and node_health("gpu-b") == "ready",
            what="both agents connected",
            logs=cluster.processes(),
        )
        yield cluster
    finally:
        cluster.stop()


class Script:
    """What an operator's program does: JSON over HTTP with an admin token."""

    def __init__(self, base: str, token: str) -> None:
        self.http = httpx.Client(
            base_url=f"{base}/api/admin/v1",
            headers={"Authorization": f"Bearer {token}"},
            timeout=30,
        )

    def __call__(self, method: str, path: str, body: Any = None, **params: Any) -> Any:
        response = self.http.request(method, path, json=body, params=params or None)
        assert response.status_code < 300, (method, path, response.status_code, response.text)
        return response.json() if response.content else None


def running_on(script: Script, model: str) -> set[str]:
    """Nodes holding a shard of a replica of ``model`` wanted running and ready, per the API."""
    replicas = script("GET", "/replicas", model=model, desired="running")["items"]
    return {
        shard["node"]
        for replica in replicas
        if replica["observed"] == "ready"
        for shard in replica["shards"]
    }


def anything_on(script: Script, node: str) -> bool:
    """Any replica not yet stopped that still has a shard on ``node``, per the API."""
    replicas = script("GET", "/replicas", node=node)["items"]
    return any(r["desired"] != "stopped" or r["observed"] != "stopped" for r in replicas)


def test_a_script_adds_a_model_serves_it_and_drains_its_node_through_the_admin_api(
    cluster: Cluster,
) -> None:
    base = cluster.control_planes[0].url
    out = io.StringIO()
    call_command(
        "create_admin_token", "ops-script", "--scope", "write", stdout=out, stderr=io.StringIO()
    )
    script = Script(base, out.getvalue().strip())

    script("POST", "/profiles", {"name": "sim-1gpu", "engine": "sim", "startup_timeout_s": 30})
    model = script(
        "POST",
        "/models",
        {"name": "llama3", "source": "org/llama3", "default_profile": "sim-1gpu"},
    )
    assert model["min_replicas"] == 0 and model["replicas_desired"] == 0
    script("POST", "/users", {"username": "alice"})
    issued = script("POST", "/keys", {"user": "alice", "name": "laptop", "models": ["llama3"]})

    client = openai.OpenAI(base_url=f"{base}/v1", api_key=issued["key"], max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model="llama3", messages=[{"role": "user", "content": "wake up"}], max_tokens=5
    )
    assert reply.choices[0].message.content

    (first,) = wait_until(
        lambda: running_on(script, "llama3") or None,
        what="the activated replica, ready",
        logs=cluster.processes(),
    )
    other = ({"gpu-a", "gpu-b"} - {first}).pop()

    drained = script("POST", f"/nodes/{first}/drain")
    assert drained["changed"] and drained["node"]["schedule"] == "draining"
    wait_until(
        lambda: running_on(script, "llama3") == {other},
        what=f"llama3 ready on {other} only",
        logs=cluster.processes(),
    )
    wait_until(
        lambda: not anything_on(script, first),
        what=f"nothing left running on {first}",
        logs=cluster.processes(),
    )
    # Still served, now from the other node.
    again = client.chat.completions.create(
        model="llama3", messages=[{"role": "user", "content": "still there?"}], max_tokens=5
    )
    assert again.choices[0].message.content
    assert not Replica.objects.filter(
        desired=Replica.Desired.RUNNING, shards__node__name=first
    ).exists()

    assert script("POST", f"/nodes/{first}/undrain")["node"]["schedule"] == "active"
    subjects = [e["subject"] for e in script("GET", "/events", kind="operator")["items"]]
    assert subjects.count(f"node/{first}") == 2
    assert (
        Event.objects.filter(
            kind="operator", subject=f"node/{first}", data__actor="token:ops-script"
        ).count()
        == 2
    )

    def alice_requests() -> int:
        rows = script("GET", "/usage", by="user", user="alice")["items"]
        return int(rows[0]["requests"]) if rows else 0

    wait_until(lambda: alice_requests() >= 2, what="alice's two requests in the usage report")
