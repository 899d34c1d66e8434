"""Agents end to end, with real processes on loopback: a web process serving the agent streams,
two agents with simulated GPUs, ``sim`` (and one llama.cpp) engines the agents start from
desired state written to the database, a private Redis as the channel layer, and the official
``openai`` client talking to the shards. Scenario codes (N1...) are those of docs/scenarios.md.

The cases are collected by two modules, one per transport (test_agent_e2e_websocket.py and
test_agent_e2e_grpc.py, each naming its ``TRANSPORT``), so that a parallel run can give them to
two workers. The cluster starts once for each module; before each test the fleet is brought
back to where it started (no shards, both agents connected and ready, the web process and Redis
up), and each test places what it needs. Intervals are shrunk through the environment
(unreachable after 3s, lost after 6s), so every wait here is a poll with a generous deadline.
What a test concludes comes from the store, the processes and their sockets, never from log
text.
"""

from __future__ import annotations

import contextlib
import functools
import json
import signal
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import redis as redis_client
from django.db import transaction
from django.db.models import F
from django.utils import timezone
from openai import OpenAI
from pytest_django import DjangoDbBlocker
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from agents import grpc_wire
from agents.agent_pb2 import AgentFrame
from agents.protocol.codec import encode
from agents.protocol.messages import Heartbeat, Hello
from agents.protocol.vocabulary import NODE_HEADER, CloseCode
from control import health, node_certs, node_tokens, nudges
from control.models import Event, Lease, Node, Profile, Replica, ServedModel, Shard
from gateway.models import UsageRecord
from llmgw_site.config import redis_channel_layer
from tests.harness.cluster import (
    GRPC,
    WEBSOCKET,
    Agent,
    Cluster,
    agent_url,
    grpc_listener,
    heartbeat_after,
    node_health,
)
from tests.harness.factories import make_key
from tests.harness.procs import alive, connections_to, free_port
from tests.harness.store import module_store
from tests.harness.waits import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.store, pytest.mark.timeout(300)]

UNREACHABLE_AFTER = 3.0
LOST_AFTER = 6.0
WEB_SETTINGS = {
    "LLMGW_UNREACHABLE_AFTER": str(UNREACHABLE_AFTER),
    "LLMGW_LOST_AFTER": str(LOST_AFTER),
    # Long, so every prompt delivery below is a nudge's doing, not a resync's.
    "LLMGW_AGENT_RESYNC_INTERVAL": "60",
    "LLMGW_DRAIN_TIMEOUT": "20",
    "LLMGW_LOG_LEVEL": "INFO",
}


@pytest.fixture(scope="module")
def cluster(
    request: pytest.FixtureRequest,
    django_db_setup: None,
    django_db_blocker: DjangoDbBlocker,
    tmp_path_factory: Any,
) -> Iterator[Cluster]:
    """The web process and agents n1 and n2 over the module's ``TRANSPORT``: WebSocket with
    node tokens, or gRPC with mutual TLS (node certificates from the cluster's CA)."""
    transport = request.module.TRANSPORT
    with module_store(django_db_blocker):
        c = Cluster(
            tmp_path_factory.mktemp("agents-e2e"), settings=WEB_SETTINGS, transport=transport
        )
        try:
            c.start_redis()
            c.add_control_plane(reconciler=False)
            for name in ("n1", "n2"):
                c.add_agent(name)
            wait_until(
                lambda: Node.objects.filter(health="ready", gpus__index=1).count() == 2,
                what="both nodes ready with their GPUs",
                logs=c.processes(),
            )
            yield c
        finally:
            c.stop()


@pytest.fixture(autouse=True)
def fleet(cluster: Cluster, settings: Any) -> Cluster:
    """This process nudges through the cluster's Redis and judges health with its thresholds;
    the fleet is as the module started it."""
    assert cluster.redis is not None
    settings.CHANNEL_LAYERS = {"default": redis_channel_layer(cluster.redis.url)}
    settings.LLMGW_UNREACHABLE_AFTER = UNREACHABLE_AFTER
    settings.LLMGW_LOST_AFTER = LOST_AFTER
    reset(cluster)
    return cluster


@pytest.fixture
def websocket_only(cluster: Cluster) -> None:
    """A test of the WebSocket transport's own handshake and frames (gRPC's have theirs)."""
    if cluster.transport != WEBSOCKET:
        pytest.skip("WebSocket transport only; the gRPC listener has its own tests")


def highest_epoch_seen(agent: Agent) -> int:
    """The highest leader epoch the agent has accepted (it keeps it across restarts)."""
    try:
        return int(json.loads((agent.state_dir / "shards.json").read_text())["highest_epoch"])
    except (OSError, ValueError, KeyError):
        return 0


def reset(cluster: Cluster) -> None:
    """Back to the module's starting point: nothing placed, one web process with the module's
    settings, Redis up, both agents (their first command line) connected and ready, every
    engine stopped. What the agents last accepted is respected: the lease keeps an epoch at
    least as high as any they have seen, or they would refuse everything from now on."""
    assert cluster.redis is not None
    cluster.redis.ensure_running()
    primary, *others = cluster.control_planes
    for plane in others:
        for service in plane.services():
            service.stop()
    cluster.control_planes[1:] = []
    web = primary.web
    grpc_down = cluster.transport == GRPC and not (primary.grpc and primary.grpc.running())
    if web is None or not web.running() or dict(web.env) != primary.env or grpc_down:
        primary.start_web()
    highest = max(highest_epoch_seen(a) for a in cluster.agents.values())
    with transaction.atomic():
        Shard.objects.all().delete()
        Replica.objects.all().delete()
        ServedModel.objects.all().delete()
        Profile.objects.all().delete()
        Event.objects.all().delete()
        Lease.objects.filter(name="reconciler").update(owner="", expires_at_ms=0)
        if highest and not Lease.objects.filter(name="reconciler", epoch__gte=highest).exists():
            Lease.objects.update_or_create(
                name="reconciler", defaults={"owner": "", "epoch": highest, "expires_at_ms": 0}
            )
        Node.objects.update(remove_weights=[])
        for node_id in Node.objects.values_list("pk", flat=True):
            nudges.nudge_node(node_id)
    for agent in cluster.agents.values():
        if not cluster.has_credentials(agent.name):
            cluster.issue_credentials(agent)
        proc = agent.proc
        if proc is None or not proc.running() or list(proc.argv) != agent.argv:
            if proc is not None:
                proc.stop()
            agent.start()
        else:
            proc.signal(signal.SIGCONT)

    def settled(agent: Agent) -> bool:
        node = Node.objects.get(name=agent.name)
        # The nudge's revision applied and reported: the stream is live after the reset.
        return (
            node.health == "ready"
            and node.observed_revision == node.desired_revision
            and not agent.shard_pids()
            and not agent.engines()
        )

    for agent in cluster.agents.values():
        wait_until(
            functools.partial(settled, agent),
            what=f"{agent.name} back to an empty, ready node",
            logs=cluster.processes(),
        )


