"""End to end, with real processes: the store taken away from running control planes, or made
slow, through a TCP proxy between them and PostgreSQL (``tests/harness/proxy.py``); the
machine's PostgreSQL itself is never touched. Scenario codes are those of docs/scenarios.md.

Two control planes (a web process, a Celery worker and a beat each) and two agents with
simulated GPUs, as in ``test_cluster_e2e``; clients of the official ``openai`` package stream
from both web processes the whole time. What is asserted comes from the clients' answers, the
store, the lease, the processes and the engines; how long requests took is printed for the
report, never asserted.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import pytest
from django.db import connection

from control.models import Event, Replica, ServedModel
from gateway.models import UsageRecord
from tests.harness.cluster import (
    Cluster,
    InvariantChecker,
    TaskEvents,
    lease_state,
    node_health,
    ready_replicas,
    running_cluster,
    wait_leader,
    wait_ticks,
    writes_by_epoch_in_commit_order,
)
from tests.harness.factories import make_key, make_model
from tests.harness.live import http, routes
from tests.harness.traffic import StreamingClients, latency_report
from tests.harness.waits import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e, pytest.mark.timeout(600)]

# As long as a user saw it (25 s): past the pool's timeout, the TCP user timeout and the
# nodes' lost threshold, so each of them plays out during the cut.
OUTAGE_S = 25.0
# A key is trusted as long as its last confirmation from the store: a deployment that rides
# out an outage this long runs a key cache TTL longer than it (docs/operations.md, "When the
# store or Redis is away"); past its TTL a key is refused (see test_keys.py).
RIDE_OUT_TTL = str(OUTAGE_S * 2)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    if connection.vendor != "postgresql":
        pytest.skip("the store is cut through a TCP proxy: PostgreSQL only")
    with running_cluster(tmp_path) as cluster:
        yield cluster


def one_leader_stays(cluster: Cluster, events: TaskEvents) -> None:
    """A leader, and while both workers run three more ticks each, the same one."""
    wait_leader(cluster)
    held = lease_state()
    after = time.time()
    for plane in cluster.control_planes:
        wait_ticks(events, plane, after, count=3)
    assert lease_state() == held, "the lease changed hands with nothing wrong"


def engine_pids(cluster: Cluster) -> dict[str, set[int]]:
    return {
        name: {pid for pids in agent.engines().values() for pid in pids}
        for name, agent in cluster.agents.items()
    }


def completion(model: str) -> bytes:
    return json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    ).encode()


def timed_post(url: str, key: str, body: bytes) -> tuple[int, str, dict[str, str], float]:
    """(status, Retry-After, the error object, seconds) of one completion."""
    began = time.monotonic()
    status, headers, raw = http("POST", url + "/v1/chat/completions", key=key, body=body)
    seconds = time.monotonic() - began
    error = json.loads(raw).get("error", {}) if status != 200 else {}
    return status, str(headers.get("Retry-After", "")), error, seconds


def serves(url: str, key: str) -> bool:
    return timed_post(url, key, completion("hot"))[0] == 200


def test_l6_the_store_cut_from_running_control_planes_under_traffic(cluster: Cluster) -> None:
    """[L6] PostgreSQL cut (connections reset, new ones refused) for 25 s from two running
    control planes while eight streaming clients use two ready replicas: every request to
    them is answered, whole, and counted once when the store is back; a request that needs the
    store (a key never seen, a cold model) is told so with a 503 and Retry-After; nobody acts
    without the lease, no process exits, the pools reconnect, one leader afterwards, no node
    is marked late and no engine is stopped because of it."""
    planes = [
        cluster.add_control_plane(via_proxy=True, LLMGW_KEY_CACHE_TTL=RIDE_OUT_TTL)
        for _ in range(2)
    ]
    for name in ("a", "b"):
        cluster.add_agent(name, gpus="2x80GiB")
    wait_until(
        lambda: all(node_health(n) == "ready" for n in ("a", "b")),
        what="two agents to connect",
        logs=cluster.processes(),
    )
    make_model("hot", min_replicas=2, max_replicas=2, idle_timeout_s=3600, startup_timeout_s=30)
    make_model("cold", min_replicas=0, max_replicas=1, startup_timeout_s=30)
    # Limited, so every request takes its counters (in Redis, which stays up).
    key, api_key = make_key("client", rpm=1_000_000, budget=10**12)
    newcomer, _ = make_key("newcomer")  # first used while the store is away
    wait_until(lambda: ready_replicas("hot") == 2, what="two ready hot", logs=cluster.processes())
    for web in [p.web for p in planes if p.web is not None]:
        wait_until(partial(routes, web, key, "hot"), what=f"{web.name} routes hot")
    hot = set(Replica.objects.filter(model__name="hot").values_list("pk", flat=True))
    before = engine_pids(cluster)
    assert sum(len(pids) for pids in before.values()) == 2, before
    assert cluster.redis is not None
    checker = InvariantChecker(cluster)
    traffic = StreamingClients([p.url for p in planes], key, "hot", clients=8)
    with checker.running(), TaskEvents(cluster.redis.url).running() as events:
        wait_leader(cluster)
        with traffic.running():
            wait_until(lambda: traffic.count() >= 40, what="traffic under way")
            cut_at = time.monotonic()
            cut_wall = time.time()
            for plane in planes:
                assert plane.proxy is not None
                plane.proxy.cut()
            # Past the key cache's TTL and the pool's timeout: what needs the store now finds
            # it gone, on both web processes.
            wait_until(lambda: time.monotonic() - cut_at > 6, what="the cut to last")
            refusals = [timed_post(plane.url, newcomer, completion("hot")) for plane in planes] + [
                timed_post(plane.url, key, completion("cold")) for plane in planes
            ]
            wait_until(lambda: time.monotonic() - cut_at >= OUTAGE_S, what="the outage to end")
            restored_at = time.monotonic()
            for plane in planes:
                assert plane.proxy is not None
                plane.proxy.restore()
            wait_until(lambda: traffic.count(restored_at) >= 40, what="traffic after the cut")
        answers = traffic.seen()
        during = traffic.seen(cut_at, restored_at)
        print()
        print(latency_report("before the cut", traffic.seen(0, cut_at)))
        print(latency_report("during the cut", during))
        print(latency_report("after the cut", traffic.seen(restored_at)))
        print("needing the store during the cut (status, Retry-After, code, ms):")
        for status, retry_after, error, seconds in refusals:
            print(f"  {status} {retry_after} {error.get('code')} {seconds * 1000:.0f}")

        # Every request to the ready replicas was answered, whole, during the cut too.
        assert [a for a in answers if not a.whole] == []
        assert len(during) >= 8, "the clients kept sending during the cut"
        # What needs the store said so: an OpenAI-shaped 503 with Retry-After.
        assert [(s, bool(r), sorted(e)) for s, r, e, _ in refusals] == [
            (503, True, ["code", "message", "param", "type"])
        ] * 4

        # The pools reconnect: both web processes serve the key they could not check before.
        for plane in planes:
            wait_until(
                partial(serves, plane.url, newcomer),
                what=f"{plane.name} to check a key in the store again",
            )
        print(f"a new key served on both {time.monotonic() - restored_at:.1f}s after the return")
        # Counted once: a row for every answer, and no other row for the key.
        ids = {a.request_id for a in answers}
        assert len(ids) == len(answers) and "" not in ids
        wait_until(
            lambda: UsageRecord.objects.filter(request_id__in=ids).count() == len(ids),
            what="a usage row for every answer",
            logs=[p.web for p in planes if p.web is not None],
        )
        others = UsageRecord.objects.filter(api_key=api_key).exclude(request_id__in=ids)
        assert sorted(others.values_list("model", "status")) == [("cold", 503)] * 2
        rows = UsageRecord.objects.filter(request_id__in=ids)
        assert {r.completion_tokens for r in rows} == {traffic.tokens}

        # One leader afterwards, its writes fenced; nothing crashed.
        one_leader_stays(cluster, events)
        epochs = writes_by_epoch_in_commit_order()
        assert epochs == sorted(epochs)
        assert [p.name for p in cluster.processes() if not p.running()] == []
        # Nobody declared a node late for the store's silence, and no engine was stopped.
        since = datetime.fromtimestamp(cut_wall, tz=UTC)
        assert not Event.objects.filter(kind=Event.Kind.NODE, created_at__gte=since).exists()
        assert all(node_health(n) == "ready" for n in ("a", "b"))
        assert (
            set(
                Replica.objects.filter(model__name="hot", desired="running").values_list(
                    "pk", flat=True
                )
            )
            == hot
        )
        assert engine_pids(cluster) == before
    assert checker.violations == [], checker.violations[:10]


# Each way: a statement's round trip takes 1.5 s, and a tick's claim (the pool's check of its
# connection, then the claim) 3 s, past the renew deadline and well inside the TTL.
SLOW_S = 0.75


def test_l17_a_leader_whose_store_is_slow_steps_down_and_the_standby_takes_over(
    cluster: Cluster,
) -> None:
    """[L17] Every statement between the leader's reconciler and the store delayed so that no
    claim is confirmed within the renew deadline, though each still lands within the TTL: the
    leader stops acting, the lease is not renewed for it, the standby takes over and places
    what is asked meanwhile; no write of the old epoch lands after the new one's first; when
    the delay ends, one leader."""
    for _ in range(2):
        # A TTL long enough that a renewal a few seconds late still lands before the expiry.
        cluster.add_control_plane(
            reconciler_via_proxy=True,
            LLMGW_LEASE_TTL="6",
            LLMGW_LEASE_RENEW_DEADLINE="2",
        )
    cluster.add_agent("a", gpus="4x80GiB")
    wait_until(lambda: node_health("a") == "ready", what="the agent", logs=cluster.processes())
    make_model("m", min_replicas=1, max_replicas=2, idle_timeout_s=3600, startup_timeout_s=30)
    wait_until(lambda: ready_replicas("m") == 1, what="one ready m", logs=cluster.processes())
    assert cluster.redis is not None
    checker = InvariantChecker(cluster)
    with checker.running(), TaskEvents(cluster.redis.url).running() as events:
        leader = wait_leader(cluster)
        owner, epoch = lease_state()
        assert leader.reconciler_proxy is not None
        leader.reconciler_proxy.delay(SLOW_S)
        last_before = Replica.objects.order_by("-pk").values_list("pk", flat=True).first() or 0
        wait_until(
            lambda: lease_state()[1] > epoch,
            what="the standby to take over from the slow leader",
            logs=cluster.processes(),
        )
        new_owner, new_epoch = lease_state()
        assert new_owner != owner
        # Work for whoever leads: placed by the new leader, never with the old epoch.
        ServedModel.objects.filter(name="m").update(min_replicas=2)
        wait_until(lambda: ready_replicas("m") == 2, what="two ready m", logs=cluster.processes())
        late = Replica.objects.filter(pk__gt=last_before, epoch__lte=epoch)
        assert not late.exists(), "nothing placed with the slow leader's epoch"
        restored = time.time()
        leader.reconciler_proxy.restore()
        wait_ticks(events, leader, restored)
        assert lease_state() == (new_owner, new_epoch), "the slow leader stays a follower"
        one_leader_stays(cluster, events)
        epochs = writes_by_epoch_in_commit_order()
        assert epochs == sorted(epochs)
    assert checker.violations == [], checker.violations[:10]
