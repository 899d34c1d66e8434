"""Agents end to end, with real processes on loopback: Daphne serving the agent streams, two
agents with simulated GPUs, ``sim`` (and one llama.cpp) engines the agents start from desired
state written to the database, a private Redis as the channel layer, and the official
``openai`` client talking to the shards. The N-numbers are the scenarios of SCENARIOS.md.

Intervals are shrunk through the environment (unreachable after 3s, lost after 6s, heartbeat
every 0.6s), so every wait here is a poll with a deadline measured in seconds.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import transaction
from django.db.models import F
from openai import OpenAI
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from agents.protocol import NODE_HEADER, CloseCode, Hello, encode
from control import nodes
from control.models import Event, Lease, Node, Profile, Replica, ServedModel, Shard
from tests.harness.agents_cluster import Cluster, Proc, start_redis, wait_for
from tests.harness.procs import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

UNREACHABLE_AFTER = 3.0
LOST_AFTER = 6.0


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Proc]]:
    port = free_port()
    proc = start_redis(port, tmp_path_factory.mktemp("redis") / "redis.log")
    yield port, proc
    proc.stop()


@pytest.fixture
def cluster(
    transactional_db: None, settings: Any, tmp_path: Path, redis: tuple[int, Proc]
) -> Iterator[Cluster]:
    """Daphne plus agents n1 and n2, both registered and ready. Torn down before the flush."""
    port, redis_proc = redis
    if not redis_proc.running():  # a test stopped it and failed before restarting it
        redis_proc.start()
        wait_for(lambda: _redis_up(port), timeout=10, what="redis back")
    redis_url = f"redis://127.0.0.1:{port}/0"
    settings.CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [redis_url]},
        }
    }
    settings.LLMGW_UNREACHABLE_AFTER = UNREACHABLE_AFTER
    settings.LLMGW_LOST_AFTER = LOST_AFTER
    settings.LLMGW_LEADER_ELECTION = True
    c = Cluster(
        root=tmp_path,
        redis_url=redis_url,
        daphne_env={
            "LLMGW_UNREACHABLE_AFTER": str(UNREACHABLE_AFTER),
            "LLMGW_LOST_AFTER": str(LOST_AFTER),
            # Long, so every prompt delivery below is a nudge's doing, not a resync's.
            "LLMGW_AGENT_RESYNC_INTERVAL": "60",
            "LLMGW_DRAIN_TIMEOUT": "20",
            "LLMGW_LEADER_ELECTION": "true",
        },
    )
    for name in ("n1", "n2"):
        c.token_file(name).parent.mkdir(parents=True)
        c.token_file(name).write_text(nodes.issue_node_token(name))
    try:
        c.start_daphne()
        for name in ("n1", "n2"):
            c.start_agent(name)
        wait_for(
            lambda: Node.objects.filter(health="ready", gpus__index=1).count() == 2,
            what="both nodes ready with their GPUs",
            logs=c.processes(),
        )
        yield c
    finally:
        c.stop()


def _redis_up(port: int) -> bool:
    import redis as redis_client

    try:
        return bool(redis_client.Redis(port=port, socket_timeout=0.5).ping())
    except redis_client.RedisError:
        return False


def place(
    node: str,
    *,
    model: str = "tiny",
    engine: str = "sim",
    args: tuple[str, ...] = (),
    source: str = "models/tiny",
    port: int | None = None,
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
            replica=replica, node=target, port=port or free_port(), gpu_indices=[0]
        )
        nodes.nudge_node(target.pk)
    return shard


def observed(shard: Shard) -> str:
    return str(Shard.objects.filter(pk=shard.pk).values_list("observed", flat=True).first())


def wait_observed(c: Cluster, shard: Shard, state: str, timeout: float = 20) -> None:
    wait_for(
        lambda: observed(shard) == state,
        timeout=timeout,
        what=f"shard {shard.pk} {state} (is {observed(shard)})",
        logs=c.processes(),
    )


def chat(port: int, model: str = "tiny", **kw: Any) -> Any:
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello there"}], **kw
    )


def health(name: str) -> str:
    return str(Node.objects.filter(name=name).values_list("health", flat=True).first())


def refresh_until(name: str, state: str, c: Cluster, timeout: float = 10) -> None:
    def check() -> bool:
        nodes.refresh_node_health()
        return health(name) == state

    wait_for(check, timeout=timeout, what=f"node {name} {state}", logs=c.processes())


# --------------------------------------------------------------------------- the basic path


def test_two_agents_start_shards_from_the_database_and_the_shards_answer(cluster: Cluster) -> None:
    """Placement written to the database reaches both agents by nudge; their engines serve
    the OpenAI API; a snapshot delivered again (N6) has no second effect."""
    s1, s2 = place("n1", model="m1"), place("n2", model="m2")
    wait_observed(cluster, s1, "ready")
    wait_observed(cluster, s2, "ready")
    assert Replica.objects.filter(observed="ready").count() == 2
    for shard, model in ((s1, "m1"), (s2, "m2")):
        answer = chat(shard.port, model, max_tokens=4)
        assert answer.model == model
        assert answer.choices[0].message.content == "tok1 tok2 tok3 tok4"
        assert answer.usage.completion_tokens == 4
    n1 = Node.objects.get(name="n1")
    assert n1.observed_revision == n1.desired_revision == 1
    assert list(n1.gpus.values_list("uuid", flat=True)) == ["SIM-n1-0", "SIM-n1-1"]
    assert n1.addresses == ["127.0.0.1"]

    # N6: the same snapshot twice (two nudges with nothing changed): one engine, untouched.
    pid = cluster.shard_pids("n1")[s1.pk]
    for _ in range(2):
        with transaction.atomic():
            nodes.nudge_node(n1.pk)
    wait_for(
        lambda: Node.objects.get(name="n1").observed_revision == 3,
        what="both re-sent snapshots applied",
        logs=cluster.processes(),
    )
    assert cluster.shard_pids("n1") == {s1.pk: pid}
    assert cluster.agents["n1"].count(f"shard {s1.pk} (replica") == 1  # started once
    assert observed(s1) == "ready"


# --------------------------------------------------------------------------- control plane away


def test_control_plane_restart_keeps_shards_and_delivers_what_changed_meanwhile(
    cluster: Cluster,
) -> None:
    """N9: no shard stops because the control plane restarted; agents come back with backoff
    and jitter. N5: desired state changed while they were away is delivered on reconnect."""
    first = place("n1", model="m1")
    wait_observed(cluster, first, "ready")
    pid = cluster.shard_pids("n1")[first.pk]
    agent = cluster.agents["n1"]
    cluster.stop_daphne()
    wait_for(
        lambda: agent.count("reconnecting in") >= 3,
        what="several reconnect attempts",
        logs=[agent],
    )
    # Placed while no control plane runs (the nudge has nobody to reach).
    second = place("n1", model="m2")
    assert chat(first.port, "m1", max_tokens=1).choices  # still serving, alone
    cluster.start_daphne()
    wait_observed(cluster, second, "ready")
    assert cluster.shard_pids("n1")[first.pk] == pid  # never restarted
    assert observed(first) == "ready"
    assert agent.count("connected to ws://") == 2
    delays = [
        float(line.split("reconnecting in ")[1].split("s")[0])
        for line in agent.log().splitlines()
        if "reconnecting in" in line
    ]
    assert len(set(delays)) > 1  # jittered, not one fixed delay
    assert max(delays) <= 1.0  # capped by --backoff-max


def test_a_blip_shorter_than_unreachable_after_changes_nothing(cluster: Cluster) -> None:
    """N3: an agent silent for less than unreachable_after stays ready; nothing restarts."""
    shard = place("n2")
    wait_observed(cluster, shard, "ready")
    pid = cluster.shard_pids("n2")[shard.pk]
    agent = cluster.agents["n2"]
    agent.signal(signal.SIGSTOP)
    try:
        end = time.monotonic() + UNREACHABLE_AFTER / 3
        while time.monotonic() < end:
            assert nodes.refresh_node_health() == []
            time.sleep(0.05)
    finally:
        agent.signal(signal.SIGCONT)
    end = time.monotonic() + UNREACHABLE_AFTER * 1.5
    while time.monotonic() < end:  # well past the threshold, counted from the pause
        assert nodes.refresh_node_health() == []
        time.sleep(0.1)
    assert health("n2") == "ready"
    assert not Event.objects.filter(subject="node/n2", message__contains="unreachable").exists()
    assert cluster.shard_pids("n2") == {shard.pk: pid}
    assert agent.count("connected to ws://") == 1


def test_a_paused_agent_is_unreachable_then_lost_and_ready_again_when_it_resumes(
    cluster: Cluster,
) -> None:
    """N2: a paused agent keeps its TCP connection open (no FIN, no RST); only the missing
    heartbeats tell. The other node is unaffected; the engines keep serving throughout."""
    shard = place("n2")
    wait_observed(cluster, shard, "ready")
    agent = cluster.agents["n2"]
    agent.signal(signal.SIGSTOP)
    try:
        refresh_until("n2", "unreachable", cluster)
        assert health("n1") == "ready"
        refresh_until("n2", "lost", cluster)
        assert health("n1") == "ready"
        assert chat(shard.port, max_tokens=1).choices  # the engine did not pause
    finally:
        agent.signal(signal.SIGCONT)
    wait_for(lambda: health("n2") == "ready", what="n2 ready again", logs=cluster.processes())
    assert observed(shard) == "ready"
    messages = list(Event.objects.filter(subject="node/n2").values_list("message", flat=True))
    assert any(m.startswith("node unreachable") for m in messages)
    assert any(m.startswith("node lost") for m in messages)
    assert "node ready: heartbeats back" in messages


def test_a_killed_agent_is_unreachable_then_lost_and_its_successor_adopts_the_shards(
    cluster: Cluster,
) -> None:
    """N1: kill -9 the agent: unreachable, then lost. Its engine survives; a new agent on the
    node reports it (N4) instead of starting a duplicate."""
    shard = place("n1")
    wait_observed(cluster, shard, "ready")
    pid = cluster.shard_pids("n1")[shard.pk]
    cluster.agents["n1"].kill()
    refresh_until("n1", "unreachable", cluster)
    refresh_until("n1", "lost", cluster)
    assert health("n2") == "ready"
    assert chat(shard.port, max_tokens=1).choices  # the orphaned engine still serves

    successor = cluster.start_agent("n1")
    wait_for(lambda: health("n1") == "ready", what="n1 back", logs=[successor])
    wait_for(
        lambda: f"adopted shard {shard.pk} (pid {pid}" in successor.log(),
        what="adoption",
        logs=[successor],
    )
    assert cluster.shard_pids("n1") == {shard.pk: pid}
    assert successor.count("started: pid") == 0
    assert observed(shard) == "ready"


def test_an_agent_fails_over_between_control_planes(cluster: Cluster) -> None:
    """Agents are given several control-plane addresses and use whichever answers; any web
    process can hold any agent's stream, because everything it sends comes from the store."""
    shard = place("n1")
    wait_observed(cluster, shard, "ready")
    cluster.agents["n1"].stop()  # its shard stops with it; the new agent starts it again
    standby_port = free_port()
    agent = cluster.start_agent(
        "n1", urls=[f"http://127.0.0.1:{standby_port}", cluster.url]
    )  # the first address has nobody behind it yet
    wait_for(lambda: f"connected to ws://127.0.0.1:{cluster.port}/" in agent.log(), logs=[agent])
    assert f"cannot reach ws://127.0.0.1:{standby_port}/agents/stream" in agent.log()
    pid = wait_for(lambda: cluster.shard_pids("n1").get(shard.pk), what="restarted", logs=[agent])
    wait_observed(cluster, shard, "ready")

    standby = cluster.start_daphne(port=standby_port)
    cluster.stop_daphne()
    wait_for(
        lambda: f"connected to ws://127.0.0.1:{standby_port}/" in agent.log(),
        what="failover to the standby",
        logs=[agent, standby],
    )
    moved = place("n1", model="m2")  # delivered by the standby's stream
    wait_observed(cluster, moved, "ready")
    assert "node n1: sent desired state revision" in standby.log()
    assert cluster.shard_pids("n1")[shard.pk] == pid