def place(
    cluster: Cluster,
    node: str,
    *,
    model: str = "tiny",
    engine: str = "sim",
    args: tuple[str, ...] = (),
    source: str = "models/tiny",
    **profile_fields: Any,
) -> Shard:
    """Write a one-shard replica for ``node`` and nudge it, as the reconciler does."""
    with transaction.atomic():
        profile = Profile.objects.create(
            name=f"{model}-{engine}-{Profile.objects.count()}",
            engine=engine,
            args=list(args),
            startup_timeout_s=60,
            **profile_fields,
        )
        served, _ = ServedModel.objects.get_or_create(
            name=model, defaults={"source": source, "default_profile": profile}
        )
        replica = Replica.objects.create(model=served, profile=profile)
        target = Node.objects.get(name=node)
        shard = Shard.objects.create(
            replica=replica,
            node=target,
            port=cluster.agents[node].free_port(),
            gpu_indices=[free_gpu(target)],
        )
        nudges.nudge_node(target.pk)
    return shard


def free_gpu(node: Node) -> int:
    """The lowest GPU of ``node`` that no replica wanted running or draining uses: the agent
    refuses a shard on a GPU another one keeps, as a real GPU's memory would."""
    taken = {
        index
        for indices in Shard.objects.filter(node=node)
        .exclude(replica__desired=Replica.Desired.STOPPED)
        .values_list("gpu_indices", flat=True)
        for index in indices
    }
    free = [gpu.index for gpu in node.gpus.order_by("index") if gpu.index not in taken]
    assert free, f"node {node.name} has no free GPU for another shard: give its agent more"
    return free[0]


def observed(shard: Shard) -> str:
    return str(Shard.objects.filter(pk=shard.pk).values_list("observed", flat=True).first())


def wait_observed(cluster: Cluster, shard: Shard, state: str) -> None:
    wait_until(
        lambda: observed(shard) == state,
        what=f"shard {shard.pk} {state} (is {observed(shard)})",
        logs=cluster.processes(),
    )


def engine_key(port: int) -> str:
    """The engine API key of the live replica whose shard listens on ``port``."""
    key = (
        Replica.objects.filter(shards__port=port)
        .exclude(desired="stopped")
        .order_by("-pk")
        .values_list("engine_key", flat=True)
        .first()
    )
    assert key, f"no replica on port {port}"
    return str(key)


def engine_client(port: int, key: str | None = None) -> OpenAI:
    """The engine itself, as only the gateway may call it: with the replica's key."""
    return OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1",
        api_key=engine_key(port) if key is None else key,
        max_retries=0,
        timeout=60,
    )


def chat(port: int, model: str = "tiny", **kw: Any) -> Any:
    client = engine_client(port)
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello there"}], **kw
    )


def refresh_until(name: str, state: str, cluster: Cluster) -> None:
    """Wait until the store has really heard nothing from ``name`` for as long as ``state``
    takes, then judge its health as of the moment that silence was reached: the node goes
    through the states a timely refresh sees, however late a loaded machine lets this process
    look (a first look six seconds late would find it lost, never unreachable)."""
    after = timedelta(seconds=UNREACHABLE_AFTER if state == "unreachable" else LOST_AFTER)

    def silent_since() -> datetime | None:
        last = Node.objects.get(name=name).last_heartbeat_at
        return last if last is not None and timezone.now() - last > after else None

    last = wait_until(
        silent_since, what=f"node {name} silent for {after}", logs=cluster.processes()
    )
    health.refresh_node_health(now=last + after + timedelta(milliseconds=10))
    assert node_health(name) == state


def stream_of(cluster: Cluster, name: str) -> set[int]:
    """The agent's stream to the web process, as a socket (an inode) the kernel knows."""
    proc = cluster.agents[name].proc
    assert proc is not None
    return connections_to(proc.pid, cluster.control_planes[0].agent_port)


def boot_id(name: str) -> str:
    return str(Node.objects.values_list("boot_id", flat=True).get(name=name))


# --------------------------------------------------------------------------- the basic path


def test_two_agents_start_shards_from_the_database_and_the_shards_answer(fleet: Cluster) -> None:
    """Placement written to the database reaches both agents by nudge; their engines serve
    the OpenAI API; a snapshot delivered again (N6) has no second effect."""
    s1, s2 = place(fleet, "n1", model="m1"), place(fleet, "n2", model="m2")
    wait_observed(fleet, s1, "ready")
    wait_observed(fleet, s2, "ready")
    assert Replica.objects.filter(observed="ready").count() == 2
    for shard, model in ((s1, "m1"), (s2, "m2")):
        answer = chat(shard.port, model, max_tokens=4)
        assert answer.model == model
        assert answer.choices[0].message.content == "tok1 tok2 tok3 tok4"
        assert answer.usage.completion_tokens == 4
    n1 = Node.objects.get(name="n1")
    assert n1.observed_revision == n1.desired_revision
    assert list(n1.gpus.values_list("uuid", flat=True)) == ["SIM-n1-0", "SIM-n1-1"]
    assert n1.addresses == ["127.0.0.1"]

    # N6: the same snapshot twice (two nudges with nothing changed): one engine, untouched.
    agent = fleet.agents["n1"]
    pid = agent.shard_pids()[s1.pk]
    for _ in range(2):
        with transaction.atomic():
            nudges.nudge_node(n1.pk)
    wait_until(
        lambda: Node.objects.get(name="n1").observed_revision == n1.desired_revision + 2,
        what="both re-sent snapshots applied",
        logs=fleet.processes(),
    )
    assert agent.shard_pids() == {s1.pk: pid}
    assert agent.engines() == {s1.pk: [pid]}  # started once, never again
    assert observed(s1) == "ready"


