"""End to end, with real processes: control planes (each a web process, a Celery worker and a
beat) on PostgreSQL and a private Redis, agents with simulated GPUs running real ``sim``
engines. Scenario codes (L2, C1...) are those of docs/scenarios.md.

An invariant checker reads the store and the live engine processes throughout: no GPU is ever
given to two shards, no model ever exceeds its replica count. Ticks are observed as Celery's
own task events (the workers run with ``-E``) and the broker's queue, the lease and every
write through the store: nothing here reads a log line or holds a stopwatch. How long a
failover takes is measured by ``make bench``, not asserted here.

Each test builds the cluster its scenarios need (two control planes and three agents; two
planes whose store connections can be cut; one plane whose ticks are counted): the faults are
destructive, so the three do not share one.
"""

from __future__ import annotations

import itertools
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from django.db import connection
from django.utils import timezone

from control.models import Replica, ServedModel
from tests.harness.cluster import (
    Cluster,
    ControlPlane,
    InvariantChecker,
    TaskEvents,
    leader_worker,
    lease_state,
    node_health,
    queued_ticks,
    ready_replicas,
    release_stolen_lease,
    shard_nodes,
    steal_lease,
    wait_leader,
    wait_ticks,
    writes_by_epoch_in_commit_order,
)
from tests.harness.factories import make_key, make_model
from tests.harness.procs import engine_processes
from tests.harness.store import execute_now, table_locked
from tests.harness.waits import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e, pytest.mark.timeout(600)]


@pytest.fixture
def postgres_only() -> None:
    if connection.vendor != "postgresql":
        pytest.skip(
            "two control planes share one store only on PostgreSQL; the embedded default "
            "(one control plane) is covered by test_embedded_e2e"
        )


@pytest.fixture
def cluster(tmp_path: Path, postgres_only: None) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path)
    cluster.start_redis()
    try:
        yield cluster
    finally:
        cluster.stop()


def add_model(name: str, *, shards: int = 1, **fields: Any) -> ServedModel:
    return make_model(name, shards=shards, startup_timeout_s=30, **fields)


def start_fleet(cluster: Cluster, planes: int = 2) -> None:
    for _ in range(planes):
        cluster.add_control_plane()
    for name in ("a", "b", "c"):
        cluster.add_agent(name, gpus="3x80GiB")
    wait_until(
        lambda: all(node_health(n) == "ready" for n in ("a", "b", "c")),
        what="three agents to connect",
        logs=cluster.processes(),
    )


def wait_ready(cluster: Cluster, model: str, count: int) -> None:
    wait_until(
        lambda: ready_replicas(model) >= count,
        what=f"{count} ready {model}",
        logs=cluster.processes(),
    )


def epochs_are_monotonic() -> bool:
    epochs = writes_by_epoch_in_commit_order()
    return epochs == sorted(epochs)


def never_two_at_once(events: TaskEvents, plane: ControlPlane) -> bool:
    """Each tick on ``plane`` started after the previous one finished."""
    ended = {e["uuid"]: e["timestamp"] for e in events.of("succeeded", host=plane.name)}
    spans = sorted(
        (e["timestamp"], ended[e["uuid"]])
        for e in events.of("started", host=plane.name)
        if e["uuid"] in ended
    )
    return all(start >= end for (_, end), (start, _) in itertools.pairwise(spans))


def expired_unrun(events: TaskEvents, plane: ControlPlane, after: float) -> int:
    """Ticks ``plane``'s worker discarded after ``after`` because they had expired."""
    return sum(1 for e in events.of("revoked", host=plane.name, after=after) if e.get("expired"))