def test_sigterm_stops_the_agent_cleanly_with_or_without_its_shards(cluster: Cluster) -> None:
    """SIGTERM: the agent stops its shards and exits 0; with --leave-shards-running it exits 0
    and leaves them for its successor."""
    shard = place("n2")
    wait_observed(cluster, shard, "ready")
    pid = cluster.shard_pids("n2")[shard.pk]
    assert cluster.agents["n2"].stop() == 0
    assert f"shard {shard.pk} stopped" in cluster.agents["n2"].log()
    assert not _alive(pid)
    assert observed(shard) == "stopped"  # reported before the stream closed

    keeper = cluster.start_agent("n2", "--leave-shards-running")
    wait_for(lambda: cluster.shard_pids("n2").get(shard.pk), what="restarted", logs=[keeper])
    pid = cluster.shard_pids("n2")[shard.pk]
    wait_observed(cluster, shard, "ready")
    assert keeper.stop() == 0
    assert "leaving 1 shard(s) running for the next agent" in keeper.log()
    assert _alive(pid) and chat(shard.port, max_tokens=1).choices
    successor = cluster.start_agent("n2")
    wait_for(lambda: f"adopted shard {shard.pk}" in successor.log(), logs=[successor])
    assert cluster.shard_pids("n2") == {shard.pk: pid}


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