# --------------------------------------------------------------------------- control plane away


def test_control_plane_restart_keeps_shards_and_delivers_what_changed_meanwhile(
    fleet: Cluster,
) -> None:
    """N9: no shard stops because the control plane restarted; the agent comes back by
    itself (its backoff and jitter are unit-tested with the agent's decisions). N5: desired
    state changed while it was away is delivered on reconnect."""
    first = place(fleet, "n1", model="m1")
    wait_observed(fleet, first, "ready")
    agent = fleet.agents["n1"]
    pid = agent.shard_pids()[first.pk]
    boot = boot_id("n1")
    stream = stream_of(fleet, "n1")
    assert stream
    fleet.control_planes[0].stop_web()
    wait_until(lambda: not stream_of(fleet, "n1") & stream, what="n1's stream closed")
    # Placed while no control plane runs (the nudge has nobody to reach).
    second = place(fleet, "n1", model="m2")
    assert chat(first.port, "m1", max_tokens=1).choices  # still serving, alone
    fleet.control_planes[0].start_web()
    wait_observed(fleet, second, "ready")
    assert agent.shard_pids()[first.pk] == pid  # never restarted
    assert agent.engines()[first.pk] == [pid]
    assert observed(first) == "ready"
    assert boot_id("n1") == boot  # the same agent reconnected; it did not restart


def test_a_blip_shorter_than_unreachable_after_changes_nothing(
    fleet: Cluster, settings: Any
) -> None:
    """N3: an agent silent for less than unreachable_after stays ready; nothing restarts.
    The silence is real (the store stops seeing heartbeats), and far below the threshold."""
    settings.LLMGW_UNREACHABLE_AFTER = 60.0
    settings.LLMGW_LOST_AFTER = 120.0
    shard = place(fleet, "n2")
    wait_observed(fleet, shard, "ready")
    agent = fleet.agents["n2"]
    assert agent.proc is not None
    pid = agent.shard_pids()[shard.pk]
    stream = stream_of(fleet, "n2")
    silence = timedelta(seconds=4 * settings.LLMGW_AGENT_HEARTBEAT_INTERVAL)

    def silent_for_a_while() -> bool:
        last = Node.objects.get(name="n2").last_heartbeat_at
        return last is not None and timezone.now() - last > silence

    agent.proc.signal(signal.SIGSTOP)
    try:
        # Several heartbeats missed, as the store sees it; far from the threshold.
        wait_until(silent_for_a_while, what="a few missed heartbeats")
        assert health.refresh_node_health() == []
    finally:
        agent.proc.signal(signal.SIGCONT)
    resumed = timezone.now()
    wait_until(lambda: heartbeat_after("n2", resumed), what="heartbeats again", logs=[agent.proc])
    assert health.refresh_node_health() == []
    assert node_health("n2") == "ready"
    assert not Event.objects.filter(subject="node/n2").exists()
    assert agent.shard_pids() == {shard.pk: pid}
    assert stream_of(fleet, "n2") == stream  # the same stream throughout


def test_a_paused_agent_is_unreachable_then_lost_and_ready_again_when_it_resumes(
    fleet: Cluster,
) -> None:
    """N2: a paused agent keeps its TCP connection open (no FIN, no RST); only the missing
    heartbeats tell. The other node is unaffected; the engines keep serving throughout."""
    shard = place(fleet, "n2")
    wait_observed(fleet, shard, "ready")
    agent = fleet.agents["n2"]
    assert agent.proc is not None
    agent.proc.signal(signal.SIGSTOP)
    try:
        refresh_until("n2", "unreachable", fleet)
        assert node_health("n1") == "ready"
        refresh_until("n2", "lost", fleet)
        assert node_health("n1") == "ready"
        assert chat(shard.port, max_tokens=1).choices  # the engine did not pause
    finally:
        agent.proc.signal(signal.SIGCONT)
    wait_until(lambda: node_health("n2") == "ready", what="n2 ready again", logs=[agent.proc])
    assert observed(shard) == "ready"
    changes = list(
        Event.objects.filter(subject="node/n2", data__has_key="to")
        .order_by("pk")
        .values_list("data__to", flat=True)
    )
    assert changes == ["unreachable", "lost"]
    assert Event.objects.filter(subject="node/n2", message__contains="heartbeats back").exists()


def test_a_killed_agent_is_unreachable_then_lost_and_its_successor_adopts_the_shards(
    fleet: Cluster,
) -> None:
    """N1: kill -9 the agent: unreachable, then lost. Its engine survives; a new agent on the
    node reports it (N4) instead of starting a duplicate."""
    shard = place(fleet, "n1")
    wait_observed(fleet, shard, "ready")
    agent = fleet.agents["n1"]
    assert agent.proc is not None
    pid = agent.shard_pids()[shard.pk]
    boot = boot_id("n1")
    agent.proc.kill()
    refresh_until("n1", "unreachable", fleet)
    refresh_until("n1", "lost", fleet)
    assert node_health("n2") == "ready"
    assert chat(shard.port, max_tokens=1).choices  # the orphaned engine still serves

    successor = agent.start()
    wait_until(
        lambda: boot_id("n1") != boot and node_health("n1") == "ready",
        what="n1 back with a new agent",
        logs=[successor],
    )
    wait_until(lambda: agent.shard_pids() == {shard.pk: pid}, what="adoption", logs=[successor])
    assert agent.engines() == {shard.pk: [pid]}  # adopted, not started again
    assert observed(shard) == "ready"


def test_an_agent_fails_over_between_control_planes(fleet: Cluster) -> None:
    """Agents are given several control-plane addresses and use whichever answers; any web
    process can hold any agent's stream, because everything it sends comes from the store."""
    shard = place(fleet, "n1")
    wait_observed(fleet, shard, "ready")
    agent = fleet.agents["n1"]
    assert agent.proc is not None
    agent.proc.stop()  # its shard stops with it; the new agent starts it again
    primary = fleet.control_planes[0]
    standby_port = free_port()
    # The first address has nobody behind it yet.
    agent.start(urls=[agent_url(fleet.transport, standby_port), primary.agent_url])
    pid = wait_until(lambda: agent.shard_pids().get(shard.pk), what="restarted")
    wait_observed(fleet, shard, "ready")

    if fleet.transport == GRPC:
        standby = fleet.add_control_plane(reconciler=False, agent_port=standby_port)
    else:
        standby = fleet.add_control_plane(reconciler=False, port=standby_port)
    primary.stop_web()
    moved = place(fleet, "n1", model="m2")  # only the standby can deliver it
    wait_observed(fleet, moved, "ready")
    assert connections_to(agent.proc.pid, standby_port), "its stream is with the standby"
    assert agent.shard_pids()[shard.pk] == pid
    assert standby.web is not None and standby.web.running()


