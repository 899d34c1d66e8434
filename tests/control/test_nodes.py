"""Nodes on the control-plane side: tokens, health from heartbeats, what agents report, the
desired state they are sent, nudges, and the stream consumer (in process, through Channels'
test communicator; the real-process version is in agents/agent_e2e.py)."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from collections.abc import AsyncIterator
from datetime import timedelta
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.layers import InMemoryChannelLayer, get_channel_layer
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.core.management import call_command
from django.db import OperationalError, transaction
from django.utils import timezone

from agents.protocol.codec import decode_server_message, encode
from agents.protocol.messages import (
    ErrorMessage,
    GpuInfo,
    Heartbeat,
    Hello,
    ShardStatus,
    Status,
    WeightsReport,
)
from agents.protocol.vocabulary import (
    MAX_MESSAGE_BYTES,
    NODE_HEADER,
    PROTOCOL_VERSION,
    CloseCode,
    DesiredShardState,
    FailureClass,
    ShardState,
    WeightsState,
)
from control import (
    agent_peers,
    agent_reports,
    consumers,
    desired_state,
    health,
    node_tokens,
    nudges,
    serving,
)
from control.agent_plumbing import HeartbeatWriter, NodeRowReader, read_node_rows
from control.agent_sessions import FULL_RESYNC_EVERY, AgentSession
from control.models import Event, Gpu, Lease, Node, Profile, Replica, ServedModel, Shard
from control.routing import websocket_urlpatterns
from llmgw_site.config import redis_channel_layer
from tests.harness.clock import FakeClock
from tests.harness.factories import issue_node, make_model, make_profile, make_replica
from tests.harness.waits import await_until

# Plain tests roll back (fast on PostgreSQL); tests whose work runs in another thread
# (database_sync_to_async) or needs a real commit (on_commit nudges) truncate instead.
db = pytest.mark.django_db
committed = pytest.mark.django_db(transaction=True)

NOW = timezone.now()

# Channels waits 1 s by default; the handshake does store work, which a loaded machine can
# make slower than that without anything being wrong.
CONNECT_TIMEOUT = 30


# --------------------------------------------------------------------------- factories


def shard_on(
    node: Node, *, port: int = 20001, model: str = "tiny", engine: str = "sim", **replica: Any
) -> Shard:
    """A one-shard replica of ``model`` on ``node``, as the reconciler writes one (pending)."""
    served = ServedModel.objects.filter(name=model).first()
    if served is None:
        profile = Profile.objects.filter(name=f"{engine}-profile").first() or make_profile(
            f"{engine}-profile", engine=engine, args=["--x", "{port}"]
        )
        served = make_model(model, profile=profile)
    placed = make_replica(
        served,
        [(node, [0])],
        observed=Replica.Observed.PENDING,
        ready_after_s=None,
        ports=[port],
        **replica,
    )
    return placed.shards.get()


def hello(name: str = "n1", **changes: Any) -> Hello:
    base = Hello(
        node=name,
        boot_id="boot-1",
        agent_version="0.1.0",
        gpus=(
            GpuInfo(0, "GPU-0", "H100", 81920, 10),
            GpuInfo(1, "GPU-1", "H100", 81920, 20),
        ),
        addresses=("10.0.0.7",),
        port_range=(20000, 20099),
    )
    return Hello(**{**base.__dict__, **changes})


def report(shard: Shard, state: ShardState, **changes: Any) -> ShardStatus:
    return ShardStatus(
        **{
            "shard_id": shard.pk,
            "replica_id": shard.replica_id,
            "generation": shard.replica.generation,
            "state": state,
            "port": shard.port,
            **changes,
        }
    )


# --------------------------------------------------------------------------- pure decisions


@pytest.mark.parametrize(
    ("age", "expected"),
    [(0.0, "ready"), (14.9, "ready"), (15.0, "unreachable"), (59.9, "unreachable"),
     (60.0, "lost"), (3600.0, "lost")],
)  # fmt: skip
def test_node_health_follows_the_age_of_the_last_heartbeat(age: float, expected: str) -> None:
    last = NOW - timedelta(seconds=age)
    assert health.node_health(last, NOW, unreachable_after=15, lost_after=60) == expected


def test_a_node_that_never_beat_is_new() -> None:
    assert health.node_health(None, NOW, unreachable_after=15, lost_after=60) == "new"


@pytest.mark.parametrize(
    ("states", "expected"),
    [
        ([], "pending"),
        (["ready"], "ready"),
        (["ready", "ready"], "ready"),
        (["ready", "starting"], "starting"),
        (["ready", "failed"], "failed"),
        (["draining", "ready"], "draining"),
        (["stopped", "stopped"], "stopped"),
        (["stopped", "pending"], "pending"),
        (["pending", "starting"], "starting"),
    ],
)
def test_a_replica_is_ready_only_when_every_shard_is(states: list[str], expected: str) -> None:
    assert agent_reports.replica_observed(states) == expected


# --------------------------------------------------------------------------- tokens


@db
def test_a_token_authenticates_its_own_node_and_no_other() -> None:
    _, token_a = issue_node("node-a")
    issue_node("node-b")
    assert node_tokens.authenticate(token_a, "node-a").name == "node-a"
    assert node_tokens.authenticate(token_a, None).name == "node-a"
    with pytest.raises(
        node_tokens.TokenRejected, match="token of node 'node-a' claims node 'node-b'"
    ):
        node_tokens.authenticate(token_a, "node-b")
    for bad in ("", "llmgw_node_" + "x" * 43, "Bearer abc", token_a + "x"):
        with pytest.raises(node_tokens.TokenRejected):
            node_tokens.authenticate(bad, "node-a")


@db
def test_tokens_are_kept_only_as_hashes_with_a_visible_prefix() -> None:
    node, token = issue_node("n1")
    assert token.startswith("llmgw_node_") and len(token) > 50
    assert node.token_hash == node_tokens.hash_token(token) and node.token_hash != token
    assert token.startswith(node.token_prefix) and len(node.token_prefix) < len(token) / 2
    dumped = json.dumps(list(Node.objects.values()), default=str)
    dumped += json.dumps(list(Event.objects.values()), default=str)
    assert token not in dumped


@db
def test_a_reissued_token_replaces_the_old_one_and_revoking_ends_it() -> None:
    _, first = issue_node("n1")
    second = node_tokens.issue_node_token("n1")
    with pytest.raises(node_tokens.TokenRejected, match="unknown or revoked"):
        node_tokens.authenticate(first, "n1")
    assert node_tokens.authenticate(second, "n1").name == "n1"
    assert node_tokens.revoke_node_token("n1")
    assert not node_tokens.revoke_node_token("n1")  # nothing left to revoke
    assert not node_tokens.revoke_node_token("nope")
    with pytest.raises(node_tokens.TokenRejected):
        node_tokens.authenticate(second, "n1")
    assert Event.objects.filter(subject="node/n1", message="node token revoked").exists()


@db
def test_issue_node_token_prints_once_or_writes_a_private_file(tmp_path: Path) -> None:
    out, err = StringIO(), StringIO()
    call_command("issue_node_token", "gpu-07", stdout=out, stderr=err)
    token = out.getvalue().strip()
    assert node_tokens.authenticate(token, "gpu-07").name == "gpu-07"
    assert token not in err.getvalue()
    target = tmp_path / "sub" / "token"
    call_command("issue_node_token", "gpu-07", "--output", str(target), stdout=out, stderr=err)
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600
    assert node_tokens.authenticate(target.read_text().strip(), "gpu-07").name == "gpu-07"
    with pytest.raises(node_tokens.TokenRejected):
        node_tokens.authenticate(token, "gpu-07")  # the printed one was replaced


@db
def test_revoke_node_token_command_reports_what_it_did() -> None:
    issue_node("n1")
    out = StringIO()
    call_command("revoke_node_token", "n1", stdout=out)
    assert "revoked" in out.getvalue()
    with pytest.raises(SystemExit) as exit_info:
        call_command("revoke_node_token", "n1", stdout=out, stderr=StringIO())
    assert exit_info.value.code == 1


# --------------------------------------------------------------------------- health


@db
def test_refresh_marks_late_nodes_unreachable_then_lost(settings: Any) -> None:
    settings.LLMGW_UNREACHABLE_AFTER = 15
    settings.LLMGW_LOST_AFTER = 60
    node, _ = issue_node("n1", last_heartbeat_at=NOW, health=Node.Health.READY)
    issue_node("fresh", last_heartbeat_at=NOW + timedelta(seconds=50), health=Node.Health.READY)
    issue_node("never")
    assert health.refresh_node_health(NOW + timedelta(seconds=10)) == []
    changes = health.refresh_node_health(NOW + timedelta(seconds=20))
    assert [(c.name, c.old, c.new) for c in changes] == [("n1", "ready", "unreachable")]
    assert health.refresh_node_health(NOW + timedelta(seconds=30)) == []  # no repeat
    changes = health.refresh_node_health(NOW + timedelta(seconds=61))
    assert [(c.name, c.new) for c in changes] == [("n1", "lost")]
    assert Node.objects.get(name="fresh").health == "ready"
    assert Node.objects.get(name="never").health == "new"
    messages = list(Event.objects.filter(subject="node/n1").values_list("message", flat=True))
    assert any(m.startswith("node unreachable: no heartbeat for 20.0s") for m in messages)
    assert any(m.startswith("node lost") for m in messages)
    node.refresh_from_db()
    assert node.state == "lost"


@db
def test_silence_counts_from_when_the_store_came_back(settings: Any) -> None:
    """[L6] The store was away for 90 s: no heartbeat could be written, so the nodes' silence
    counts from its return, and a node is lost only if it stays silent past that."""
    settings.LLMGW_UNREACHABLE_AFTER = 15
    settings.LLMGW_LOST_AFTER = 60
    issue_node("n1", last_heartbeat_at=NOW, health=Node.Health.READY)
    back = NOW + timedelta(seconds=90)
    assert health.refresh_node_health(back + timedelta(seconds=1), heard_from=back) == []
    assert health.refresh_node_health(back + timedelta(seconds=14), heard_from=back) == []
    changes = health.refresh_node_health(back + timedelta(seconds=16), heard_from=back)
    assert [(c.name, c.new) for c in changes] == [("n1", "unreachable")]
    changes = health.refresh_node_health(back + timedelta(seconds=61), heard_from=back)
    assert [(c.name, c.new) for c in changes] == [("n1", "lost")]


@db
def test_a_heartbeat_brings_a_late_node_back_to_ready() -> None:
    node, _ = issue_node("n1", health=Node.Health.UNREACHABLE, last_heartbeat_at=NOW)
    agent_reports.record_heartbeat(node.pk)
    node.refresh_from_db()
    assert node.health == "ready"
    assert node.last_heartbeat_at is not None and node.last_heartbeat_at > NOW
    assert Event.objects.filter(message="node ready: heartbeats back").count() == 1
    agent_reports.record_heartbeat(node.pk)
    assert Event.objects.filter(message="node ready: heartbeats back").count() == 1


# --------------------------------------------------------------------------- reports


@db
def test_hello_registers_the_node_and_its_gpus() -> None:
    node, _ = issue_node("n1")
    Gpu.objects.create(node=node, index=5, memory_total_mib=1)  # a device no longer there
    agent_reports.register_hello(node.pk, hello())
    node.refresh_from_db()
    assert (node.health, node.addresses, node.agent_version) == ("ready", ["10.0.0.7"], "0.1.0")
    assert (node.port_min, node.port_max, node.boot_id) == (20000, 20099, "boot-1")
    gpus = list(node.gpus.values_list("index", "uuid", "memory_total_mib", "memory_used_mib"))
    assert gpus == [(0, "GPU-0", 81920, 10), (1, "GPU-1", 81920, 20)]
    agent_reports.register_hello(node.pk, hello(boot_id="boot-2", gpus=hello().gpus[:1]))
    assert list(node.gpus.values_list("index", flat=True)) == [0]
    assert Event.objects.filter(message__startswith="node agent restarted").exists()


@db
def test_a_report_sent_again_writes_no_second_event(settings: Any) -> None:
    """A reconnecting agent re-sends every shard and its weights outcomes: nothing new
    happened, so nothing new is written to the audit log."""
    node, _ = issue_node("n1")
    shard = shard_on(node)
    failed = report(shard, ShardState.FAILED, exit_code=70, failure_class=FailureClass.CRASH)
    refused = agent_reports.NodeReport(
        weights=(WeightsReport("org/m", WeightsState.REFUSED, "in use by shard(s) 1"),),
        stale_rejected=1,
    )
    before = Event.objects.count()
    for _ in range(3):
        agent_reports.record_status(node.pk, [failed], refused)
    kinds = list(Event.objects.order_by("pk").values_list("message", flat=True)[before:])
    assert len(kinds) == 3, kinds  # the failure, the weights refusal, the stale count: once
    worse = agent_reports.NodeReport(stale_rejected=2)
    agent_reports.record_status(node.pk, [], worse)
    assert Event.objects.count() == before + 4  # a change is recorded


@db
def test_one_node_cannot_write_more_than_its_cap_of_events_a_minute(settings: Any) -> None:
    settings.LLMGW_NODE_EVENTS_PER_MINUTE = 5
    issue_node("n1")
    issue_node("n2")
    now = timezone.now()
    written = [
        agent_reports.agent_event(
            "n1", now, kind=Event.Kind.NODE, subject="node/n1", message=f"event {i}"
        )
        for i in range(50)
    ]
    assert written == [True] * 5 + [False] * 45
    mine = Event.objects.filter(data__reported_by="n1")
    assert mine.count() == 6  # five, and one saying the rest are dropped
    assert mine.filter(message__contains="further events are dropped").count() == 1
    # Another node is not affected, and a minute later n1 may write again.
    assert agent_reports.agent_event(
        "n2", now, kind=Event.Kind.NODE, subject="node/n2", message="fine"
    )
    later = now + timedelta(minutes=1, seconds=1)
    assert agent_reports.agent_event(
        "n1", later, kind=Event.Kind.NODE, subject="node/n1", message="again"
    )


@db
def test_status_updates_shards_and_their_replica() -> None:
    node, _ = issue_node("n1")
    other, _ = issue_node("n2")
    shard = shard_on(node)
    foreign = shard_on(other, port=20002)
    agent_reports.record_status(
        node.pk, [report(shard, ShardState.STARTING)], agent_reports.NodeReport()
    )
    assert Replica.objects.get(pk=shard.replica_id).observed == "starting"
    agent_reports.record_status(
        node.pk,
        [report(shard, ShardState.READY, requests_running=2, requests_waiting=1)],
        agent_reports.NodeReport(observed_revision=4, stale_rejected=0),
    )
    shard.refresh_from_db()
    replica = Replica.objects.get(pk=shard.replica_id)
    assert (shard.observed, shard.requests_running, shard.requests_waiting) == ("ready", 2, 1)
    assert replica.observed == "ready" and replica.ready_at is not None
    assert Node.objects.get(pk=node.pk).observed_revision == 4

    failed = report(
        shard,
        ShardState.FAILED,
        exit_code=-9,
        failure_class=FailureClass.OOM,
        message="killed by SIGKILL while it should run",
        log_tail=("loading", "CUDA out of memory"),
    )
    agent_reports.record_status(node.pk, [failed], agent_reports.NodeReport())
    shard.refresh_from_db()
    replica.refresh_from_db()
    assert (shard.observed, shard.exit_code, shard.failure_class) == ("failed", -9, "oom")
    assert shard.last_log == "loading\nCUDA out of memory"
    assert (replica.observed, replica.failure_class, replica.failures) == ("failed", "oom", 1)
    assert Event.objects.filter(subject=f"replica/{replica.pk}", message__contains="oom").exists()

    # A late report about an older generation, or about another node's shard, changes nothing.
    Replica.objects.filter(pk=replica.pk).update(generation=2, observed="pending")
    late = report(shard, ShardState.READY, generation=1)
    agent_reports.record_status(node.pk, [late], agent_reports.NodeReport())
    agent_reports.record_status(
        node.pk, [report(foreign, ShardState.FAILED)], agent_reports.NodeReport()
    )
    assert Replica.objects.get(pk=replica.pk).observed == "pending"
    assert Shard.objects.get(pk=foreign.pk).observed == "pending"


@db
def test_weights_refusals_and_stale_epochs_are_recorded_on_the_node() -> None:
    node, _ = issue_node("n1")
    refused = WeightsReport("org/m", WeightsState.REFUSED, "refused: in use by shard(s) 3")
    agent_reports.record_status(
        node.pk, [], agent_reports.NodeReport(weights=(refused,), stale_rejected=2)
    )
    node.refresh_from_db()
    assert node.weights_report == [refused.to_dict()]
    assert node.stale_desired_rejected == 2
    messages = list(Event.objects.values_list("message", flat=True))
    assert "weights org/m refused: refused: in use by shard(s) 3" in messages
    assert any("deposed leader" in m for m in messages)


# --------------------------------------------------------------------------- desired state


@db
def test_the_desired_state_is_read_in_full_from_the_database(settings: Any) -> None:
    settings.LLMGW_DRAIN_TIMEOUT = 42.0
    node, _ = issue_node("n1", remove_weights=["org/old"])
    running = shard_on(node, port=20001)
    draining = shard_on(node, port=20002, model="m2", desired="draining")
    stopping = shard_on(node, port=20003, model="m3", desired="stopped")
    Shard.objects.filter(pk=stopping.pk).update(observed="ready")
    done = shard_on(node, port=20004, model="m4", desired="stopped")
    Shard.objects.filter(pk=done.pk).update(observed="stopped")
    shard_on(issue_node("n2")[0], port=20005, model="elsewhere")

    state = desired_state.build_desired_state(node.pk)
    assert (state.node, state.epoch, state.remove_weights) == ("n1", 0, ("org/old",))
    by_id = {s.shard_id: s for s in state.shards}
    assert set(by_id) == {running.pk, draining.pk, stopping.pk}  # done: nothing to stop
    shard = by_id[running.pk]
    assert shard.state is DesiredShardState.RUNNING
    assert (shard.model, shard.source, shard.port, shard.gpu_indices) == (
        "tiny",
        "org/tiny",
        20001,
        (0,),
    )
    assert shard.args == ("--x", "{port}")  # the template travels; the agent fills it
    assert shard.drain_timeout_s == 42.0
    assert by_id[draining.pk].state is DesiredShardState.DRAINING
    assert by_id[stopping.pk].state is DesiredShardState.STOPPED


@db
def test_the_desired_state_carries_the_leaders_epoch(election_on: Any) -> None:
    node, _ = issue_node("n1")
    assert desired_state.build_desired_state(node.pk).epoch == 0  # nobody ever led
    Lease.objects.create(name="reconciler", owner="x", epoch=7, expires_at_ms=0)
    assert desired_state.build_desired_state(node.pk).epoch == 7


@db
def test_a_multi_node_shard_learns_where_its_head_is() -> None:
    head_node, _ = issue_node("head", addresses=["10.0.0.1"])
    worker_node, _ = issue_node("worker", addresses=["10.0.0.2"])
    profile = Profile.objects.create(name="mn", engine="sglang", shards_per_replica=2)
    served = ServedModel.objects.create(name="big", source="org/big", default_profile=profile)
    replica = Replica.objects.create(model=served, profile=profile)
    Shard.objects.create(replica=replica, node=head_node, rank=0, port=20010)
    Shard.objects.create(replica=replica, node=worker_node, rank=1, port=20011)
    (shard,) = desired_state.build_desired_state(worker_node.pk).shards
    assert (shard.rank, shard.world_size, shard.head_address, shard.head_port) == (
        1,
        2,
        "10.0.0.1",
        20010,
    )


@committed
def test_a_nudge_bumps_the_revision_and_reaches_the_node_after_commit() -> None:
    node, _ = issue_node("n1")
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(nudges.node_group(node.pk), channel)
    with transaction.atomic():
        nudges.nudge_node(node.pk)
        assert Node.objects.get(pk=node.pk).desired_revision == 1
    message = async_to_sync(layer.receive)(channel)
    assert message == {"type": nudges.DESIRED_CHANGED}
    with pytest.raises(RuntimeError), transaction.atomic():
        nudges.nudge_node(node.pk)
        raise RuntimeError("rolled back")
    assert Node.objects.get(pk=node.pk).desired_revision == 1  # nothing sent, nothing bumped


@committed
def test_nudges_of_a_batch_leave_when_it_ends_once_per_node() -> None:
    node, _ = issue_node("n1")
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(nudges.node_group(node.pk), channel)

    async def waiting() -> int:
        return int(layer.channels[channel].qsize()) if channel in layer.channels else 0

    with nudges.batched():
        for _ in range(3):
            with transaction.atomic():
                nudges.nudge_node(node.pk)
        assert async_to_sync(waiting)() == 0  # committed, kept for the end of the batch
        with pytest.raises(RuntimeError), transaction.atomic():
            nudges.nudge_node(node.pk)
            raise RuntimeError("rolled back")
    assert Node.objects.get(pk=node.pk).desired_revision == 3
    assert async_to_sync(waiting)() == 1
    assert async_to_sync(layer.receive)(channel) == {"type": nudges.DESIRED_CHANGED}


@committed
def test_a_nudge_through_a_dead_channel_layer_fails_nobody(settings: Any) -> None:
    """The change is committed and the revision bumped; the periodic resync delivers it."""
    settings.CHANNEL_LAYERS = {"default": redis_channel_layer("redis://127.0.0.1:1")}
    node, _ = issue_node("n1")
    with transaction.atomic():
        nudges.nudge_node(node.pk)
    assert Node.objects.get(pk=node.pk).desired_revision == 1


# --------------------------------------------------------------------------- the session


class FakeTransport:
    def __init__(self) -> None:
        self.sent: list[str] = []
        self.closed: tuple[int, str] | None = None

    async def send_text(self, text: str) -> None:
        self.sent.append(text)

    async def close(self, code: int, reason: str) -> None:
        self.closed = (code, reason)


@committed
async def test_the_session_coalesces_heartbeats_into_few_writes(
    fake_clock: FakeClock, settings: Any
) -> None:
    settings.LLMGW_UNREACHABLE_AFTER = 15  # marks at most every 5s
    node, _ = await database_sync_to_async(issue_node)("n1")
    identity = node_tokens.NodeIdentity(node.pk, "n1")
    transport = FakeTransport()
    writer = HeartbeatWriter(interval=3600)  # flushed by hand below
    session = AgentSession(identity, transport, clock=fake_clock, heartbeats=writer)
    await session.receive(encode(hello()))
    first = (await Node.objects.aget(pk=node.pk)).last_heartbeat_at
    for _ in range(50):
        fake_clock.advance(0.05)
        await session.receive(encode(Heartbeat()))
    assert await writer.flush() == 0
    assert (await Node.objects.aget(pk=node.pk)).last_heartbeat_at == first  # 2.5s: no write
    fake_clock.advance(3)
    await session.receive(encode(Heartbeat()))
    assert (await Node.objects.aget(pk=node.pk)).last_heartbeat_at == first  # marked, not yet
    assert await writer.flush() == 1
    second = (await Node.objects.aget(pk=node.pk)).last_heartbeat_at
    assert second is not None and first is not None and second > first
    await session.receive(encode(Status(observed_revision=0, observed_epoch=0)))
    assert await writer.flush() == 0
    assert (await Node.objects.aget(pk=node.pk)).last_heartbeat_at == second
    assert transport.closed is None


@committed
async def test_one_write_brings_the_heartbeats_of_many_streams(
    fake_clock: FakeClock, settings: Any
) -> None:
    settings.LLMGW_UNREACHABLE_AFTER = 15
    writer = HeartbeatWriter(interval=3600)
    sessions = []
    for name in ("n1", "n2", "n3"):
        node, _ = await database_sync_to_async(issue_node)(name)
        await Node.objects.filter(pk=node.pk).aupdate(health=Node.Health.UNREACHABLE)
        identity = node_tokens.NodeIdentity(node.pk, name)
        session = AgentSession(identity, FakeTransport(), clock=fake_clock, heartbeats=writer)
        await session.receive(encode(hello(name)))
        sessions.append(session)
    # hello made them ready; two of them go quiet past the threshold, then all beat again
    await Node.objects.filter(name__in=["n1", "n2"]).aupdate(health=Node.Health.UNREACHABLE)
    fake_clock.advance(6)
    for session in sessions:
        await session.receive(encode(Heartbeat()))
    assert await writer.flush() == 3
    assert writer.writes == 1
    healths = {n.name: n.health async for n in Node.objects.all()}
    assert healths == {"n1": "ready", "n2": "ready", "n3": "ready"}
    back = [e.subject async for e in Event.objects.filter(message="node ready: heartbeats back")]
    assert sorted(back) == ["node/n1", "node/n2"]


@committed
async def test_a_load_change_between_beats_is_written_at_the_next_beat(
    fake_clock: FakeClock, settings: Any
) -> None:
    """Engine load is written coalesced, never lost: a replica whose engine reported
    "one running" and then "none" must not stay busy in the store."""
    settings.LLMGW_UNREACHABLE_AFTER = 15  # beats at most every 5s
    node, _ = await database_sync_to_async(issue_node)("n1")
    shard = await database_sync_to_async(shard_on)(node)
    session = AgentSession(
        node_tokens.NodeIdentity(node.pk, "n1"), FakeTransport(), clock=fake_clock
    )
    await session.receive(encode(hello()))

    def status(running: int) -> str:
        ready = report(shard, ShardState.READY, requests_running=running)
        return encode(Status(observed_revision=0, observed_epoch=0, shards=(ready,)))

    fake_clock.advance(6)
    await session.receive(status(1))  # a beat: written
    assert (await Shard.objects.aget(pk=shard.pk)).requests_running == 1
    fake_clock.advance(1)
    await session.receive(status(0))  # between beats: not written yet
    assert (await Shard.objects.aget(pk=shard.pk)).requests_running == 1
    fake_clock.advance(1)
    await session.receive(status(0))
    fake_clock.advance(5)
    await session.receive(status(0))  # the next beat writes what changed meanwhile
    assert (await Shard.objects.aget(pk=shard.pk)).requests_running == 0


@committed
async def test_an_engines_cache_size_reaches_its_shard_and_an_older_agents_report_leaves_none(
    fake_clock: FakeClock,
) -> None:
    node, _ = await database_sync_to_async(issue_node)("n1")
    shard = await database_sync_to_async(shard_on)(node)
    old = await database_sync_to_async(shard_on)(node, port=20002, model="other")
    session = AgentSession(
        node_tokens.NodeIdentity(node.pk, "n1"), FakeTransport(), clock=fake_clock
    )
    await session.receive(encode(hello()))
    body = json.loads(
        encode(
            Status(
                observed_revision=0,
                observed_epoch=0,
                shards=(
                    report(shard, ShardState.READY, requests_running=0, cache_tokens=131072),
                    report(old, ShardState.READY, requests_running=0),
                ),
            )
        )
    )
    del body["shards"][1]["cache_tokens"]  # as an agent from before the field sends it
    await session.receive(json.dumps(body))
    assert (await Shard.objects.aget(pk=shard.pk)).cache_tokens == 131072
    older = await Shard.objects.aget(pk=old.pk)
    assert (older.observed, older.cache_tokens) == ("ready", None)


@committed
async def test_the_session_resyncs_the_full_desired_state_periodically(
    fake_clock: FakeClock, settings: Any
) -> None:
    settings.LLMGW_AGENT_RESYNC_INTERVAL = 10
    settings.LLMGW_AGENT_REVISION_POLL = 0  # nudges come through the channel layer
    node, token = await database_sync_to_async(issue_node)("n1")
    transport = FakeTransport()
    identity = await database_sync_to_async(node_tokens.authenticate)(token, "n1")
    session = AgentSession(identity, transport, clock=fake_clock)
    await session.tick()
    assert transport.sent == []  # nothing before hello
    await session.receive(encode(hello()))
    kinds = [json.loads(t)["type"] for t in transport.sent]
    assert kinds == ["welcome", "desired"]
    fake_clock.advance(9)
    await session.tick()
    assert len(transport.sent) == 2
    # A resync whose revision did not move sends nothing...
    fake_clock.advance(1)
    await session.tick()
    assert len(transport.sent) == 2
    # ...one that finds a change (a nudge lost on the way) sends the full state...
    await Node.objects.filter(pk=node.pk).aupdate(desired_revision=5)
    fake_clock.advance(10)
    await session.tick()
    assert len(transport.sent) == 3 and json.loads(transport.sent[-1])["revision"] == 5
    # ...and every FULL_RESYNC_EVERY-th resync sends it regardless.
    for _ in range(FULL_RESYNC_EVERY):
        fake_clock.advance(10)
        await session.tick()
    assert len(transport.sent) == 4 and json.loads(transport.sent[-1])["type"] == "desired"


@committed
async def test_a_revoked_token_ends_the_open_stream_at_the_next_resync_without_any_nudge(
    fake_clock: FakeClock, settings: Any
) -> None:
    """Revocation bites on every process: the session re-checks its credential against the
    store at each resync, so no channel layer is needed to carry the news."""
    settings.LLMGW_AGENT_RESYNC_INTERVAL = 10
    settings.CHANNEL_LAYERS = {}  # nothing could deliver a nudge
    _, token = await database_sync_to_async(issue_node)("n1")
    identity = await database_sync_to_async(node_tokens.authenticate)(token, "n1")
    transport = FakeTransport()
    session = AgentSession(identity, transport, clock=fake_clock)
    await session.receive(encode(hello()))
    assert await database_sync_to_async(node_tokens.revoke_node_token)("n1")
    fake_clock.advance(9)
    await session.tick()
    assert transport.closed is None  # not before the resync is due
    fake_clock.advance(1)
    await session.tick()
    assert transport.closed is not None and transport.closed[0] == CloseCode.UNAUTHORIZED
    assert "revoked" in json.loads(transport.sent[-1])["message"]


@committed
async def test_the_resyncs_of_many_streams_read_their_nodes_in_one_query(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A thousand streams each re-check their credential and revision every interval: their
    reads within a window share one query, and each gets its own node's row (none for a node
    that is gone); a failed read fails every reader, as its own read would have."""
    nodes = [(await database_sync_to_async(issue_node)(f"n{i}"))[0] for i in range(5)]
    await Node.objects.filter(pk=nodes[2].pk).aupdate(desired_revision=7)
    queries: list[list[int]] = []

    def counted(node_ids: list[int]) -> dict[int, Any]:
        queries.append(sorted(node_ids))
        return read_node_rows(node_ids)

    monkeypatch.setattr("control.agent_plumbing.read_node_rows", counted)
    reader = NodeRowReader()
    gone = max(n.pk for n in nodes) + 1000
    rows = await asyncio.gather(*(reader.read(n.pk) for n in [*nodes, nodes[2]]), reader.read(gone))
    assert queries == [sorted({n.pk for n in nodes} | {gone})]
    assert [r.desired_revision if r else None for r in rows] == [0, 0, 7, 0, 0, 7, None]
    stored = await Node.objects.aget(pk=nodes[1].pk)
    assert rows[1] is not None and rows[1].token_hash == stored.token_hash

    def broken(node_ids: list[int]) -> dict[int, Any]:
        raise OperationalError("the store is down")

    monkeypatch.setattr("control.agent_plumbing.read_node_rows", broken)
    outcomes = await asyncio.gather(
        reader.read(nodes[0].pk), reader.read(nodes[1].pk), return_exceptions=True
    )
    assert all(isinstance(o, OperationalError) for o in outcomes)