# --------------------------------------------------------------------------- fencing


def test_desired_state_from_a_deposed_leader_is_rejected_counted_and_logged(
    cluster: Cluster,
) -> None:
    """N7: after epoch 5, a snapshot stamped with epoch 3 changes nothing on the node."""
    Lease.objects.create(name="reconciler", owner="leader-a", epoch=5, expires_at_ms=0)
    first = place("n1", model="m1")
    wait_observed(cluster, first, "ready")

    Lease.objects.filter(name="reconciler").update(epoch=3)  # a stale reader's view
    stale = place("n1", model="m2")
    wait_for(
        lambda: Node.objects.get(name="n1").stale_desired_rejected >= 1,
        what="the rejection reported",
        logs=cluster.processes(),
    )
    agent = cluster.agents["n1"]
    assert "epoch 3 is lower than 5, the highest seen" in agent.log()
    assert observed(stale) == "pending"
    assert cluster.shard_pids("n1").keys() == {first.pk}
    assert Event.objects.filter(subject="node/n1", message__contains="deposed leader").exists()

    Lease.objects.filter(name="reconciler").update(epoch=6)  # a new leader
    with transaction.atomic():
        nodes.nudge_node(Node.objects.get(name="n1").pk)
    wait_observed(cluster, stale, "ready")