def test_sigterm_stops_the_agent_cleanly_with_or_without_its_shards(fleet: Cluster) -> None:
    """SIGTERM: the agent stops its shards and exits 0; with --leave-shards-running it exits 0
    and leaves them for its successor."""
    shard = place(fleet, "n2")
    wait_observed(fleet, shard, "ready")
    agent = fleet.agents["n2"]
    assert agent.proc is not None
    pid = agent.shard_pids()[shard.pk]
    assert agent.proc.stop() == 0
    assert not alive(pid)
    assert observed(shard) == "stopped"  # reported before the stream closed

    keeper = agent.start("--leave-shards-running")
    pid = wait_until(lambda: agent.shard_pids().get(shard.pk), what="restarted", logs=[keeper])
    wait_observed(fleet, shard, "ready")
    boot = boot_id("n2")
    assert keeper.stop() == 0
    assert alive(pid) and chat(shard.port, max_tokens=1).choices
    successor = agent.start()
    wait_until(lambda: boot_id("n2") != boot, what="the successor's hello", logs=[successor])
    wait_until(lambda: agent.shard_pids() == {shard.pk: pid}, what="adoption", logs=[successor])
    engines = agent.engines()
    assert engines == {shard.pk: [pid]}, f"engines {engines}, adopted pid {pid}"


# --------------------------------------------------------------------------- fencing


def test_desired_state_from_a_deposed_leader_is_rejected_counted_and_logged(
    fleet: Cluster,
) -> None:
    """N7: after epoch E+2, a snapshot stamped with epoch E changes nothing on the node; the
    rejection is counted in the node's report and recorded as an event."""
    base = max(Lease.objects.values_list("epoch", flat=True), default=0)
    Lease.objects.update_or_create(
        name="reconciler", defaults={"owner": "leader-a", "epoch": base + 2, "expires_at_ms": 0}
    )
    first = place(fleet, "n1", model="m1")
    wait_observed(fleet, first, "ready")
    rejected = Node.objects.get(name="n1").stale_desired_rejected

    Lease.objects.filter(name="reconciler").update(epoch=base)  # a stale reader's view
    stale = place(fleet, "n1", model="m2")
    wait_until(
        lambda: Node.objects.get(name="n1").stale_desired_rejected > rejected,
        what="the rejection reported",
        logs=fleet.processes(),
    )
    assert observed(stale) == "pending"
    assert fleet.agents["n1"].shard_pids().keys() == {first.pk}
    assert Event.objects.filter(subject="node/n1", message__contains="deposed leader").exists()

    Lease.objects.filter(name="reconciler").update(epoch=base + 3)  # a new leader
    with transaction.atomic():
        nudges.nudge_node(Node.objects.get(name="n1").pk)
    wait_observed(fleet, stale, "ready")


# --------------------------------------------------------------------------- the channel layer


def in_group(cluster: Cluster, node: str) -> bool:
    """The node's stream is a member of its channel-layer group, as Redis holds it."""
    assert cluster.redis is not None
    group = nudges.node_group(Node.objects.get(name=node).pk)
    with redis_client.Redis(port=cluster.redis.port, socket_timeout=5) as client:
        return bool(client.exists(f"asgi:group:{group}"))


def test_a_channel_layer_restart_loses_nothing(fleet: Cluster) -> None:
    """N10: with Redis gone, nudges are lost but streams stay up and the periodic resync
    delivers from the database; once Redis is back, the streams rejoin their groups."""
    assert fleet.redis is not None
    fleet.control_planes[0].start_web(LLMGW_AGENT_RESYNC_INTERVAL="2")
    # Taken once every listener has restarted (over gRPC the agent listener restarts after
    # the web process, so an old stream may still beat while the web process comes up).
    restarted = timezone.now()
    wait_until(lambda: heartbeat_after("n1", restarted), what="n1 reconnected")
    wait_until(lambda: in_group(fleet, "n1"), what="n1's stream in its group")
    stream = wait_until(lambda: stream_of(fleet, "n1"), what="n1's stream")

    fleet.redis.stop()
    during = place(fleet, "n1", model="m1")  # the nudge cannot be delivered
    wait_observed(fleet, during, "ready")
    assert stream_of(fleet, "n1") == stream  # the stream never dropped

    fleet.redis.start()
    # Until a stream has rejoined its group, a nudge for it is lost (and the resync covers).
    wait_until(lambda: in_group(fleet, "n1"), what="n1's stream rejoined its group")
    after = place(fleet, "n1", model="m2")
    wait_observed(fleet, after, "ready")
    assert observed(during) == "ready"
    assert stream_of(fleet, "n1") == stream


# --------------------------------------------------------------------------- drain and weights