@committed
async def test_a_stream_that_sends_too_fast_is_closed_with_the_rate_limit_code(
    settings: Any,
) -> None:
    settings.LLMGW_AGENT_MESSAGES_PER_SECOND = 1
    settings.LLMGW_AGENT_MESSAGE_BURST = 20
    _, token = await database_sync_to_async(issue_node)("n1")
    identity = await database_sync_to_async(node_tokens.authenticate)(token, "n1")
    transport = FakeTransport()
    frozen = FakeClock()
    session = AgentSession(identity, transport, clock=frozen)
    await session.receive(encode(hello()))
    for seq in range(19):  # the burst, hello included
        await session.receive(encode(Heartbeat(seq=seq)))
    assert transport.closed is None
    await session.receive(encode(Heartbeat(seq=99)))
    assert transport.closed is not None and transport.closed[0] == CloseCode.RATE_LIMITED
    assert "messages a second" in json.loads(transport.sent[-1])["message"]


@committed
async def test_a_node_deleted_after_its_handshake_is_refused_at_hello() -> None:
    node, _ = await database_sync_to_async(issue_node)("n1")
    await Node.objects.filter(pk=node.pk).adelete()
    transport = FakeTransport()
    session = AgentSession(node_tokens.NodeIdentity(node.pk, "n1"), transport)
    await session.receive(encode(hello()))
    assert transport.closed is not None and transport.closed[0] == CloseCode.UNAUTHORIZED
    assert json.loads(transport.sent[-1])["message"] == "this node no longer exists"