# --------------------------------------------------------------------------- the channel layer


def test_a_channel_layer_restart_loses_nothing(cluster: Cluster, redis: tuple[int, Proc]) -> None:
    """N10: with Redis gone, nudges are lost but streams stay up and the periodic resync
    delivers from the database; once Redis is back, nudges flow again."""
    port, redis_proc = redis
    cluster.stop_daphne()
    cluster.start_daphne(LLMGW_AGENT_RESYNC_INTERVAL="2")
    agent = cluster.agents["n1"]
    wait_for(lambda: agent.count("connected to ws://") == 2, what="reconnected", logs=[agent])

    redis_proc.stop()
    during = place("n1", model="m1")  # the nudge cannot be delivered
    wait_observed(cluster, during, "ready")
    assert cluster.daphne is not None
    assert "channel layer unavailable" in cluster.daphne.log()
    assert agent.count("connected to ws://") == 2  # the stream never dropped

    redis_proc.start()
    wait_for(lambda: _redis_up(port), timeout=10, what="redis back")
    # Until a stream has rejoined its group, a nudge for it is lost (and the resync covers).
    wait_for(
        lambda: "channel layer back: node n1" in cluster.daphne.log(),  # type: ignore[union-attr]
        what="n1's stream rejoined its group",
        logs=cluster.processes(),
    )
    after = place("n1", model="m2")
    wait_observed(cluster, after, "ready")
    assert observed(during) == "ready"


# --------------------------------------------------------------------------- drain and weights


