"""Scaling is pure: one model, every running replica and the fleet in; the actions the
reconciler carries out, in order, out. Tested by table without a database."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from control.lifecycle import ReplicaUse
from control.placement import FreeGpu, NodeCapacity, Placement, ReplicaRequest, ShardPlacement
from control.scaling import (
    Drain,
    Fleet,
    Holding,
    ModelScale,
    NoteUnplaceable,
    Place,
    ReplicaState,
    SatisfyDemand,
    ScaleAction,
    Stop,
    scale,
)
from tests.control.test_lifecycle import demand

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
PORTS = (20000, 20009)
GIB = 1024
RECENTLY = NOW - timedelta(minutes=1)
LONG_AGO = NOW - timedelta(hours=2)
WAITING = NOW - timedelta(seconds=3)


def model(name: str = "m", **overrides: object) -> ModelScale:
    return ModelScale(
        name, demand(**overrides), ReplicaRequest(name, f"org/{name}", gpu_memory_mib=40 * GIB)
    )


def replica(
    replica_id: int,
    model: str = "m",
    *,
    ready: bool = True,
    draining: bool = False,
    leaving: bool = False,
    pinned: bool = False,
    in_flight: int = 0,
    used: datetime | None = LONG_AGO,
) -> ReplicaState:
    use = ReplicaUse(replica_id, model, ready, pinned, in_flight, used)
    return ReplicaState(use, draining=draining, leaving=leaving)


def node(name: str, gpus: int = 1) -> NodeCapacity:
    return NodeCapacity(name, tuple(FreeGpu(i, 80 * GIB) for i in range(gpus)))


def holds(replica_id: int, node: str, gpu: int = 0, port: int = 20000) -> Holding:
    return Holding(replica_id, node, (gpu,), port)


def on(node: str, gpu: int = 0, port: int = 20000) -> Placement:
    return Placement((ShardPlacement(node, 0, (gpu,), port),))


def decide(
    wanted: ModelScale,
    replicas: list[ReplicaState],
    fleet: Fleet,
    **min_replicas: int,
) -> list[ScaleAction]:
    minimum = {wanted.name: wanted.demand.min_replicas, **min_replicas}
    return scale(wanted, replicas, fleet, min_replicas=minimum, now=NOW, port_range=PORTS)


ONE_FREE = Fleet((node("a"),))
FULL = Fleet((node("a"),), (holds(9, "a"),))
NO_ROOM = "needs 1×40 GiB on one node; no GPU is free on any schedulable node"
IDLE = "idle: scaling down"


@pytest.mark.parametrize(
    ("wanted", "replicas", "fleet", "expected"),
    [
        # Nothing wanted, nothing runs.
        (model(), [], ONE_FREE, []),
        # The minimum is placed; each placement sees what the one before it took.
        (model(min_replicas=2), [], Fleet((node("a", 2),)),
         [Place(on("a", 0, 20000), "wanted by demand"),
          Place(on("a", 1, 20001), "wanted by demand")]),
        # Scale from zero for a waiting request.
        (model(demand_at=WAITING), [], ONE_FREE, [Place(on("a"), "wanted by demand")]),
        # A ready replica answers the waiting request: the demand is forgotten first.
        (model(demand_at=WAITING, last_request_at=RECENTLY), [replica(1, used=RECENTLY)], FULL,
         [SatisfyDemand()]),
        # A replica not yet ready leaves the demand standing and nothing more is placed.
        (model(demand_at=WAITING), [replica(1, ready=False)], FULL, []),
        # No room and no request waiting: say why, evict nothing.
        (model(min_replicas=1), [replica(9, "other")], FULL, [NoteUnplaceable(NO_ROOM)]),
        # No room, a request waiting: the idle replica of another model is evicted for it.
        (model(demand_at=WAITING), [replica(9, "other")], FULL,
         [NoteUnplaceable(NO_ROOM), Drain(9, "other", "evicted (idle) to make room for m")]),
        # ... but not while another drain is under way (its GPUs are not free yet).
        (model(demand_at=WAITING), [replica(9, "other"), replica(8, "third", draining=True)],
         FULL, [NoteUnplaceable(NO_ROOM)]),
        # ... nor a pinned one, one serving requests, or one whose eviction would not help.
        (model(demand_at=WAITING), [replica(9, "other", pinned=True)], FULL,
         [NoteUnplaceable(NO_ROOM)]),
        (model(demand_at=WAITING), [replica(9, "other", in_flight=1)], FULL,
         [NoteUnplaceable(NO_ROOM)]),
        (model(demand_at=WAITING), [replica(7, "other")], FULL, [NoteUnplaceable(NO_ROOM)]),
        # Idle above the minimum: not-ready replicas stop first, then the least recently used
        # ready ones drain.
        (model(min_replicas=1),
         [replica(1, used=RECENTLY - timedelta(minutes=20)), replica(2, ready=False),
          replica(3, used=LONG_AGO)],
         FULL, [Stop(2, "m", IDLE), Drain(3, "m", IDLE)]),
        # A busy model keeps what it has.
        (model(last_request_at=RECENTLY), [replica(1), replica(2)], FULL, []),
        # A disabled model gives everything back.
        (model(enabled=False, min_replicas=1), [replica(1), replica(2, ready=False)], FULL,
         [Stop(2, "m", "model disabled"), Drain(1, "m", "model disabled")]),
        # Draining replicas are not this decision's: they neither count nor get retired.
        (model(), [replica(1, draining=True)], FULL, []),
    ],
)  # fmt: skip
def test_one_models_scaling_by_table(
    wanted: ModelScale,
    replicas: list[ReplicaState],
    fleet: Fleet,
    expected: list[ScaleAction],
) -> None:
    assert decide(wanted, replicas, fleet) == expected


def test_a_replica_on_a_draining_node_is_replaced_before_it_is_drained() -> None:
    leaving = replica(1, leaving=True)
    wanted = model(min_replicas=1)
    assert decide(wanted, [leaving], ONE_FREE) == [
        Place(on("a"), "replacing a replica on a draining node")
    ]
    # The replacement is placed but not ready yet: the old one keeps serving.
    assert decide(wanted, [leaving, replica(2, ready=False)], FULL) == []
    # Ready elsewhere: now the old one drains.
    assert decide(wanted, [leaving, replica(2)], FULL) == [Drain(1, "m", "its node is draining")]


def test_a_replica_on_a_draining_node_that_cannot_be_replaced_drains_anyway() -> None:
    leaving = replica(1, leaving=True)
    assert decide(model(min_replicas=1), [leaving], FULL) == [
        NoteUnplaceable(NO_ROOM),
        Drain(1, "m", "its node is draining"),
    ]


def test_eviction_takes_the_least_recently_used_above_its_minimum_that_makes_room() -> None:
    fleet = Fleet(
        (node("a"), node("b"), node("c")),
        (holds(1, "a"), holds(2, "b"), holds(3, "c")),
    )
    replicas = [
        replica(1, "kept", used=NOW - timedelta(hours=5)),  # at its minimum of one
        replica(2, "other", used=NOW - timedelta(hours=3)),
        replica(3, "other", used=NOW - timedelta(hours=4)),
    ]
    actions = decide(model(demand_at=WAITING), replicas, fleet, kept=1, other=0)
    assert actions[-1] == Drain(3, "other", "evicted (idle) to make room for m")


def test_the_fleet_frees_what_an_ignored_replica_holds_and_takes_what_a_new_one_holds() -> None:
    fleet = Fleet((node("a", 2),), (holds(1, "a", gpu=0, port=20000),))
    assert [g.index for g in fleet.capacity()[0].free_gpus] == [1]
    assert fleet.capacity()[0].used_ports == {20000}
    freed = fleet.capacity(ignoring=frozenset({1}))[0]
    assert [g.index for g in freed.free_gpus] == [0, 1] and freed.used_ports == frozenset()
    taken = fleet.holding(2, on("a", 1, 20001)).capacity()[0]
    assert taken.free_gpus == () and taken.used_ports == {20000, 20001}


def test_a_fleet_grown_placement_by_placement_has_the_capacity_of_one_read_whole() -> None:
    """holding() carries the capacity forward instead of recomputing it from every holding:
    after a run of placements (two on one node, one of them a two-shard replica) it must be
    what a fleet built from the same holdings computes, and ignoring a replica still works."""
    grown = Fleet((node("a", 4), node("b", 4), node("c", 1)), (holds(1, "a", gpu=0),))
    assert grown.capacity()  # computed now, before the placements below
    two_shards = Placement(
        (ShardPlacement("a", 0, (1, 2), 20001), ShardPlacement("b", 1, (0, 1), 20000))
    )
    for replica_id, where in [(2, on("c")), (3, two_shards), (4, on("b", 3, 20001))]:
        grown = grown.holding(replica_id, where)
    whole = Fleet(grown.nodes, grown.holdings)
    assert grown.capacity() == whole.capacity()
    assert [[g.index for g in n.free_gpus] for n in grown.capacity()] == [[3], [2], []]
    for replica_id in (1, 3):
        ignoring = frozenset({replica_id})
        assert grown.capacity(ignoring) == whole.capacity(ignoring)


def test_placing_stops_at_the_first_replica_that_does_not_fit() -> None:
    actions = decide(model(min_replicas=3), [], Fleet((node("a", 2),)))
    assert actions == [
        Place(on("a", 0, 20000), "wanted by demand"),
        Place(on("a", 1, 20001), "wanted by demand"),
        NoteUnplaceable(NO_ROOM),
    ]


def test_the_maximum_caps_what_is_placed() -> None:
    capped = model(min_replicas=3, max_replicas=1)
    assert decide(capped, [], Fleet((node("a", 2),))) == [Place(on("a"), "wanted by demand")]