async def test_a_session_without_hello_is_closed_after_the_deadline(
    fake_clock: FakeClock,
) -> None:
    transport = FakeTransport()
    session = AgentSession(node_tokens.NodeIdentity(1, "n1"), transport, clock=fake_clock)
    fake_clock.advance(10)
    await session.tick()
    assert transport.closed is not None and transport.closed[0] == CloseCode.HELLO_TIMEOUT


# --------------------------------------------------------------------------- the consumer


APP = URLRouter(websocket_urlpatterns)


def communicator(
    token: str | None, node: str | None = "n1", *, peer: tuple[str, int] | None = None
) -> WebsocketCommunicator:
    """A stream to the consumer; ``peer``: the address it comes from, as the server's scope
    names it (``client``)."""
    headers = []
    if token is not None:
        headers.append((b"authorization", f"Bearer {token}".encode()))
    if node is not None:
        headers.append((NODE_HEADER.lower().encode(), node.encode()))
    comm = WebsocketCommunicator(APP, "/agents/stream", headers=headers)
    if peer is not None:
        comm.scope["client"] = peer  # read when the application starts, at connect
    return comm


@pytest.fixture
async def token() -> AsyncIterator[str]:
    _, issued = await database_sync_to_async(issue_node)("n1")
    await database_sync_to_async(issue_node)("n2")
    yield issued