def test_two_control_planes_place_once_fail_over_and_replace_a_lost_node(cluster: Cluster) -> None:
    """[C1] two beats and two workers place once; scale from zero through the gateway; [L2]
    the leader's worker killed, a standby leads and no old-epoch write lands after a new one;
    [N1] an agent killed, its replicas replaced; [N4] it returns and its duplicates stop."""
    start_fleet(cluster)
    assert cluster.redis is not None
    add_model("steady", min_replicas=2, max_replicas=2, idle_timeout_s=3600)
    add_model("wide", shards=2, min_replicas=1, max_replicas=1, idle_timeout_s=3600)
    add_model("zero", min_replicas=0, max_replicas=1)
    add_model("cold", min_replicas=0, max_replicas=1, args=["--startup-delay", "1"])
    key, _ = make_key("client")
    client = openai.OpenAI(
        base_url=cluster.control_planes[0].url + "/v1", api_key=key, max_retries=0, timeout=120
    )
    checker = InvariantChecker(cluster)
    with checker.running(), TaskEvents(cluster.redis.url).running() as events:
        # [C1] two beats, two workers: placements converge once.
        wait_ready(cluster, "steady", 2)
        wait_ready(cluster, "wide", 1)
        assert len(shard_nodes("wide")) == 2, "a two-node replica spans two nodes"
        placed = time.time()
        for plane in cluster.control_planes:  # both have looked again: nothing more to do
            wait_ticks(events, plane, placed)
        assert Replica.objects.filter(model__name="steady").count() == 2
        assert Replica.objects.filter(model__name="wide").count() == 1

        # Scale from zero through the gateway, with an engine that takes a second to start.
        stream = client.chat.completions.create(
            model="cold", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text.startswith("tok1")
        assert Replica.objects.filter(model__name="cold").count() == 1

        # [L2] kill -9 the leader's worker; a standby leads and places.
        leader = wait_leader(cluster)
        _, old_epoch = lease_state()
        assert leader.worker is not None
        leader.worker.kill()
        ServedModel.objects.filter(name="zero").update(demand_at=timezone.now())
        wait_until(lambda: lease_state()[1] > old_epoch, what="a new leader")
        wait_until(
            lambda: Replica.objects.filter(model__name="zero").exists(),
            what="a placement by the new leader",
            logs=cluster.processes(),
        )
        assert epochs_are_monotonic(), "no write of the old epoch after the new one's first"
        leader.worker.start()

        # [N1] kill -9 an agent: lost, its replicas placed elsewhere.
        victim = sorted(shard_nodes("steady"))[0]
        doomed = set(
            Replica.objects.filter(
                model__name="steady", desired="running", shards__node__name=victim
            ).values_list("pk", flat=True)
        )
        victim_agent = cluster.agents[victim]
        assert victim_agent.proc is not None
        victim_agent.proc.kill()
        # Lost, whether a tick saw it unreachable first or (a tick late on a loaded machine)
        # not: the agents' own tests judge each step (tests/agents/agent_e2e.py).
        wait_until(lambda: node_health(victim) == "lost", what=f"{victim} lost")
        wait_until(
            lambda: ready_replicas("steady") == 2 and victim not in shard_nodes("steady"),
            what="steady replaced on other nodes",
            logs=cluster.processes(),
        )
        assert doomed and set(
            Replica.objects.filter(pk__in=doomed).values_list("desired", flat=True)
        ) == {"stopped"}

        # [N4] the lost node returns: it reports what still runs; the duplicates are stopped.
        old_engines = {pid for pids in victim_agent.engines().values() for pid in pids}
        assert old_engines, "the killed agent's engines outlived it (they run on their own)"
        victim_agent.start()
        wait_until(lambda: node_health(victim) == "ready", what=f"{victim} back")
        wait_until(
            lambda: not ({pid for pid, _ in engine_processes()} & old_engines),
            what="the returning node's duplicate engines to stop",
            logs=cluster.processes(),
        )
        assert ready_replicas("steady") == 2
        assert all(never_two_at_once(events, plane) for plane in cluster.control_planes)

    assert checker.checks > 10
    assert checker.violations == [], checker.violations[:10]


def test_paused_terminated_and_partitioned_leaders_never_write_stale(cluster: Cluster) -> None:
    """[L3] SIGSTOP past the TTL, [L11] SIGTERM, [L5] cut off from the store, [C6] lease lost
    mid-tick: each time the standby takes over and no write of an old epoch lands late."""
    for _ in range(2):
        cluster.add_control_plane(via_proxy=True)
    assert cluster.redis is not None
    cluster.add_agent("a", gpus="4x80GiB")
    wait_until(lambda: node_health("a") == "ready", what="the agent", logs=cluster.processes())
    add_model("m", min_replicas=1, max_replicas=3, idle_timeout_s=3600)
    wait_ready(cluster, "m", 1)
    checker = InvariantChecker(cluster)
    with checker.running(), TaskEvents(cluster.redis.url).running() as events:
        # [L3] pause the leader; the standby leads and places; the resumed one writes nothing.
        leader = wait_leader(cluster)
        assert leader.worker is not None
        paused_owner, paused_epoch = lease_state()
        last_before = Replica.objects.order_by("-pk").values_list("pk", flat=True).first() or 0
        leader.worker.signal(signal.SIGSTOP)
        wait_until(lambda: lease_state()[1] > paused_epoch, what="a takeover during the pause")
        ServedModel.objects.filter(name="m").update(min_replicas=2)  # work for whoever leads
        wait_ready(cluster, "m", 2)  # placed by the new leader while the old one is paused
        resumed = time.time()
        leader.worker.signal(signal.SIGCONT)
        wait_ticks(events, leader, resumed)
        late = Replica.objects.filter(pk__gt=last_before, epoch__lte=paused_epoch)
        assert not late.exists(), "nothing written with the paused leader's epoch"
        assert lease_state()[0] != paused_owner, "the resumed process stays a follower"
        assert Replica.objects.filter(model__name="m", desired="running").count() == 2
        assert epochs_are_monotonic()

        # [L11] SIGTERM the leader: it gives the lease back on its way out. The standby is
        # paused meanwhile, so the row can only say "released" or "still mine".
        leader = wait_leader(cluster)
        standby = next(p for p in cluster.control_planes if p is not leader)
        assert leader.worker is not None and standby.worker is not None
        standby.worker.signal(signal.SIGSTOP)
        try:
            wait_until(lambda: leader_worker(cluster) is leader, what="the leader still leads")
            owner, epoch = lease_state()
            assert leader.worker.stop() == 0
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT owner, epoch, expires_at_ms FROM control_lease WHERE name = %s",
                    ["reconciler"],
                )
                assert cursor.fetchone() == ("", epoch, 0), "released, not left to expire"
        finally:
            standby.worker.signal(signal.SIGCONT)
        wait_until(lambda: lease_state()[1] > epoch, what="the standby to lead")
        assert lease_state()[0] != owner
        leader.worker.start()

        # [L5] the leader's host loses the store; the standby takes over after expiry; back
        # on the network, the old leader stays a follower.
        leader = wait_leader(cluster)
        _, epoch = lease_state()
        assert leader.proxy is not None
        leader.proxy.cut()
        wait_until(lambda: lease_state()[1] > epoch, what="a takeover after the partition")
        new_owner, new_epoch = lease_state()
        restored = time.time()
        leader.proxy.restore()
        wait_ticks(events, leader, restored)
        assert lease_state() == (new_owner, new_epoch), "the returning leader stays a follower"

        # [C6] the lease is lost mid-tick: the tick's remaining writes change nothing.
        # First the fleet settles: during the partition the agent's stream (on the cut-off
        # host) wrote no heartbeat, and on a loaded machine the node may have been declared
        # lost and its replicas replaced; a replacement placed after ``last_id`` below would
        # look like a stale write.
        wait_ready(cluster, "m", 2)
        more = "UPDATE control_servedmodel SET min_replicas = 3, max_replicas = 3 WHERE name='m'"
        for _attempt in range(10):
            leader = wait_leader(cluster)
            last_id = Replica.objects.order_by("-pk").values_list("pk", flat=True).first() or 0
            try:
                with table_locked("control_servedmodel", more):
                    # The leader's tick now waits on the catalog: in its snapshot read, or in a
                    # fenced write that holds the lease row, where no steal can happen until
                    # it ends. Then the lock (and the change) is rolled back and tried again.
                    if wait_until(catalog_waiter, what="a tick waiting on the catalog") == FENCED:
                        raise _TickInsideAFence
                    stolen_epoch = steal_lease()
                break
            except _TickInsideAFence:
                continue
        else:
            pytest.fail("the tick was inside a fenced write each of 10 times")
        released = time.time()
        # The tick reads min 3, wants a replica, and its fenced write is refused.
        wait_until(lambda: tick_ended_since(events, leader, released), what="the stalled tick")
        assert not Replica.objects.filter(pk__gt=last_id, epoch__lt=stolen_epoch).exists()
        release_stolen_lease()
        wait_ready(cluster, "m", 3)
    assert checker.violations == [], checker.violations[:10]