def test_a_drain_lets_requests_in_flight_finish_and_keeps_their_weights(fleet: Cluster) -> None:
    """N14: a draining shard finishes what it serves, then stops; its weights are refused
    removal while in use (a clear error on the node) and removed once unused."""
    weights = fleet.agents["n1"].weights_dir / "models" / "tiny"
    weights.mkdir(parents=True, exist_ok=True)
    (weights / "model.safetensors").write_bytes(b"\0" * 4096)
    shard = place(fleet, "n1", args=("--itl-ms", "60"))
    wait_observed(fleet, shard, "ready")

    client = engine_client(shard.port)
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "go"}], max_tokens=40, stream=True
    )
    chunks = iter(stream)
    next(chunks)  # the request is in flight
    received: list[str] = []
    finish: list[str] = []

    def read_rest() -> None:
        for chunk in chunks:
            if chunk.choices:
                received.append(chunk.choices[0].delta.content or "")
                if chunk.choices[0].finish_reason:
                    finish.append(chunk.choices[0].finish_reason)

    reader = threading.Thread(target=read_rest)
    reader.start()
    with transaction.atomic():
        Replica.objects.filter(pk=shard.replica_id).update(desired="draining")
        node = Node.objects.get(name="n1")
        Node.objects.filter(pk=node.pk).update(remove_weights=["models/tiny"])
        nudges.nudge_node(node.pk)
    wait_observed(fleet, shard, "draining")

    def refused() -> bool:
        report = Node.objects.get(name="n1").weights_report
        return any(w["state"] == "refused" for w in report)

    wait_until(refused, what="weights refused while in use", logs=fleet.processes())
    assert weights.exists()
    report = Node.objects.get(name="n1").weights_report[0]
    assert report["name"] == "models/tiny"
    assert f"in use by shard(s) {shard.pk}" in report["message"]

    reader.join(timeout=120)
    assert "".join(received).split()[-1] == "tok40"  # every token of the in-flight request
    assert finish == ["length"]
    wait_observed(fleet, shard, "stopped")
    assert Replica.objects.get(pk=shard.replica_id).observed == "stopped"
    wait_until(lambda: not weights.exists(), what="weights removed", logs=fleet.processes())
    wait_until(
        lambda: Node.objects.get(name="n1").weights_report[0]["state"] == "removed",
        what="removal reported",
        logs=fleet.processes(),
    )
    assert Event.objects.filter(message__startswith="weights models/tiny refused").exists()


# --------------------------------------------------------------------------- authentication


def _handshake(cluster: Cluster, token: str | None, node: str) -> Any:
    headers = {NODE_HEADER: node}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    url = f"ws://127.0.0.1:{cluster.control_planes[0].port}/agents/stream"
    return connect(url, additional_headers=headers, open_timeout=60)


def test_bad_tokens_are_refused_at_the_handshake_and_revocation_ends_a_stream(
    fleet: Cluster, websocket_only: None
) -> None:
    """N13: no token, a wrong token, and node n1's token claiming n2 are refused with HTTP 403
    before any stream exists. Revoking n2's token closes its stream and the token no longer
    opens one; the agent's shards keep running meanwhile, and a new token lets it back in."""
    n1_token = fleet.agents["n1"].token_file.read_text().strip()
    before = boot_id("n2")
    for token, node in [(None, "n2"), ("llmgw_node_" + "A" * 43, "n2"), (n1_token, "n2")]:
        with pytest.raises(InvalidStatus) as refused:
            _handshake(fleet, token, node)
        assert refused.value.response.status_code == 403
    assert boot_id("n2") == before
    web = fleet.control_planes[0].web
    assert web is not None and n1_token not in web.log()  # tokens never reach a log

    shard = place(fleet, "n2")
    wait_observed(fleet, shard, "ready")
    agent = fleet.agents["n2"]
    assert agent.proc is not None
    pid = agent.shard_pids()[shard.pk]
    old_token = agent.token_file.read_text().strip()
    stream = stream_of(fleet, "n2")
    assert node_tokens.revoke_node_token("n2")
    wait_until(lambda: not stream_of(fleet, "n2") & stream, what="n2's stream closed")
    with pytest.raises(InvalidStatus) as refused:
        _handshake(fleet, old_token, "n2")
    assert refused.value.response.status_code == 403
    assert agent.proc.running() and agent.shard_pids() == {shard.pk: pid}
    assert chat(shard.port, max_tokens=1).choices

    # A new token in the agent's token file lets it back in, with no restart of anything.
    reissued = timezone.now()
    fleet.issue_token(agent)
    wait_until(
        lambda: heartbeat_after("n2", reissued) and stream_of(fleet, "n2"),
        what="the agent back in with its new token",
        logs=[agent.proc],
    )
    assert agent.proc.running() and agent.shard_pids() == {shard.pk: pid}
    assert boot_id("n2") == before
    assert observed(shard) == "ready"


# --------------------------------------------------------------------------- bad frames


def test_bad_frames_get_clear_close_codes_and_other_agents_are_unaffected(
    fleet: Cluster, websocket_only: None
) -> None:
    token = node_tokens.issue_node_token("n3")
    hello = encode(Hello(node="n3", boot_id="b", agent_version="test"))
    streams = {name: stream_of(fleet, name) for name in ("n1", "n2")}

    def after_hello(frame: str | bytes) -> tuple[int, dict[str, Any]]:
        with _handshake(fleet, token, "n3") as ws:
            ws.send(hello)
            assert json.loads(ws.recv(timeout=60))["type"] == "welcome"
            assert json.loads(ws.recv(timeout=60))["type"] == "desired"
            ws.send(frame)
            error = json.loads(ws.recv(timeout=60))
            with pytest.raises(ConnectionClosed):
                ws.recv(timeout=60)
            assert ws.close_code is not None
            return ws.close_code, error

    cases: list[tuple[str | bytes, int, str]] = [
        ("{definitely not json", CloseCode.MALFORMED, "not JSON"),
        (json.dumps({"type": "status", "v": 2}), CloseCode.PROTOCOL_VERSION, "version 2"),
        (json.dumps({"type": "launch_missiles", "v": 1}), CloseCode.MALFORMED, "unknown message"),
        (json.dumps({"type": "status", "v": 1, "shards": 5}), CloseCode.MALFORMED, "shards"),
        (b"\x00binary", CloseCode.UNSUPPORTED_DATA, "binary frames"),
        ("x" * 600_000, CloseCode.TOO_BIG, "larger than"),
    ]
    for frame, code, words in cases:
        closed, error = after_hello(frame)
        assert (closed, error["type"], error["code"]) == (code, "error", code)
        assert words in error["message"]

    # Past the web server's own 1 MiB limit the frame is refused before the application sees
    # it: the client sees 1009 "message too big", or 1006 if the drop beat the close frame.
    with _handshake(fleet, token, "n3") as ws:
        ws.send(hello)
        # The server may drop the connection while the frame is still being sent.
        with contextlib.suppress(ConnectionClosed):
            ws.send("y" * (2 * 1024 * 1024))
        with pytest.raises(ConnectionClosed):
            while True:
                ws.recv(timeout=60)
        assert ws.close_code in (1006, 1009)

    # The real agents never noticed: same streams, heartbeats still arriving.
    now = timezone.now()
    for name in ("n1", "n2"):
        wait_until(functools.partial(heartbeat_after, name, now), what=f"{name} still beating")
        assert stream_of(fleet, name) == streams[name]
        assert node_health(name) == "ready"
    web = fleet.control_planes[0].web
    assert web is not None and "Traceback" not in web.log()