def test_a_drain_lets_requests_in_flight_finish_and_keeps_their_weights(
    cluster: Cluster,
) -> None:
    """N14: a draining shard finishes what it serves, then stops; its weights are refused
    removal while in use (a clear error on the node) and removed once unused."""
    weights = cluster.weights_dir("n1") / "models" / "tiny"
    weights.mkdir(parents=True)
    (weights / "model.safetensors").write_bytes(b"\0" * 4096)
    shard = place("n1", args=("--itl-ms", "60"))
    wait_observed(cluster, shard, "ready")

    client = OpenAI(base_url=f"http://127.0.0.1:{shard.port}/v1", api_key="x", max_retries=0)
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
        nodes.nudge_node(node.pk)
    wait_observed(cluster, shard, "draining", timeout=5)

    def refused() -> bool:
        report = Node.objects.get(name="n1").weights_report
        return any(w["state"] == "refused" for w in report)

    wait_for(refused, what="weights refused while in use", logs=cluster.processes())
    assert weights.exists()
    report = Node.objects.get(name="n1").weights_report[0]
    assert report["name"] == "models/tiny"
    assert f"in use by shard(s) {shard.pk}" in report["message"]

    reader.join(timeout=15)
    assert "".join(received).split()[-1] == "tok40"  # every token of the in-flight request
    assert finish == ["length"]
    wait_observed(cluster, shard, "stopped")
    assert Replica.objects.get(pk=shard.replica_id).observed == "stopped"
    wait_for(lambda: not weights.exists(), what="weights removed", logs=cluster.processes())
    wait_for(
        lambda: Node.objects.get(name="n1").weights_report[0]["state"] == "removed",
        what="removal reported",
        logs=cluster.processes(),
    )
    assert Event.objects.filter(message__startswith="weights models/tiny refused").exists()


# --------------------------------------------------------------------------- authentication


def _handshake(cluster: Cluster, token: str | None, node: str) -> Any:
    headers = {NODE_HEADER: node}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return connect(f"ws://127.0.0.1:{cluster.port}/agents/stream", additional_headers=headers)


def test_bad_tokens_are_refused_at_the_handshake_and_revocation_ends_a_stream(
    cluster: Cluster,
) -> None:
    """N13: no token, a wrong token, and node n1's token claiming n2 are refused with HTTP 403
    before any stream exists. Revoking n2's token closes its stream; the agent cannot get back
    in, and its shards keep running meanwhile."""
    n1_token = cluster.token_file("n1").read_text().strip()
    before = Node.objects.get(name="n2").boot_id
    for token, node in [(None, "n2"), ("llmgw_node_" + "A" * 43, "n2"), (n1_token, "n2")]:
        with pytest.raises(InvalidStatus) as refused:
            _handshake(cluster, token, node)
        assert refused.value.response.status_code == 403
    assert Node.objects.get(name="n2").boot_id == before
    assert cluster.daphne is not None
    daphne_log = cluster.daphne.log()
    assert "the token of node 'n1' claims node 'n2'" in daphne_log
    assert n1_token not in daphne_log  # tokens never reach a log

    shard = place("n2")
    wait_observed(cluster, shard, "ready")
    pid = cluster.shard_pids("n2")[shard.pk]
    assert nodes.revoke_node_token("n2")
    agent = cluster.agents["n2"]
    wait_for(
        lambda: "refused this agent at the handshake (HTTP 403)" in agent.log(),
        what="the revoked agent refused",
        logs=[agent],
    )
    assert f"control plane error {int(CloseCode.UNAUTHORIZED)}" in agent.log()
    assert cluster.shard_pids("n2") == {shard.pk: pid}
    assert chat(shard.port, max_tokens=1).choices

    # A new token in the agent's token file lets it back in, with no restart of anything.
    cluster.token_file("n2").write_text(nodes.issue_node_token("n2"))
    wait_for(
        lambda: agent.count("connected to ws://") == 2,
        what="the agent back in with its new token",
        logs=[agent],
    )
    assert agent.running() and cluster.shard_pids("n2") == {shard.pk: pid}
    assert observed(shard) == "ready"


# --------------------------------------------------------------------------- bad frames


