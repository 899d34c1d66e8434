"""Where a replica goes: pure functions over plain data, no database.

A GPU is given whole to at most one shard. A replica has ``shards`` shards on as many distinct
nodes (rank 0 is the head), each needing ``gpus_per_shard`` GPUs with ``gpu_memory_mib`` free on
that one node, and one port from the node's range. Nodes that already hold the model's weights
come first; then ``binpack`` fills the fullest node that fits (keeping whole nodes free for big
models) or ``spread`` the emptiest. When nothing fits, the answer says why in words an operator
can act on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

Strategy = Literal["binpack", "spread"]


@dataclass(frozen=True)
class FreeGpu:
    """A GPU no shard holds, with the memory it has free (total minus what others use)."""

    index: int
    memory_free_mib: int


@dataclass(frozen=True)
class NodeCapacity:
    """What a node can still take. Only schedulable nodes (ready, not cordoned or draining)
    should be passed in; others are listed by the caller in ``unschedulable`` for reasons."""

    name: str
    free_gpus: tuple[FreeGpu, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    used_ports: frozenset[int] = frozenset()
    cached_sources: frozenset[str] = frozenset()
    # The node's own engine port range when its agent reported one; else the caller's default.
    port_range: tuple[int, int] | None = None


@dataclass(frozen=True)
class ReplicaRequest:
    """One replica to place."""

    model: str
    source: str
    gpus_per_shard: int = 1
    shards: int = 1
    gpu_memory_mib: int = 0
    selector: Mapping[str, str] = field(default_factory=dict)
    strategy: Strategy = "binpack"


@dataclass(frozen=True)
class ShardPlacement:
    node: str
    rank: int
    gpu_indices: tuple[int, ...]
    port: int


@dataclass(frozen=True)
class Placement:
    shards: tuple[ShardPlacement, ...]


@dataclass(frozen=True)
class Unplaceable:
    reason: str


def _gib(mib: int) -> str:
    return f"{mib / 1024:g} GiB"


def _fitting_gpus(node: NodeCapacity, need_mib: int) -> list[FreeGpu]:
    """Free GPUs with enough memory, tightest first, so big GPUs stay free for big shards."""
    fitting = [gpu for gpu in node.free_gpus if gpu.memory_free_mib >= need_mib]
    return sorted(fitting, key=lambda gpu: (gpu.memory_free_mib, gpu.index))


def _free_port(node: NodeCapacity, port_range: tuple[int, int]) -> int | None:
    low, high = node.port_range or port_range
    for port in range(low, high + 1):
        if port not in node.used_ports:
            return port
    return None


def _matches(node: NodeCapacity, selector: Mapping[str, str]) -> bool:
    return all(node.labels.get(key) == value for key, value in selector.items())


def _order_key(node: NodeCapacity, request: ReplicaRequest) -> tuple[int, int, str]:
    has_weights = 0 if request.source in node.cached_sources else 1
    free = len(node.free_gpus)
    return (has_weights, free if request.strategy == "binpack" else -free, node.name)


def place(
    nodes: Sequence[NodeCapacity], request: ReplicaRequest, port_range: tuple[int, int]
) -> Placement | Unplaceable:
    """Choose nodes, GPUs and ports for one replica, or say why it cannot be placed."""
    candidates = [node for node in nodes if _matches(node, request.selector)]
    if not nodes:
        return Unplaceable("no schedulable node (none ready, or all cordoned or draining)")
    if not candidates:
        labels = ", ".join(f"{k}={v}" for k, v in sorted(request.selector.items()))
        return Unplaceable(f"no schedulable node has the labels {labels}")

    hosts: list[tuple[NodeCapacity, tuple[int, ...], int]] = []
    port_exhausted: list[str] = []
    for node in sorted(candidates, key=lambda n: _order_key(n, request)):
        gpus = _fitting_gpus(node, request.gpu_memory_mib)
        if len(gpus) < request.gpus_per_shard:
            continue
        port = _free_port(node, port_range)
        if port is None:
            port_exhausted.append(node.name)
            continue
        hosts.append((node, tuple(sorted(g.index for g in gpus[: request.gpus_per_shard])), port))
        if len(hosts) == request.shards:
            return Placement(
                tuple(
                    ShardPlacement(node.name, rank, gpu_indices, port)
                    for rank, (node, gpu_indices, port) in enumerate(hosts)
                )
            )
    return Unplaceable(_explain(candidates, request, hosts, port_exhausted))


def _explain(
    candidates: Sequence[NodeCapacity],
    request: ReplicaRequest,
    hosts: Sequence[tuple[NodeCapacity, tuple[int, ...], int]],
    port_exhausted: Sequence[str],
) -> str:
    each = (
        f"{request.gpus_per_shard}×{_gib(request.gpu_memory_mib)}"
        if request.gpu_memory_mib
        else f"{request.gpus_per_shard} GPU{'s' if request.gpus_per_shard != 1 else ''}"
    )
    if port_exhausted and not hosts:
        return f"no free port in its port range on {', '.join(port_exhausted)}"
    if request.shards > 1:
        have = ", ".join(node.name for node, _, _ in hosts) or "none"
        return (
            f"needs {request.shards} nodes with {each} free each; "
            f"{len(hosts)} {'has' if len(hosts) == 1 else 'have'} it ({have})"
        )
    return f"needs {each} on one node; {_largest_free(candidates, request.gpu_memory_mib)}"


def _largest_free(candidates: Sequence[NodeCapacity], need_mib: int) -> str:
    """The best any one node offers, e.g. "largest free is 1×80 GiB on gpu-3"."""
    with_free = [node for node in candidates if node.free_gpus]
    if not with_free:
        return "no GPU is free on any schedulable node"
    best = max(
        with_free,
        key=lambda n: (
            len(_fitting_gpus(n, need_mib)),
            max(g.memory_free_mib for g in n.free_gpus),
            n.name,
        ),
    )
    fitting = _fitting_gpus(best, need_mib) or [
        max(best.free_gpus, key=lambda g: g.memory_free_mib)
    ]
    largest = max(g.memory_free_mib for g in fitting)
    return f"largest free is {len(fitting)}×{_gib(largest)} on {best.name}"


def reserve(nodes: Sequence[NodeCapacity], placement: Placement) -> list[NodeCapacity]:
    """The capacity left once ``placement`` holds its GPUs and ports (for the next request)."""
    taken: dict[str, ShardPlacement] = {shard.node: shard for shard in placement.shards}
    result = []
    for node in nodes:
        shard = taken.get(node.name)
        if shard is None:
            result.append(node)
            continue
        result.append(
            replace(
                node,
                free_gpus=tuple(g for g in node.free_gpus if g.index not in shard.gpu_indices),
                used_ports=node.used_ports | {shard.port},
            )
        )
    return result


def place_all(
    nodes: Sequence[NodeCapacity],
    requests: Iterable[ReplicaRequest],
    port_range: tuple[int, int],
) -> list[Placement | Unplaceable]:
    """Place requests in order, each seeing the capacity the ones before it took."""
    remaining = list(nodes)
    results: list[Placement | Unplaceable] = []
    for request in requests:
        outcome = place(remaining, request, port_range)
        if isinstance(outcome, Placement):
            remaining = reserve(remaining, outcome)
        results.append(outcome)
    return results