# --------------------------------------------------------------------------- a real engine


def write_tiny_llama(path: Path, *, n_layer: int = 2, n_embd: int = 64, seed: int = 0) -> None:
    """A two-layer llama with random weights and a byte-level vocabulary: a few hundred KB
    that llama.cpp loads and runs on a CPU in milliseconds."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    n_head, n_ff = 4, 2 * n_embd
    tokens = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{i:02X}>".encode() for i in range(256)]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_rope_dimension_count(n_embd // n_head)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    control = gguf.TokenType.CONTROL
    writer.add_token_types([gguf.TokenType.UNKNOWN, control, control] + [gguf.TokenType.BYTE] * 256)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)

    def weights(*shape: int, scale: float = 0.02) -> Any:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    ones = np.ones(n_embd, dtype=np.float32)
    writer.add_tensor("token_embd.weight", weights(len(tokens), n_embd, scale=1.0))
    writer.add_tensor("output_norm.weight", ones)
    output = weights(len(tokens), n_embd, scale=1.0)
    output[:3] = 0.0  # special tokens never win: greedy output runs to max_tokens
    writer.add_tensor("output.weight", output)
    for layer in range(n_layer):
        block = f"blk.{layer}."
        writer.add_tensor(block + "attn_norm.weight", ones)
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(block + name + ".weight", weights(n_embd, n_embd))
        writer.add_tensor(block + "ffn_norm.weight", ones)
        writer.add_tensor(block + "ffn_gate.weight", weights(n_ff, n_embd))
        writer.add_tensor(block + "ffn_up.weight", weights(n_ff, n_embd))
        writer.add_tensor(block + "ffn_down.weight", weights(n_embd, n_ff))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.llamacpp
def test_the_llamacpp_recipe_serves_a_real_model(fleet: Cluster) -> None:
    """The llama.cpp server (llama-cpp-python) started by the agent from desired state, on a
    GGUF model this test writes, answers and streams chat completions on the shard's port."""
    weights = fleet.agents["n1"].weights_dir
    weights.mkdir(parents=True, exist_ok=True)
    model_path = weights / "tiny-llama.gguf"
    write_tiny_llama(model_path)
    assert model_path.stat().st_size < 1_000_000
    shard = place(fleet, "n1", model="tiny-llama", engine="llamacpp", source="tiny-llama.gguf",
                  args=("--n_ctx", "256"))  # fmt: skip
    wait_observed(fleet, shard, "ready")
    answer = chat(shard.port, "tiny-llama", max_tokens=6, temperature=0)
    assert answer.object == "chat.completion"
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens >= 6
    client = engine_client(shard.port)
    chunks = list(
        client.chat.completions.create(
            model="tiny-llama",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=6,
            temperature=0,
            stream=True,
        )
    )
    assert len(chunks) >= 6
    assert chunks[-1].choices[0].finish_reason == "length"
    # The real engine, like sim, refuses whoever lacks the replica's key.
    for wrong in ("x", engine_key(shard.port)[:-1]):
        with pytest.raises(openai.AuthenticationError):
            engine_client(shard.port, key=wrong).chat.completions.create(
                model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=1
            )


def test_generation_bump_restarts_a_failed_shard(fleet: Cluster) -> None:
    """A shard that crashes is reported failed with its class and log; a new generation
    starts it again (the reconciler's backoff decides when, not the agent)."""
    shard = place(fleet, "n2", args=("--crash-after", "1"))
    wait_observed(fleet, shard, "ready")
    agent = fleet.agents["n2"]
    crashed = agent.shard_pids()[shard.pk]
    chat(shard.port, max_tokens=1)
    with pytest.raises(Exception):  # noqa: B017 - the engine dies under this request
        chat(shard.port, max_tokens=1)
    wait_observed(fleet, shard, "failed")
    row = Shard.objects.get(pk=shard.pk)
    assert (row.failure_class, row.exit_code) == ("crash", 70)
    assert "exited with code 70" in row.message and row.last_log
    replica = Replica.objects.get(pk=shard.replica_id)
    assert (replica.observed, replica.failures, replica.failure_class) == ("failed", 1, "crash")
    assert not agent.engines()
    with transaction.atomic():
        Replica.objects.filter(pk=replica.pk).update(generation=F("generation") + 1)
        nudges.nudge_node(shard.node_id)
    wait_observed(fleet, shard, "ready")
    (again,) = agent.engines()[shard.pk]
    assert again != crashed and agent.shard_pids() == {shard.pk: again}


# --------------------------------------------------------------------------- engines


def test_an_engine_answers_401_without_its_replicas_key_and_serves_through_the_gateway(
    fleet: Cluster,
) -> None:
    """Whoever reaches the node reaches the engine's port, but not its API: only the gateway
    holds the replica's key. The agent's own readiness polls use it too (the shard got
    ready), and the gateway's requests carry it."""
    shard = place(fleet, "n1")
    wait_observed(fleet, shard, "ready")
    for wrong in ("", "unused", engine_key(shard.port)[:-1]):
        with pytest.raises(openai.AuthenticationError):
            engine_client(shard.port, key=wrong or "x").chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1
            )
    assert chat(shard.port, max_tokens=2).usage.completion_tokens == 2

    key, _ = make_key("engine-key-test")
    gateway = OpenAI(
        base_url=fleet.control_planes[0].url + "/v1", api_key=key, max_retries=0, timeout=60
    )
    answer = wait_until(
        lambda: _through(gateway), what="the gateway routes to the shard", logs=fleet.processes()
    )
    assert answer.choices[0].message.content == "tok1 tok2 tok3"
    wait_until(
        lambda: UsageRecord.objects.filter(
            upstream=f"replica:{shard.replica_id}", status=200
        ).exists(),
        what="the request recorded against the replica",
        logs=fleet.processes(),
    )


def _through(gateway: OpenAI) -> Any:
    try:
        return gateway.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
    except openai.APIStatusError as exc:
        # The gateway's routing table has not seen the shard yet: it may still name an earlier
        # test's replica, whose engine is gone (502), until its next load.
        if exc.status_code in (429, 502, 503):
            return None
        raise