def tick_ended_since(events: TaskEvents, plane: ControlPlane, moment: float) -> bool:
    """A tick of ``plane`` ended (done, or stopped by its time limit) after ``moment``."""
    return any(events.of(kind, host=plane.name, after=moment) for kind in ("succeeded", "failed"))


# A backend of the store waiting for a lock, in the middle of a statement on a given table.
WAITING_ON = (
    "SELECT string_agg(query, ' ') FROM pg_stat_activity "
    "WHERE wait_event_type = 'Lock' AND query LIKE %s"
)
# The same, and whether the waiting transaction holds the lease (a fenced write): NULL when
# none waits.
WAITING_HOLDING_THE_LEASE = (
    "SELECT bool_or(EXISTS (SELECT 1 FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
    "WHERE l.pid = a.pid AND l.granted AND c.relname = 'control_lease')) "
    "FROM pg_stat_activity a WHERE a.wait_event_type = 'Lock' AND a.query LIKE %s"
)
FENCED, UNFENCED = "fenced", "unfenced"


class _TickInsideAFence(Exception):
    pass


def catalog_waiter() -> str | None:
    """FENCED or UNFENCED when a statement waits on the catalog, None while none does."""
    (holds_lease,) = execute_now(WAITING_HOLDING_THE_LEASE, ("%control_servedmodel%",))
    return None if holds_lease is None else (FENCED if holds_lease else UNFENCED)


