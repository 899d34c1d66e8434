"""End to end, with real processes: two control planes (each daphne + Celery worker + beat) on
PostgreSQL and a private Redis, three agents with simulated GPUs running real ``sim`` engines.

An invariant checker reads the store and the live engine processes throughout: no GPU is ever
given to two shards, no model ever exceeds its replica count. Scenarios from SCENARIOS.md:
L2, L3, L5, L11, C1–C6, N1/N4. The figures (failover times) are printed for the closing note.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.utils import timezone

from control.models import Profile, Replica, ServedModel
from gateway import keys
from tests.harness.cluster import (
    Cluster,
    InvariantChecker,
    engine_processes,
    execute_now,
    leader_worker,
    lease_state,
    node_health,
    ready_replicas,
    release_stolen_lease,
    shard_nodes,
    steal_lease,
    table_locked,
    tick_times,
    writes_by_epoch_in_commit_order,
)
from tests.harness.waits import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e, pytest.mark.timeout(420)]

TTL = 3.0
TICK = 0.5
STARTUP = 1.0


@pytest.fixture
def postgres_only() -> None:
    if connection.vendor != "postgresql":
        pytest.skip(
            "two control planes share one store only on PostgreSQL; the embedded default "
            "(one control plane) is covered by test_embedded_e2e"
        )


def add_model(
    name: str, *, shards: int = 1, args: list[str] | None = None, **fields: Any
) -> ServedModel:
    profile = Profile.objects.create(
        name=f"{name}-sim",
        engine="sim",
        args=args or [],
        gpus_per_shard=1,
        shards_per_replica=shards,
        startup_timeout_s=30,
    )
    model = ServedModel.objects.create(
        name=name, source=f"test/{name}", default_profile=profile, **fields
    )
    model.profiles.add(profile)
    return model


@pytest.fixture
def cluster(tmp_path: Path, postgres_only: None) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path)
    cluster.start_redis()
    try:
        yield cluster
    finally:
        cluster.stop()
        print(f"\n(logs under {tmp_path})")


def start_fleet(cluster: Cluster, planes: int = 2, **cp_settings: Any) -> None:
    for _ in range(planes):
        cluster.add_control_plane(**cp_settings)
    for name in ("a", "b", "c"):
        cluster.add_agent(name, gpus="3x80GiB")
    wait_until(
        lambda: all(node_health(n) == "ready" for n in ("a", "b", "c")),
        60,
        "three agents to connect",
    )


def wait_ready(model: str, count: int, timeout: float = 40) -> None:
    wait_until(lambda: ready_replicas(model) >= count, timeout, f"{count} ready {model}")


def epochs_are_monotonic() -> bool:
    epochs = writes_by_epoch_in_commit_order()
    return epochs == sorted(epochs)


def test_two_control_planes_place_once_fail_over_and_replace_a_lost_node(
    cluster: Cluster, capsys: Any
) -> None:
    start_fleet(cluster)
    add_model("steady", min_replicas=2, max_replicas=2, idle_timeout_s=3600)
    add_model("wide", shards=2, min_replicas=1, max_replicas=1, idle_timeout_s=3600)
    add_model("zero", min_replicas=0, max_replicas=1)
    add_model("cold", min_replicas=0, max_replicas=1, args=["--startup-delay", str(STARTUP)])
    get_user_model().objects.create_user("client")
    client = openai.OpenAI(
        base_url=cluster.control_planes[0].url + "/v1",
        api_key=keys.issue("client").key,
        max_retries=0,
    )
    checker = InvariantChecker(cluster)
    with checker.running():
        # [C1] two beats, two workers: placements converge once.
        wait_ready("steady", 2)
        wait_ready("wide", 1)
        assert len(shard_nodes("wide")) == 2, "a two-node replica spans two nodes"
        time.sleep(4 * TICK)  # several more ticks from both beats change nothing
        assert Replica.objects.filter(model__name="steady").count() == 2
        assert Replica.objects.filter(model__name="wide").count() == 1

        # Scale from zero through the gateway, with an engine that takes STARTUP to start.
        started = time.monotonic()
        stream = client.chat.completions.create(
            model="cold", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        cold_first_token = next(
            time.monotonic() - started for c in stream if c.choices and c.choices[0].delta.content
        )
        stream.close()
        assert Replica.objects.filter(model__name="cold").count() == 1

        # [L2] kill -9 the leader's worker; a standby leads within TTL + a tick and places.
        leader = wait_until(lambda: leader_worker(cluster), 10, "a leader")
        _, old_epoch = lease_state()
        leader.worker.kill()
        killed_at = time.monotonic()
        ServedModel.objects.filter(name="zero").update(demand_at=timezone.now())
        wait_until(lambda: lease_state()[1] > old_epoch, TTL + 4, "a new leader")
        took_over = time.monotonic() - killed_at
        wait_until(
            lambda: Replica.objects.filter(model__name="zero").exists(), TTL + 6, "a placement"
        )
        placed = time.monotonic() - killed_at
        assert took_over <= TTL + 2 * TICK + 1.0
        assert epochs_are_monotonic(), "no write of the old epoch after the new one's first"
        leader.worker.start()

        # [N1] kill -9 an agent: unreachable, then lost, its replicas placed elsewhere.
        victim = sorted(shard_nodes("steady"))[0]
        doomed = set(
            Replica.objects.filter(
                model__name="steady", desired="running", shards__node__name=victim
            ).values_list("pk", flat=True)
        )
        cluster.agents[victim].service.kill()
        lost_at = time.monotonic()
        wait_until(lambda: node_health(victim) == "unreachable", 10, f"{victim} unreachable")
        unreachable_after = time.monotonic() - lost_at
        wait_until(lambda: node_health(victim) == "lost", 15, f"{victim} lost")
        wait_until(
            lambda: ready_replicas("steady") == 2 and victim not in shard_nodes("steady"),
            40,
            "steady replaced on other nodes",
        )
        replaced = time.monotonic() - lost_at
        assert doomed and set(
            Replica.objects.filter(pk__in=doomed).values_list("desired", flat=True)
        ) == {"stopped"}

        # [N4] the lost node returns: it reports what still runs; the duplicates are stopped.
        old_engines = {
            pid
            for pid, env in engine_processes()
            if cluster.node_of_port(_engine_port(pid)) == victim
        }
        assert old_engines, "the killed agent's engines outlived it (they run on their own)"
        cluster.restart_agent(victim)
        wait_until(lambda: node_health(victim) == "ready", 20, f"{victim} back")
        wait_until(
            lambda: not ({pid for pid, _ in engine_processes()} & old_engines),
            30,
            "the returning node's duplicate engines to stop",
        )
        assert ready_replicas("steady") == 2

    assert checker.checks > 50
    assert checker.violations == [], checker.violations[:10]
    with capsys.disabled():
        print(
            f"\n[L2] leader killed: new leader after {took_over:.2f}s, next placement after "
            f"{placed:.2f}s (TTL {TTL:g}s, tick {TICK:g}s)"
            f"\n[N1] agent killed: unreachable after {unreachable_after:.1f}s, replicas "
            f"replaced and ready after {replaced:.1f}s"
            f"\n[C1] invariant checks: {checker.checks}, violations: 0"
            f"\n[scale from zero] first token after {cold_first_token:.2f}s with a "
            f"{STARTUP:g}s engine start-up: overhead {cold_first_token - STARTUP:.2f}s"
        )


def _engine_port(pid: int) -> int:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return int(argv[argv.index("--port") + 1]) if "--port" in argv else 0


def signal_leader(cluster: Cluster, sig: int) -> Any:
    leader = wait_until(lambda: leader_worker(cluster), 10, "a leader")
    leader.worker.send(sig)
    return leader


def test_paused_terminated_and_partitioned_leaders_never_write_stale(
    cluster: Cluster, capsys: Any
) -> None:
    """[L3] SIGSTOP for 2×TTL, [L11] SIGTERM, [L5] cut off from the store, [C6] lease lost
    mid-tick: each time the standby takes over and no write of an old epoch lands late."""
    for _ in range(2):
        cluster.add_control_plane(via_proxy=True)
    cluster.add_agent("a", gpus="4x80GiB")
    wait_until(lambda: node_health("a") == "ready", 60, "the agent")
    add_model("m", min_replicas=1, max_replicas=2, idle_timeout_s=3600)
    wait_ready("m", 1)
    figures = []
    checker = InvariantChecker(cluster)
    with checker.running():
        # [L3] pause the leader past its TTL; the standby leads; the resumed one writes nothing.
        leader = signal_leader(cluster, signal.SIGSTOP)
        paused_owner, paused_epoch = lease_state()
        paused_at = time.monotonic()
        wait_until(lambda: lease_state()[1] > paused_epoch, TTL + 3, "a takeover during the pause")
        figures.append(f"[L3] paused leader replaced after {time.monotonic() - paused_at:.2f}s")
        ServedModel.objects.filter(name="m").update(min_replicas=2)  # work for whoever leads
        time.sleep(max(0.0, 2 * TTL - (time.monotonic() - paused_at)))
        leader.worker.send(signal.SIGCONT)
        wait_ready("m", 2)
        time.sleep(3 * TICK)
        stale = Replica.objects.filter(epoch=paused_epoch, model__name="m").count()
        assert stale == 1, "only the replica placed before the pause carries the old epoch"
        assert lease_state()[0] != paused_owner, "the resumed process stays a follower"
        assert epochs_are_monotonic()

        # [L11] SIGTERM the leader: it releases the lease, the standby leads within a tick.
        _, epoch = lease_state()
        leader = signal_leader(cluster, signal.SIGTERM)
        terminated_at = time.monotonic()
        wait_until(lambda: lease_state()[1] > epoch, TTL, "a takeover after SIGTERM")
        handover = time.monotonic() - terminated_at
        assert handover < TTL, "released, not expired"
        assert leader.worker.process is not None and leader.worker.process.wait(15) == 0
        figures.append(f"[L11] SIGTERM handover in {handover:.2f}s (TTL {TTL:g}s)")
        leader.worker.start()

        # [L5] the leader's host loses the store; the standby takes over after expiry; back
        # on the network, the old leader stays a follower.
        leader = wait_until(lambda: leader_worker(cluster), 10, "a leader")
        _, epoch = lease_state()
        assert leader.proxy is not None
        leader.proxy.cut()
        cut_at = time.monotonic()
        wait_until(lambda: lease_state()[1] > epoch, TTL + 3, "a takeover after the partition")
        figures.append(f"[L5] partitioned leader replaced after {time.monotonic() - cut_at:.2f}s")
        new_owner, new_epoch = lease_state()
        leader.proxy.restore()
        time.sleep(4 * TICK)
        assert lease_state() == (new_owner, new_epoch), "the returning leader stays a follower"

        # [C6] the lease is lost mid-tick: the tick's remaining writes change nothing.
        leader = wait_until(lambda: leader_worker(cluster), 10, "a leader")
        last_id = Replica.objects.order_by("-pk").values_list("pk", flat=True).first() or 0
        more = "UPDATE control_servedmodel SET min_replicas = 3, max_replicas = 3 WHERE name='m'"
        with table_locked("control_servedmodel", more):
            time.sleep(2 * TICK)  # the leader's tick now waits inside its snapshot read
            stolen_epoch = steal_lease()
        # The tick reads min 3, wants a replica, and its fenced write is refused.
        wait_until(
            lambda: "lost leadership mid-tick" in leader.worker.output(), 10, "the lost-lease log"
        )
        assert not Replica.objects.filter(pk__gt=last_id, epoch__lt=stolen_epoch).exists()
        release_stolen_lease()
        wait_ready("m", 3)
    assert checker.violations == [], checker.violations[:10]
    with capsys.disabled():
        print("\n" + "\n".join(figures))


# A backend of the store waiting for a lock, in the middle of inserting a shard.
WAITING_ON_SHARDS = (
    "SELECT string_agg(query, ' ') FROM pg_stat_activity "
    "WHERE wait_event_type = 'Lock' AND query LIKE 'INSERT INTO %%control_shard%%'"
)


def ticks_between(plane: Any, start: float, end: float) -> int:
    return sum(1 for t in tick_times(plane.worker.output()) if start <= t < end)


def test_reconciler_ticks_survive_slow_ticks_dead_workers_and_a_broker_restart(
    cluster: Cluster, capsys: Any
) -> None:
    """[C2] a slow tick, [C3] workers down for ten intervals, [C4] the broker restarted,
    [C5] the worker killed in the middle of a placement: never two ticks at once, no backlog,
    ticks resume, and the placement converges once."""
    plane = cluster.add_control_plane()
    cluster.add_agent("a", gpus="4x80GiB")
    wait_until(lambda: node_health("a") == "ready", 60, "the agent")
    add_model("m", min_replicas=1, max_replicas=3, idle_timeout_s=3600)
    wait_ready("m", 1)
    figures = []
    checker = InvariantChecker(cluster)
    with checker.running():
        # [C2] ticks stall for six intervals; afterwards no burst of queued ticks runs.
        with table_locked("control_servedmodel"):
            time.sleep(6 * TICK)
        released = time.time()
        time.sleep(4 * TICK)
        burst = ticks_between(plane, released, released + 2 * TICK)
        # The stalled tick ends, then at most one due tick, then the normal two a second;
        # the six that came due during the stall expired unrun instead of queueing.
        assert burst <= 4, f"{burst} ticks ran in the first second after the stall"
        assert ticks_between(plane, released - 5 * TICK, released) == 0, "none while stalled"
        assert plane.worker.output().count("Discarding revoked task") >= 3
        figures.append(f"[C2] ticks in the first second after a 3 s stall: {burst}")

        # [C3] the worker is down for ten intervals; back, it runs one tick, not ten.
        assert plane.worker.stop() == 0
        time.sleep(10 * TICK)
        plane.worker.start()
        first = wait_until(
            lambda: [t for t in tick_times(plane.worker.output()) if t > released + 10 * TICK],
            30,
            "ticks after the worker restart",
        )[0]
        time.sleep(4 * TICK)
        backlog = ticks_between(plane, first, first + 2 * TICK)
        assert backlog <= 4, f"{backlog} ticks in the first second: a backlog ran"
        figures.append(f"[C3] ticks in the first second after 10 missed intervals: {backlog}")

        # [C4] the broker restarts; the worker resumes within a few intervals.
        assert cluster.redis is not None
        cluster.redis.stop()
        time.sleep(2 * TICK)
        cluster.start_redis()
        restarted = time.time()
        resumed = wait_until(
            lambda: [t for t in tick_times(plane.worker.output()) if t > restarted],
            30,
            "ticks after the broker restart",
        )[0]
        figures.append(f"[C4] ticks resumed {resumed - restarted:.1f}s after the broker came back")

        # [C5] kill -9 the worker while its placement transaction waits on the store; the
        # transaction dies with it, and the next worker places exactly once.
        # SHARE lets the tick read shards but not insert them: it inserts the replica row,
        # then waits on its shard row inside the fenced transaction.
        with table_locked("control_shard", mode="SHARE"):
            execute_now("UPDATE control_servedmodel SET min_replicas = 2 WHERE name = 'm'")
            wait_until(
                lambda: "control_shard" in str(execute_now(WAITING_ON_SHARDS)),
                10,
                "the placement to wait on the shard table",
            )
            plane.worker.kill()
        assert Replica.objects.filter(model__name="m").count() == 1, "nothing half-written"
        plane.worker.start()
        wait_ready("m", 2)
        time.sleep(4 * TICK)
        assert Replica.objects.filter(model__name="m").count() == 2, "placed once"
    assert checker.violations == [], checker.violations[:10]
    with capsys.disabled():
        print("\n" + "\n".join(figures))