@committed
async def test_the_stream_refuses_handshakes_without_a_valid_token(token: str) -> None:
    other = await database_sync_to_async(node_tokens.issue_node_token)("n2")
    for bearer, claimed in [
        (None, "n1"),
        ("llmgw_node_wrong", "n1"),
        (other, "n1"),  # node n2's token claiming n1
        (token, "n2"),
    ]:
        comm = communicator(bearer, claimed)
        connected, code = await comm.connect(timeout=CONNECT_TIMEOUT)
        assert (connected, code) == (False, CloseCode.UNAUTHORIZED)
    comm = WebsocketCommunicator(APP, "/somewhere/else")
    assert (await comm.connect(timeout=CONNECT_TIMEOUT))[0] is False


@committed
async def test_with_identity_required_a_websocket_stream_with_a_valid_token_is_refused(
    token: str, settings: Any
) -> None:
    """LLMGW_AGENT_REQUIRE_IDENTITY: a node's identity is its certificate, so a node token
    opens no stream on any transport; over WebSocket it is refused at the handshake (4403),
    before any hello reaches the store. Off, the same token is served (as before)."""
    settings.LLMGW_AGENT_REQUIRE_IDENTITY = True
    comm = communicator(token)
    assert await comm.connect(timeout=CONNECT_TIMEOUT) == (False, CloseCode.FORBIDDEN)
    assert (await Node.objects.aget(name="n1")).last_heartbeat_at is None
    settings.LLMGW_AGENT_REQUIRE_IDENTITY = False
    await (await _open(token)).disconnect()
    assert (await Node.objects.aget(name="n1")).last_heartbeat_at is not None