AGENT_SECRETS = {
    "REDIS_URL": "redis://:hunter2@10.9.9.9:6379/0",
    "LLMGW_METRICS_TOKEN": "metrics-token-secret",
    "LLMGW_NODE_TOKEN": "llmgw_node_not-the-real-one-but-secret",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-access-key",
    "GOOGLE_APPLICATION_CREDENTIALS": "/secret/gcp.json",
}


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(
        item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item
    )


def test_an_engines_environment_holds_none_of_the_agents_secrets(fleet: Cluster) -> None:
    """An agent running with credentials in its environment starts engines that see none
    of them: /proc/PID/environ of the engine, as the kernel holds it."""
    agent = fleet.agents["n2"]
    assert agent.proc is not None
    plain = dict(agent.env)
    agent.proc.stop()
    agent.env.update(AGENT_SECRETS)
    try:
        agent.start()
        shard = place(fleet, "n2")
        wait_observed(fleet, shard, "ready")
        (pid,) = agent.engines()[shard.pk]
        assert set(AGENT_SECRETS) <= set(environ(agent.proc.pid))  # the agent has them
        seen = environ(pid)
        assert not set(AGENT_SECRETS) & set(seen)
        assert not any(value in "\0".join(seen.values()) for value in AGENT_SECRETS.values())
        assert seen["VLLM_API_KEY"] == engine_key(shard.port)  # its own key, nobody else's
        assert seen["LLMGW_SHARD_ID"] == str(shard.pk)
    finally:
        agent.proc.stop()
        agent.env.clear()
        agent.env.update(plain)
        agent.start()


# --------------------------------------------------------------------------- revocation


def test_revoked_credentials_end_the_open_stream_at_the_resync_without_a_channel_layer(
    fleet: Cluster,
) -> None:
    """No Redis: the web process (and the gRPC listener) cannot be told of the revocation by a
    nudge, since this test process is another process. The stream ends anyway, at its next
    resync; the agent's shards keep running; new credentials let it back in."""
    plane = fleet.control_planes[0]
    plane.start_web(REDIS_URL="", LLMGW_AGENT_RESYNC_INTERVAL="2")
    agent = fleet.agents["n2"]
    assert agent.proc is not None
    restarted = timezone.now()
    wait_until(lambda: heartbeat_after("n2", restarted), what="n2 reconnected")
    shard = place(fleet, "n2")
    wait_observed(fleet, shard, "ready")
    pid = agent.shard_pids()[shard.pk]
    stream = stream_of(fleet, "n2")
    assert stream
    if fleet.transport == GRPC:
        assert node_certs.revoke_node_cert("n2")
    else:
        assert node_tokens.revoke_node_token("n2")
    wait_until(
        lambda: not stream_of(fleet, "n2") & stream,
        what="n2's stream closed by the resync's check",
        logs=fleet.processes(),
    )
    assert agent.proc.running() and agent.shard_pids() == {shard.pk: pid}
    assert chat(shard.port, max_tokens=1).choices

    reissued = timezone.now()
    fleet.issue_credentials(agent)
    wait_until(
        lambda: heartbeat_after("n2", reissued) and stream_of(fleet, "n2"),
        what="the agent back in with new credentials",
        logs=[agent.proc],
    )
    assert agent.shard_pids() == {shard.pk: pid}


# --------------------------------------------------------------------------- gRPC + mTLS


@pytest.fixture
def grpc_only(cluster: Cluster) -> None:
    if cluster.transport != GRPC:
        pytest.skip("the gRPC listener only")


def grpc_stream(
    cluster: Cluster,
    node: str,
    *,
    tls: tuple[Path, Path, Path] | None,
    claimed: str | None = None,
    plaintext: bool = False,
) -> list[dict[str, Any]]:
    """Open a stream as ``node`` (its hello) on the cluster's listener and return its first two
    frames; raises grpc.RpcError with the call's status when the listener refuses or ends it."""
    target = f"127.0.0.1:{cluster.control_planes[0].agent_port}"
    if plaintext:
        credentials = None
    else:
        assert tls is not None
        ca, cert, key = tls
        credentials = grpc.ssl_channel_credentials(
            ca.read_bytes(), key.read_bytes() if key else None, cert.read_bytes() if cert else None
        )
    metadata = [(grpc_wire.NODE_KEY, claimed)] if claimed else []
    return first_frames(target, node, credentials, metadata)


def first_frames(
    target: str,
    node: str,
    credentials: grpc.ChannelCredentials | None,
    metadata: list[tuple[str, str]],
) -> list[dict[str, Any]]:
    """Send ``node``'s hello, read the first two frames, then cancel the call (how a stream
    ends is not checked here). The deadline is generous: under load the hello's writes may
    queue behind SQLite's other writers for most of its busy timeout."""
    hello = grpc_wire.to_frame(Hello(node=node, boot_id="b", agent_version="t"), AgentFrame)
    channel = (
        grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
    )
    with channel:
        call = channel.stream_stream(
            grpc_wire.METHOD,
            request_serializer=grpc_wire.serialize,
            response_deserializer=grpc_wire.parse_server_frame,
        )
        frames = call(iter([hello]), metadata=metadata, timeout=120)
        try:
            return [json.loads(grpc_wire.frame_to_text(next(frames))) for _ in range(2)]
        finally:
            frames.cancel()


def node_tls(cluster: Cluster, name: str, ca_dir: Path | None = None) -> tuple[Path, Path, Path]:
    out = cluster.root / "extra-certs" / name
    node_certs.issue_node_cert(name, ca_dir or cluster.ca_dir, out)
    return cluster.ca_dir / node_certs.CA_CERT, out / f"{name}.pem", out / f"{name}.key"


