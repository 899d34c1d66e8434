"""Placement is pure: plain data in, plain data out, tested without a database."""

from __future__ import annotations

import itertools

import pytest

from control.placement import (
    FreeGpu,
    NodeCapacity,
    Placement,
    ReplicaRequest,
    ShardPlacement,
    Unplaceable,
    place,
    place_all,
    reserve,
)

PORTS = (20000, 20009)
GIB = 1024


def node(name: str, *free_mib: int, **kwargs: object) -> NodeCapacity:
    gpus = tuple(FreeGpu(i, mib) for i, mib in enumerate(free_mib))
    return NodeCapacity(name, gpus, **kwargs)  # type: ignore[arg-type]


def test_single_gpu_replica_goes_to_the_fullest_node_that_fits_when_binpacking() -> None:
    nodes = [node("a", 80 * GIB, 80 * GIB), node("b", 80 * GIB)]
    result = place(nodes, ReplicaRequest("m", "org/m", gpu_memory_mib=40 * GIB), PORTS)
    assert result == Placement((ShardPlacement("b", 0, (0,), 20000),))


def test_spread_prefers_the_emptiest_node() -> None:
    nodes = [node("a", 80 * GIB, 80 * GIB), node("b", 80 * GIB)]
    result = place(nodes, ReplicaRequest("m", "org/m", strategy="spread"), PORTS)
    assert isinstance(result, Placement) and result.shards[0].node == "a"


def test_nodes_holding_the_weights_come_first() -> None:
    nodes = [
        node("a", 80 * GIB),
        node("b", 80 * GIB, 80 * GIB, cached_sources=frozenset({"org/m"})),
    ]
    result = place(nodes, ReplicaRequest("m", "org/m"), PORTS)
    assert isinstance(result, Placement) and result.shards[0].node == "b"


def test_multi_gpu_shard_takes_gpus_on_one_node_with_enough_memory_each() -> None:
    nodes = [node("a", 80 * GIB, 24 * GIB, 80 * GIB), node("b", 80 * GIB)]
    request = ReplicaRequest("m", "org/m", gpus_per_shard=2, gpu_memory_mib=70 * GIB)
    assert place(nodes, request, PORTS) == Placement((ShardPlacement("a", 0, (0, 2), 20000),))


def test_reason_names_what_is_needed_and_the_largest_free() -> None:
    nodes = [node("gpu-3", 80 * GIB), node("gpu-4", 40 * GIB, 40 * GIB)]
    request = ReplicaRequest("m", "org/m", gpus_per_shard=2, gpu_memory_mib=80 * GIB)
    assert place(nodes, request, PORTS) == Unplaceable(
        "needs 2×80 GiB on one node; largest free is 1×80 GiB on gpu-3"
    )


def test_reason_when_no_gpu_is_free_anywhere() -> None:
    result = place([node("a"), node("b")], ReplicaRequest("m", "org/m"), PORTS)
    assert result == Unplaceable("needs 1 GPU on one node; no GPU is free on any schedulable node")


def test_reason_when_no_node_is_schedulable() -> None:
    result = place([], ReplicaRequest("m", "org/m"), PORTS)
    assert isinstance(result, Unplaceable) and "no schedulable node" in result.reason


def test_selector_limits_nodes_and_explains_a_miss() -> None:
    nodes = [
        node("a", 80 * GIB, labels={"gpu": "a100"}),
        node("b", 80 * GIB, labels={"gpu": "h100"}),
    ]
    hit = place(nodes, ReplicaRequest("m", "org/m", selector={"gpu": "h100"}), PORTS)
    assert isinstance(hit, Placement) and hit.shards[0].node == "b"
    miss = place(nodes, ReplicaRequest("m", "org/m", selector={"gpu": "b200"}), PORTS)
    assert miss == Unplaceable("no schedulable node has the labels gpu=b200")