async def _open(token: str) -> WebsocketCommunicator:
    comm = communicator(token)
    connected, _ = await comm.connect(timeout=CONNECT_TIMEOUT)
    assert connected
    await comm.send_to(text_data=encode(hello()))
    assert decode_server_message(await comm.receive_from()).TYPE == "welcome"
    assert decode_server_message(await comm.receive_from()).TYPE == "desired"
    return comm


class StubbornLayer(InMemoryChannelLayer):  # type: ignore[misc]
    """A channel layer whose receive goes on after its first cancellation, as channels_redis's
    was seen to: the web process holding such a stream then waited out its whole stop grace."""

    async def receive(self, channel: str) -> dict[str, Any]:
        message: dict[str, Any]
        try:
            message = await super().receive(channel)
        except asyncio.CancelledError:
            message = await super().receive(channel)
        return message


@committed
async def test_a_stream_ends_with_its_agent_even_if_the_layers_receive_ignores_the_cancel(
    token: str, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": f"{__name__}.StubbornLayer"}}
    monkeypatch.setattr(consumers, "RECEIVE_CANCEL_WAIT_S", 0.05)
    comm = await _open(token)
    await comm.send_input({"type": "websocket.disconnect", "code": 1000})  # the agent hangs up
    # Waited for, not cancelled: the stream's task must end by itself (it never did).
    done, _ = await asyncio.wait({comm.future}, timeout=10)
    assert done, "the stream's task still runs 10 s after its agent hung up"
    assert comm.future.exception() is None


async def _closed_with(comm: WebsocketCommunicator) -> tuple[int, str]:
    error = json.loads(await comm.receive_from())
    assert error["type"] == "error"
    close = await comm.receive_output()
    assert close["type"] == "websocket.close"
    assert close["code"] == error["code"]
    return int(close["code"]), str(error["message"])


@committed
async def test_hello_is_answered_with_welcome_and_the_full_desired_state(
    token: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    hops: list[str] = []

    async def close_old_connections() -> None:
        hops.append("a hop to the sync thread")

    monkeypatch.setattr("channels.consumer.aclose_old_connections", close_old_connections)
    node = await Node.objects.aget(name="n1")
    shard = await database_sync_to_async(shard_on)(node)
    comm = communicator(token)
    assert (await comm.connect(timeout=CONNECT_TIMEOUT))[0]
    await comm.send_to(text_data=encode(hello()))
    welcome = decode_server_message(await comm.receive_from())
    assert welcome.TYPE == "welcome" and welcome.heartbeat_interval > 0  # type: ignore[union-attr]
    desired = decode_server_message(await comm.receive_from())
    assert [s.shard_id for s in desired.shards] == [shard.pk]  # type: ignore[union-attr]
    node = await Node.objects.aget(name="n1")
    assert node.health == "ready" and await node.gpus.acount() == 2

    # A status lands on the shard; a nudge brings the changed desired state at once.
    await comm.send_to(text_data=encode(Status(1, 0, shards=(report(shard, ShardState.READY),))))
    await database_sync_to_async(_set_desired)(shard.replica_id, "draining", node.pk)
    desired = decode_server_message(await comm.receive_from())
    assert desired.shards[0].state is DesiredShardState.DRAINING  # type: ignore[union-attr]
    assert desired.revision == 1  # type: ignore[union-attr]
    assert (await Shard.objects.aget(pk=shard.pk)).observed == "ready"
    await comm.disconnect()
    # Frames and nudges reached the session without Channels' per-message hop to the one sync
    # thread: the stream's store work runs on the session's own executors.
    assert hops == []


def _set_desired(replica_id: int, desired: str, node_id: int) -> None:
    with transaction.atomic():
        Replica.objects.filter(pk=replica_id).update(desired=desired)
        nudges.nudge_node(node_id)


@committed
@pytest.mark.parametrize(
    ("frame", "code", "words"),
    [
        ("{not json", CloseCode.MALFORMED, "not JSON"),
        (json.dumps({"type": "hello", "v": 99}), CloseCode.PROTOCOL_VERSION, "version 99"),
        (encode(Heartbeat()), CloseCode.MALFORMED, "expected hello first"),
        (encode(hello("n2")), CloseCode.FORBIDDEN, "authenticated as node 'n1', not 'n2'"),
        (b"\x00\x01", CloseCode.UNSUPPORTED_DATA, "binary frames"),
        ("x" * (MAX_MESSAGE_BYTES + 1), CloseCode.TOO_BIG, "larger than"),
    ],
)
async def test_bad_frames_are_answered_with_an_error_and_a_close_code(
    token: str, frame: str | bytes, code: CloseCode, words: str
) -> None:
    comm = communicator(token)
    assert (await comm.connect(timeout=CONNECT_TIMEOUT))[0]
    if isinstance(frame, bytes):
        await comm.send_to(bytes_data=frame)
    else:
        await comm.send_to(text_data=frame)
    closed, message = await _closed_with(comm)
    assert closed == code
    assert words in message


@committed
async def test_a_second_hello_on_one_stream_is_refused(token: str) -> None:
    comm = await _open(token)
    await comm.send_to(text_data=encode(hello()))
    code, message = await _closed_with(comm)
    assert (code, message) == (CloseCode.MALFORMED, "hello sent twice on one stream")


@committed
async def test_revoking_a_token_closes_its_open_stream(token: str) -> None:
    comm = await _open(token)
    assert await database_sync_to_async(node_tokens.revoke_node_token)("n1")
    code, message = await _closed_with(comm)
    assert (code, message) == (CloseCode.UNAUTHORIZED, "this node's token was revoked")


def _serving(shard_id: int) -> None:
    """The shard's replica ready and meant to run: what the gateway routes to."""
    shard = Shard.objects.get(pk=shard_id)
    Shard.objects.filter(pk=shard_id).update(observed=Replica.Observed.READY)
    Replica.objects.filter(pk=shard.replica_id).update(
        observed=Replica.Observed.READY, desired=Replica.Desired.RUNNING
    )


@committed
async def test_a_node_whose_stream_is_not_over_loopback_gets_no_traffic_at_a_loopback_address(
    token: str,
) -> None:
    """A remote node cannot point the gateway at the gateway host's own loopback: only the
    agent whose stream itself comes over loopback (the local agent) may advertise it."""
    node = await Node.objects.aget(name="n1")
    shard = await database_sync_to_async(shard_on)(node)
    comm = communicator(token, peer=("10.9.8.7", 40000))
    assert (await comm.connect(timeout=CONNECT_TIMEOUT))[0]
    await comm.send_to(text_data=encode(hello(addresses=("127.0.0.1",))))
    answer = decode_server_message(await comm.receive_from())
    await database_sync_to_async(_serving)(shard.pk)
    snapshot = await database_sync_to_async(serving.routing_snapshot)()
    assert [(r.id, r.host) for r in snapshot.replicas] == []
    assert isinstance(answer, ErrorMessage) and answer.code == CloseCode.FORBIDDEN
    assert "127.0.0.1" in answer.message and "loopback" in answer.message
    assert "10.9.8.7" in answer.message
    close = await comm.receive_output()
    assert (close["type"], close["code"]) == ("websocket.close", CloseCode.FORBIDDEN)
    node = await Node.objects.aget(name="n1")
    assert node.addresses == [] and not node.connected_over_loopback  # nothing registered


@committed
async def test_the_local_agent_over_loopback_is_routed_at_its_loopback_address(
    token: str,
) -> None:
    node = await Node.objects.aget(name="n1")
    shard = await database_sync_to_async(shard_on)(node)
    comm = communicator(token, peer=("127.0.0.1", 40000))
    assert (await comm.connect(timeout=CONNECT_TIMEOUT))[0]
    await comm.send_to(text_data=encode(hello(addresses=("127.0.0.1",))))
    assert decode_server_message(await comm.receive_from()).TYPE == "welcome"
    await database_sync_to_async(_serving)(shard.pk)
    snapshot = await database_sync_to_async(serving.routing_snapshot)()
    assert [(r.id, r.host) for r in snapshot.replicas] == [(shard.replica_id, "127.0.0.1")]
    assert (await Node.objects.aget(name="n1")).connected_over_loopback
    await comm.disconnect()


def test_where_a_stream_comes_from_and_what_it_may_advertise(settings: Any) -> None:
    assert agent_peers.grpc_peer("ipv4:127.0.0.1:50211") == "127.0.0.1"
    assert agent_peers.grpc_peer("ipv6:[::1]:50211") == "::1"
    assert agent_peers.grpc_peer("ipv6:%5B::1%5D:50211") == "::1"
    assert agent_peers.grpc_peer("ipv4:10.0.0.9:4000") == "10.0.0.9"
    assert agent_peers.grpc_peer("unix:/run/llmgw.sock") == ""
    assert agent_peers.grpc_peer(None) == ""
    for peer, local in [("127.0.0.1", True), ("127.9.9.9", True), ("::1", True),
                        ("::ffff:127.0.0.1", True), ("10.0.0.9", False), ("", False)]:  # fmt: skip
        assert agent_peers.over_loopback(peer) is local, peer
    for address in ("127.0.0.1", "127.1.2.3", "::1", "localhost", "Engine.LOCALHOST."):
        assert agent_peers.loopback_refusal(["10.0.0.5", address], "10.0.0.9"), address
        assert agent_peers.loopback_refusal([address], "127.0.0.1") is None, address
    assert agent_peers.loopback_refusal(["10.0.0.5", "gpu-7.internal"], "10.0.0.9") is None
    # Behind a proxy on this host every stream comes from loopback; the header it appends says
    # where from (its rightmost entry: those to its left are the client's own word).
    scope = {
        "client": ("127.0.0.1", 5000),
        "headers": [(b"x-forwarded-for", b"127.0.0.1, 10.0.0.9")],
    }
    assert agent_peers.websocket_peer(scope) == "127.0.0.1"
    settings.LLMGW_CLIENT_IP_HEADER = "X-Forwarded-For"
    assert agent_peers.websocket_peer(scope) == "10.0.0.9"
    assert agent_peers.websocket_peer({"client": ("127.0.0.1", 5000)}) == "127.0.0.1"
    assert agent_peers.websocket_peer({}) == ""


@committed
async def test_a_newer_stream_of_a_node_closes_the_older_one(token: str) -> None:
    old = await _open(token)
    new = await _open(token)
    code, _ = await _closed_with(old)
    assert code == CloseCode.REPLACED
    await new.send_to(text_data=encode(Heartbeat(seq=1)))
    # The newer stream goes on working: what it reports next reaches the store.
    await new.send_to(text_data=encode(Status(observed_revision=7, observed_epoch=0)))
    await await_until(
        lambda: Node.objects.filter(name="n1", observed_revision=7).aexists(),
        what="the newer stream's report stored",
    )
    assert await new.receive_nothing(timeout=0)
    await new.disconnect()


def test_protocol_version_is_one() -> None:
    # A change of version is a deliberate act: both sides and this test move together.
    assert PROTOCOL_VERSION == 1