def test_with_identity_required_only_a_valid_certificate_of_the_named_node_is_served(
    fleet: Cluster, grpc_only: None, tmp_path: Path
) -> None:
    """Mutual TLS: a certificate of the cluster CA is the node's identity (no token). One of
    another CA, another node's, none at all, or plaintext: refused. The real agents, which
    hold valid ones, are served throughout."""
    tls = node_tls(fleet, "n3")
    frames = grpc_stream(fleet, "n3", tls=tls)
    assert [f["type"] for f in frames] == ["welcome", "desired"]
    assert Node.objects.get(name="n3").health == "ready"

    # A certificate from another CA, even for a node whose row names its serial.
    other = tmp_path / "other-ca"
    node_certs.init_ca(other, ["localhost", "127.0.0.1"])
    _, cert, key = node_tls(fleet, "n3", ca_dir=other)
    with pytest.raises(grpc.RpcError) as refused:
        grpc_stream(fleet, "n3", tls=(tls[0], cert, key))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # the TLS handshake failed

    # Node n4's certificate presenting as n3: at the call, and in the hello.
    tls = node_tls(fleet, "n3")
    n4 = node_tls(fleet, "n4")
    with pytest.raises(grpc.RpcError) as refused:
        grpc_stream(fleet, "n3", tls=n4, claimed="n3")
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as refused:
        grpc_stream(fleet, "n3", tls=n4)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert dict(refused.value.trailing_metadata())[grpc_wire.CLOSE_CODE_KEY] == str(
        int(CloseCode.FORBIDDEN)
    )

    # No client certificate, and no TLS at all.
    with pytest.raises(grpc.RpcError) as refused:
        grpc_stream(fleet, "n3", tls=(tls[0], None, None))  # type: ignore[arg-type]
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError) as refused:
        grpc_stream(fleet, "n3", tls=None, plaintext=True)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    # A revoked certificate opens nothing.
    assert node_certs.revoke_node_cert("n3")
    with pytest.raises(grpc.RpcError) as refused:
        grpc_stream(fleet, "n3", tls=tls)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED

    for name in ("n1", "n2"):
        assert node_health(name) == "ready"
    for plane in fleet.control_planes:
        for proc in plane.services():
            assert "Traceback" not in proc.log()


def test_with_identity_required_a_node_token_opens_no_websocket_stream(
    fleet: Cluster, grpc_only: None
) -> None:
    """LLMGW_AGENT_REQUIRE_IDENTITY is on for this module's whole control plane, its web
    process too: a valid node token is refused on the WebSocket stream at the handshake (HTTP
    403 saying why), so no transport takes a token where certificates are required. The
    certified agents are served over gRPC throughout."""
    token = node_tokens.issue_node_token("tokens-only")
    with pytest.raises(InvalidStatus) as refused:
        _handshake(fleet, token, "tokens-only")
    assert refused.value.response.status_code == 403
    assert b"node certificate" in refused.value.response.body
    assert Node.objects.get(name="tokens-only").last_heartbeat_at is None
    for name in ("n1", "n2"):
        assert node_health(name) == "ready"
    web = fleet.control_planes[0].web
    assert web is not None and token not in web.log()


def test_without_identity_required_the_grpc_listener_takes_node_tokens(
    fleet: Cluster, grpc_only: None, tmp_path: Path
) -> None:
    """A listener without a CA (loopback, plaintext) authenticates by node token, as the
    WebSocket handshake does: a valid token is served, a wrong or another node's is not."""
    plane = fleet.control_planes[0]
    env = {**plane.env, "LLMGW_AGENT_REQUIRE_IDENTITY": "false", "LLMGW_CA_DIR": str(tmp_path)}
    listener = grpc_listener("tokens-grpc", tmp_path / "logs", env, free_port())
    try:
        token = node_tokens.issue_node_token("n5")
        other = node_tokens.issue_node_token("n6")
        target = f"127.0.0.1:{listener.port}"

        def first_frames_with(token: str) -> list[dict[str, Any]]:
            metadata = [("authorization", f"Bearer {token}"), (grpc_wire.NODE_KEY, "n5")]
            return first_frames(target, "n5", None, metadata)

        assert [f["type"] for f in first_frames_with(token)] == ["welcome", "desired"]
        for bad in ("llmgw_node_" + "A" * 43, other, ""):
            with pytest.raises(grpc.RpcError) as refused:
                first_frames_with(bad)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert token not in listener.log() and "Traceback" not in listener.log()
    finally:
        listener.stop()


def test_bad_grpc_frames_end_the_stream_with_clear_codes_and_other_agents_are_unaffected(
    fleet: Cluster, grpc_only: None
) -> None:
    """Bytes that are no frame, a frame from another protocol version, a frame without a
    body, and one past the size limit: each ends that stream with the protocol's close code
    (and gRPC's status), never a crash; the real agents keep their streams."""
    ca, cert, key = node_tls(fleet, "n3")
    streams = {name: stream_of(fleet, name) for name in ("n1", "n2")}
    hello = grpc_wire.serialize(
        grpc_wire.to_frame(Hello(node="n3", boot_id="b", agent_version="t"), AgentFrame)
    )
    old = grpc_wire.to_frame(Heartbeat(seq=1), AgentFrame)
    old.v = 2
    malformed, invalid = CloseCode.MALFORMED, grpc.StatusCode.INVALID_ARGUMENT
    cases: list[tuple[bytes, grpc.StatusCode, CloseCode | None]] = [
        (b"\xff\xff\xff\xff", invalid, malformed),
        (grpc_wire.serialize(old), grpc.StatusCode.FAILED_PRECONDITION, CloseCode.PROTOCOL_VERSION),
        (grpc_wire.serialize(AgentFrame(v=1)), invalid, malformed),
        # Past the listener's own limit, refused by gRPC before the session sees it.
        (b"\x00" * (2 * 1024 * 1024), grpc.StatusCode.RESOURCE_EXHAUSTED, None),
    ]
    credentials = grpc.ssl_channel_credentials(ca.read_bytes(), key.read_bytes(), cert.read_bytes())
    target = f"127.0.0.1:{fleet.control_planes[0].agent_port}"
    for frame, status, code in cases:
        with grpc.secure_channel(target, credentials) as channel:
            call = channel.stream_stream(
                grpc_wire.METHOD,
                request_serializer=lambda raw: raw,
                response_deserializer=grpc_wire.parse_server_frame,
            )
            with pytest.raises(grpc.RpcError) as ended:
                for _ in call(iter([hello, frame]), timeout=120):
                    pass
        assert ended.value.code() == status, ended.value
        if code is not None:
            trailing = dict(ended.value.trailing_metadata() or ())
            assert trailing[grpc_wire.CLOSE_CODE_KEY] == str(int(code))

    now = timezone.now()
    for name in ("n1", "n2"):
        wait_until(functools.partial(heartbeat_after, name, now), what=f"{name} still beating")
        assert stream_of(fleet, name) == streams[name]
    for plane in fleet.control_planes:
        for proc in plane.services():
            assert "Traceback" not in proc.log()