def test_multi_node_replica_gets_one_shard_per_node_with_ranks() -> None:
    nodes = [node("a", 80 * GIB), node("b", 80 * GIB), node("c")]
    result = place(nodes, ReplicaRequest("m", "org/m", shards=2), PORTS)
    assert result == Placement(
        (ShardPlacement("a", 0, (0,), 20000), ShardPlacement("b", 1, (0,), 20000))
    )


def test_multi_node_reason_counts_the_nodes_that_fit() -> None:
    nodes = [node("a", 80 * GIB), node("b", 20 * GIB)]
    request = ReplicaRequest("m", "org/m", shards=2, gpu_memory_mib=40 * GIB)
    assert place(nodes, request, PORTS) == Unplaceable(
        "needs 2 nodes with 1×40 GiB free each; 1 has it (a)"
    )


def test_ports_skip_those_in_use_and_run_out_with_a_reason() -> None:
    used = frozenset(range(20000, 20005))
    result = place([node("a", GIB, used_ports=used)], ReplicaRequest("m", "org/m"), PORTS)
    assert isinstance(result, Placement) and result.shards[0].port == 20005
    full = frozenset(range(20000, 20010))
    result = place([node("a", GIB, used_ports=full)], ReplicaRequest("m", "org/m"), PORTS)
    assert result == Unplaceable("no free port in its port range on a")
    own_range = NodeCapacity("b", (FreeGpu(0, GIB),), used_ports=full, port_range=(21000, 21001))
    result = place([own_range], ReplicaRequest("m", "org/m"), PORTS)
    assert isinstance(result, Placement) and result.shards[0].port == 21000


def test_cpu_only_profiles_need_no_gpu() -> None:
    result = place([node("cpu")], ReplicaRequest("m", "org/m", gpus_per_shard=0), PORTS)
    assert result == Placement((ShardPlacement("cpu", 0, (), 20000),))


def test_reserve_removes_taken_gpus_and_ports() -> None:
    nodes = [node("a", GIB, GIB)]
    placement = Placement((ShardPlacement("a", 0, (1,), 20003),))
    (left,) = reserve(nodes, placement)
    assert [g.index for g in left.free_gpus] == [0]
    assert 20003 in left.used_ports


@pytest.mark.parametrize("strategy", ["binpack", "spread"])
def test_place_all_never_gives_a_gpu_or_port_to_two_shards(strategy: str) -> None:
    """Exhaustive over small fleets: every mix of requests, no double allocation, ever."""
    fleets = [
        [node("a", 80 * GIB, 80 * GIB), node("b", 40 * GIB, 80 * GIB, 80 * GIB)],
        [node("a", 24 * GIB), node("b", 80 * GIB), node("c", 80 * GIB, 80 * GIB)],
    ]
    shapes = [(1, 1, 0), (2, 1, 70 * GIB), (1, 2, 40 * GIB), (1, 1, 60 * GIB), (0, 1, 0)]
    for fleet in fleets:
        for combo in itertools.product(shapes, repeat=4):
            requests = [
                ReplicaRequest(f"m{i}", "src", g, s, mem, strategy=strategy)  # type: ignore[arg-type]
                for i, (g, s, mem) in enumerate(combo)
            ]
            taken_gpus: set[tuple[str, int]] = set()
            taken_ports: set[tuple[str, int]] = set()
            free = {(n.name, g.index): g.memory_free_mib for n in fleet for g in n.free_gpus}
            for request, outcome in zip(requests, place_all(fleet, requests, PORTS), strict=True):
                if isinstance(outcome, Unplaceable):
                    continue
                assert len(outcome.shards) == request.shards
                assert len({s.node for s in outcome.shards}) == request.shards
                for shard in outcome.shards:
                    assert len(shard.gpu_indices) == request.gpus_per_shard
                    for index in shard.gpu_indices:
                        assert (shard.node, index) not in taken_gpus
                        assert free[(shard.node, index)] >= request.gpu_memory_mib
                        taken_gpus.add((shard.node, index))
                    assert (shard.node, shard.port) not in taken_ports
                    taken_ports.add((shard.node, shard.port))
