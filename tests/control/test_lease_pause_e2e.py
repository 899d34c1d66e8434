"""[L4] The leader's worker paused for half the lease TTL (``SIGSTOP``, then ``SIGCONT``), end to
end: two control planes (web, worker, beat each) on the store under test and a private Redis,
one agent with simulated GPUs.

A pause shorter than the TTL must change nothing: the lease row keeps its owner and epoch the
whole time (read throughout from a thread of its own, so a change that came and went is seen
too: had the standby led even once, its owner id would be there), and what the leader was asked
to do during each pause it does afterwards, with its own epoch. Three pauses, so that a flap
which needs a few tries shows.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
from django.db import connection

from control.models import Replica, ServedModel
from tests.harness.cluster import (
    FAST,
    Cluster,
    ControlPlane,
    TaskEvents,
    Watcher,
    leader_worker,
    lease_state,
    node_health,
    ready_replicas,
)
from tests.harness.factories import make_model
from tests.harness.waits import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e, pytest.mark.timeout(300)]

PAUSE = float(FAST["LLMGW_LEASE_TTL"]) / 2
ROUNDS = 3


class LeaseRows(Watcher):
    """Every (owner, epoch) the lease row showed, in order, read every 20 ms."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, int]] = []
        self.reads = 0

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                with connection.cursor() as cursor:
                    cursor.execute(
                        "SELECT owner, epoch FROM control_lease WHERE name = 'reconciler'"
                    )
                    row = cursor.fetchone()
                self.reads += 1
                if row is not None and (not self.seen or self.seen[-1] != tuple(row)):
                    self.seen.append((str(row[0]), int(row[1])))
                self._stop.wait(0.02)
        finally:
            connection.close()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    # Heartbeats late on a loaded machine must not make the node unreachable or lost here:
    # that is another scenario (N1), and replacing its replicas would blur what was placed.
    settings = {**FAST, "LLMGW_UNREACHABLE_AFTER": "30", "LLMGW_LOST_AFTER": "60"}
    cluster = Cluster(tmp_path, settings=settings)
    cluster.start_redis()
    try:
        yield cluster
    finally:
        cluster.stop()


def ticks_after(events: TaskEvents, plane: ControlPlane, moment: float) -> int:
    """Ticks ``plane``'s worker started after ``moment`` and finished."""
    started = {e["uuid"] for e in events.of("started", host=plane.name, after=moment)}
    return sum(1 for e in events.of("succeeded", host=plane.name) if e["uuid"] in started)


def ticked(events: TaskEvents, planes: list[ControlPlane], moment: float) -> bool:
    """Each of ``planes`` finished a tick it started after ``moment``."""
    return all(ticks_after(events, plane, moment) >= 1 for plane in planes)


def ready_count_is(model: str, count: int) -> bool:
    return ready_replicas(model) == count


def test_l4_a_leader_paused_for_half_its_ttl_keeps_the_lease_and_nobody_flaps(
    cluster: Cluster,
) -> None:
    """[L4] Three pauses of half the TTL: one owner and one epoch throughout, the standby
    never leads, and the work asked for during each pause is done by the leader after it."""
    for _ in range(2):
        cluster.add_control_plane()
    assert cluster.redis is not None
    cluster.add_agent("a", gpus="4x80GiB")
    wait_until(lambda: node_health("a") == "ready", what="the agent", logs=cluster.processes())
    make_model("m", min_replicas=1, max_replicas=4, idle_timeout_s=3600, startup_timeout_s=30)
    wait_until(lambda: ready_replicas("m") == 1, what="m placed", logs=cluster.processes())
    leader = wait_until(lambda: leader_worker(cluster), what="a leader")
    standby = next(p for p in cluster.control_planes if p is not leader)
    assert leader.worker is not None and standby.worker is not None
    owner, epoch = lease_state()
    first = Replica.objects.order_by("-pk").values_list("pk", flat=True).first() or 0

    with LeaseRows().running() as rows, TaskEvents(cluster.redis.url).running() as events:
        for wanted in range(2, 2 + ROUNDS):
            # Both planes tick before each pause: the standby is competing, not idle.
            wait_until(
                partial(ticked, events, [leader, standby], time.time()),
                what="a tick of each plane",
                logs=cluster.processes(),
            )
            leader.worker.signal(signal.SIGSTOP)
            paused_at = time.monotonic()
            ServedModel.objects.filter(name="m").update(min_replicas=wanted)  # work meanwhile
            time.sleep(max(0.0, PAUSE - (time.monotonic() - paused_at)))  # the fault itself
            leader.worker.signal(signal.SIGCONT)
            wait_until(
                partial(ready_count_is, "m", wanted),
                what=f"{wanted} ready replicas of m",
                logs=cluster.processes(),
            )
        resumed = time.time()
        wait_until(
            lambda: ticks_after(events, standby, resumed) >= 2,
            what="the standby to look again after the last pause",
            logs=cluster.processes(),
        )

    assert rows.reads > 50
    assert rows.seen == [(owner, epoch)], f"the lease row changed: {rows.seen}"
    assert lease_state() == (owner, epoch)
    placed = Replica.objects.filter(pk__gt=first).values_list("epoch", flat=True)
    assert len(placed) == ROUNDS and set(placed) == {epoch}, "placed by the leader alone"
    assert "leadership lost" not in leader.worker.log(), "the leader never saw itself deposed"
    assert leader.worker.running() and standby.worker.running()