def test_bad_frames_get_clear_close_codes_and_other_agents_are_unaffected(
    cluster: Cluster,
) -> None:
    token = nodes.issue_node_token("n3")
    hello = encode(Hello(node="n3", boot_id="b", agent_version="test"))
    n1 = Node.objects.get(name="n1")
    connections_before = cluster.agents["n1"].count("connected to ws://")

    def after_hello(frame: str | bytes) -> tuple[int, dict[str, Any]]:
        with _handshake(cluster, token, "n3") as ws:
            ws.send(hello)
            assert json.loads(ws.recv(timeout=5))["type"] == "welcome"
            assert json.loads(ws.recv(timeout=5))["type"] == "desired"
            ws.send(frame)
            error = json.loads(ws.recv(timeout=5))
            with pytest.raises(ConnectionClosed):
                ws.recv(timeout=5)
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

    # Past Daphne's own 1 MiB limit the frame is refused before the application sees it.
    with _handshake(cluster, token, "n3") as ws:
        ws.send(hello)
        ws.send("y" * (2 * 1024 * 1024))
        with pytest.raises(ConnectionClosed):
            while True:
                ws.recv(timeout=5)
        # Autobahn (Daphne's WebSocket layer) fails the connection at its own limit: the
        # client sees 1009 "message too big", or 1006 if the drop beat the close frame.
        assert ws.close_code in (1006, 1009)

    # The real agents never noticed: same streams, heartbeats still arriving.
    beat = Node.objects.get(pk=n1.pk).last_heartbeat_at
    wait_for(
        lambda: Node.objects.get(pk=n1.pk).last_heartbeat_at != beat,
        what="n1 still beating",
        logs=cluster.processes(),
    )
    assert cluster.agents["n1"].count("connected to ws://") == connections_before
    assert health("n1") == health("n2") == "ready"
    assert cluster.daphne is not None and "Traceback" not in cluster.daphne.log()


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


def test_the_llamacpp_recipe_serves_a_real_model(cluster: Cluster) -> None:
    """The llama.cpp server (llama-cpp-python) started by the agent from desired state, on a
    GGUF model this test writes, answers and streams chat completions on the shard's port."""
    cluster.weights_dir("n1").mkdir(parents=True, exist_ok=True)
    model_path = cluster.weights_dir("n1") / "tiny-llama.gguf"
    write_tiny_llama(model_path)
    assert model_path.stat().st_size < 1_000_000
    shard = place("n1", model="tiny-llama", engine="llamacpp", source="tiny-llama.gguf",
                  args=("--n_ctx", "256"))  # fmt: skip
    wait_observed(cluster, shard, "ready", timeout=60)
    answer = chat(shard.port, "tiny-llama", max_tokens=6, temperature=0)
    assert answer.object == "chat.completion"
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens >= 6
    client = OpenAI(base_url=f"http://127.0.0.1:{shard.port}/v1", api_key="x", max_retries=0)
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
    log = cluster.agents["n1"].log()
    assert f"shard {shard.pk} (replica {shard.replica_id}, llamacpp tiny-llama) started" in log


def test_generation_bump_restarts_a_failed_shard(cluster: Cluster) -> None:
    """A shard that crashes is reported failed with its class and log; the same desired state
    again does not restart it, a new generation does (the reconciler's backoff, not ours)."""
    shard = place("n2", args=("--crash-after", "1"))
    wait_observed(cluster, shard, "ready")
    chat(shard.port, max_tokens=1)
    with pytest.raises(Exception):  # noqa: B017 - the engine dies under this request
        chat(shard.port, max_tokens=1)
    wait_observed(cluster, shard, "failed")
    row = Shard.objects.get(pk=shard.pk)
    assert (row.failure_class, row.exit_code) == ("crash", 70)
    assert "exited with code 70" in row.message and row.last_log
    replica = Replica.objects.get(pk=shard.replica_id)
    assert (replica.observed, replica.failures, replica.failure_class) == ("failed", 1, "crash")
    with transaction.atomic():
        Replica.objects.filter(pk=replica.pk).update(generation=F("generation") + 1)
        nodes.nudge_node(shard.node_id)
    wait_observed(cluster, shard, "ready")
    assert cluster.agents["n2"].count(f"shard {shard.pk} (replica") == 2