def test_reconciler_ticks_survive_slow_ticks_dead_workers_and_a_broker_restart(
    cluster: Cluster,
) -> None:
    """[C2] a slow tick, [C3] workers down for ten intervals, [C4] the broker restarted,
    [C5] the worker killed in the middle of a placement: never two ticks at once, the ticks
    that came due meanwhile are dropped rather than run late, ticks resume, and the
    placement converges once."""
    plane = cluster.add_control_plane()
    redis = cluster.redis
    assert redis is not None and plane.worker is not None
    cluster.add_agent("a", gpus="4x80GiB")
    wait_until(lambda: node_health("a") == "ready", what="the agent", logs=cluster.processes())
    add_model("m", min_replicas=1, max_replicas=3, idle_timeout_s=3600)
    wait_ready(cluster, "m", 1)
    checker = InvariantChecker(cluster)
    with checker.running(), TaskEvents(redis.url).running() as events:
        wait_ticks(events, plane, 0)  # the receiver hears this worker

        # [C2] a tick stalls on the store while three more come due; they are dropped.
        with table_locked("control_servedmodel"):
            wait_until(lambda: queued_ticks(redis) >= 3, what="three ticks queued behind it")
            waiting = queued_ticks(redis)
            released = time.time()
        wait_until(lambda: queued_ticks(redis) == 0, what="the queue drained")
        wait_until(
            lambda: expired_unrun(events, plane, released) >= waiting - 1,
            what=f"at least {waiting - 1} of {waiting} stale ticks dropped",
            logs=[plane.worker],
        )

        # [C3] the worker is down while five ticks come due; back, they are dropped, not run.
        assert plane.worker.stop() == 0
        wait_until(lambda: queued_ticks(redis) >= 5, what="five ticks queued for nobody")
        waiting = queued_ticks(redis)
        restarted = time.time()
        plane.worker.start()
        wait_ticks(events, plane, restarted, count=1)
        assert expired_unrun(events, plane, restarted) >= waiting - 1

        # [C4] the broker restarts; the worker resumes.
        redis.stop()
        redis.start()
        restarted = time.time()
        wait_ticks(events, plane, restarted)

        # [C5] kill -9 the worker while its placement transaction waits on the store; the
        # transaction dies with it, and the next worker places exactly once.
        # SHARE lets the tick read shards but not insert them: it inserts the replica row,
        # then waits on its shard row inside the fenced transaction.
        with table_locked("control_shard", mode="SHARE"):
            execute_now("UPDATE control_servedmodel SET min_replicas = 2 WHERE name = 'm'")
            wait_until(
                lambda: "control_shard" in str(execute_now(WAITING_ON, ("%control_shard%",))),
                what="the placement to wait on the shard table",
            )
            plane.worker.kill()
        assert Replica.objects.filter(model__name="m").count() == 1, "nothing half-written"
        plane.worker.start()
        wait_ready(cluster, "m", 2)
        wait_ticks(events, plane, time.time())
        assert Replica.objects.filter(model__name="m").count() == 2, "placed once"
        assert never_two_at_once(events, plane)
    assert checker.violations == [], checker.violations[:10]
