"""One model's scaling decision, pure: how many replicas to place, which to drain or stop, which
other model's idle replica to evict for it, and in what order. Plain data in, a list of
actions out; the reconciler carries each action out as its own fenced state change.

The order is part of the decision: demand met by a ready replica is forgotten before the
wanted count is taken; replacements are placed before the replicas they replace are drained;
one eviction at a time, only for a model with requests waiting and nothing placed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from functools import cached_property

from control.lifecycle import (
    ModelDemand,
    ReplicaUse,
    eviction_candidates,
    has_waiting_demand,
    surplus_to_stop,
    wanted_replicas,
)
from control.placement import NodeCapacity, Placement, ReplicaRequest, Unplaceable, place, reserve


@dataclass(frozen=True)
class Holding:
    """GPUs and a port one shard of a replica holds on a node, whatever the replica's state,
    until its process has surely ended."""

    replica_id: int
    node: str
    gpu_indices: tuple[int, ...]
    port: int


@dataclass(frozen=True)
class Fleet:
    """Schedulable nodes with every GPU they have, and what replicas hold on them."""

    nodes: tuple[NodeCapacity, ...]
    holdings: tuple[Holding, ...] = ()
    # capacity() with nothing ignored, when already known: see holding().
    known_free: tuple[NodeCapacity, ...] | None = field(default=None, compare=False, repr=False)

    def capacity(self, ignoring: frozenset[int] = frozenset()) -> list[NodeCapacity]:
        """What each node can still take; replicas in ``ignoring`` count as gone (to ask
        "would evicting this one make room?")."""
        if not ignoring:
            return list(self._free)
        return self._capacity(ignoring)

    @cached_property
    def _free(self) -> tuple[NodeCapacity, ...]:
        if self.known_free is not None:
            return self.known_free
        return tuple(self._capacity(frozenset()))

    def _capacity(self, ignoring: frozenset[int]) -> list[NodeCapacity]:
        gpus: dict[str, set[int]] = defaultdict(set)
        ports: dict[str, set[int]] = defaultdict(set)
        for held in self.holdings:
            if held.replica_id not in ignoring:
                gpus[held.node].update(held.gpu_indices)
                ports[held.node].add(held.port)
        # A node that holds nothing is returned as it is: copying every one for every model
        # placed was most of a placing tick (docs/decisions.md, 'placing many replicas in one
        # tick').
        return [
            replace(
                node,
                free_gpus=tuple(g for g in node.free_gpus if g.index not in gpus[node.name]),
                used_ports=node.used_ports | ports[node.name],
            )
            if node.name in ports
            else node
            for node in self.nodes
        ]

    def holding(self, replica_id: int, where: Placement) -> Fleet:
        """The fleet once a new replica holds what ``where`` gave it. Its capacity is this
        one's less what ``where`` takes, not a new pass over every holding: a wave places
        hundreds of replicas in a tick, each on a fleet one placement larger."""
        new = tuple(Holding(replica_id, s.node, s.gpu_indices, s.port) for s in where.shards)
        return replace(
            self, holdings=self.holdings + new, known_free=tuple(reserve(self._free, where))
        )


@dataclass(frozen=True)
class ReplicaState:
    """A replica desired running or draining, as scaling sees it."""

    use: ReplicaUse
    draining: bool
    # Has a shard on a node the operator is draining: to be replaced, then drained.
    leaving: bool = False


@dataclass(frozen=True)
class ModelScale:
    """One catalog entry as scaling sees it."""

    name: str
    demand: ModelDemand
    request: ReplicaRequest


# --------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class SatisfyDemand:
    """A ready replica serves the waiting requests: forget the demand."""


@dataclass(frozen=True)
class Place:
    placement: Placement
    why: str


@dataclass(frozen=True)
class NoteUnplaceable:
    reason: str


@dataclass(frozen=True)
class Drain:
    """Drain a running replica (of ``model``, which may be another model when evicting)."""

    replica_id: int
    model: str
    why: str


@dataclass(frozen=True)
class Stop:
    """Stop a running replica that serves nobody yet."""

    replica_id: int
    model: str
    why: str


ScaleAction = SatisfyDemand | Place | NoteUnplaceable | Drain | Stop


# --------------------------------------------------------------------------- the decision


def scale(
    model: ModelScale,
    replicas: Sequence[ReplicaState],
    fleet: Fleet | Callable[[], Fleet],
    *,
    min_replicas: Mapping[str, int],
    now: datetime,
    port_range: tuple[int, int],
    own: Sequence[ReplicaState] | None = None,
) -> list[ScaleAction]:
    """What to do about ``model`` now. ``replicas`` holds every model's running and draining
    replicas (eviction looks at the others); ``min_replicas`` every model's minimum. ``own``,
    when the caller has them at hand, are those of ``replicas`` that are this model's (at
    hundreds of models, finding them in ``replicas`` for each was a tick's largest loop).
    ``fleet`` may be given as the function that builds it, called only if this model needs
    it: to place, or to evict for."""
    own = [r for r in replicas if r.use.model == model.name] if own is None else own
    mine = [r for r in own if not r.draining]
    leaving = [r for r in mine if r.leaving]
    active = [r for r in mine if not r.leaving]
    actions: list[ScaleAction] = []
    demand = model.demand
    if demand.demand_at is not None and any(r.use.ready for r in mine):
        # The waiting requests are being served from now: that is use, and the idle timeout
        # counts from it (a cold start longer than the idle timeout must not end in a drain).
        actions.append(SatisfyDemand())
        demand = replace(demand, demand_at=None, last_request_at=now)
    wanted = wanted_replicas(demand, len(mine), now)

    placed = 0
    unplaced = ""
    if wanted > len(active):
        fleet = fleet() if callable(fleet) else fleet
        capacity = fleet.capacity()
        why = "replacing a replica on a draining node" if leaving else "wanted by demand"
        for _ in range(wanted - len(active)):
            outcome = place(capacity, model.request, port_range)
            if isinstance(outcome, Unplaceable):
                unplaced = outcome.reason
                break
            actions.append(Place(outcome, why))
            capacity = reserve(capacity, outcome)
            placed += 1

    if unplaced:
        actions.append(NoteUnplaceable(unplaced))
        if not active and not placed and has_waiting_demand(demand, now):
            fleet = fleet() if callable(fleet) else fleet
            victim = _eviction(model, replicas, fleet, min_replicas, port_range)
            if victim is not None:
                why = f"evicted (idle) to make room for {model.name}"
                actions.append(Drain(victim.replica_id, victim.model, why))

    # Drain leaving replicas once enough others are ready, or when none can replace them.
    ready_elsewhere = sum(1 for r in active if r.use.ready)
    if unplaced or ready_elsewhere >= min(wanted, len(mine)):
        actions.extend(Drain(r.use.replica_id, model.name, "its node is draining") for r in leaving)

    # Replicas placed just now are not counted: placing happens only below the wanted count.
    why = "model disabled" if not demand.enabled else "idle: scaling down"
    for surplus in surplus_to_stop([r.use for r in active], wanted):
        retire = Drain if surplus.ready else Stop
        actions.append(retire(surplus.replica_id, model.name, why))
    return actions


def _eviction(
    model: ModelScale,
    replicas: Sequence[ReplicaState],
    fleet: Fleet,
    min_replicas: Mapping[str, int],
    port_range: tuple[int, int],
) -> ReplicaUse | None:
    """The idle replica of another model (unpinned, above its minimum, least recently used
    first) whose GPUs would let ``model`` be placed. One eviction at a time: while a drain is
    in progress its GPUs are not free yet, and evicting more would overshoot."""
    if any(r.draining for r in replicas):
        return None
    running = [r.use for r in replicas if not r.draining]
    per_model: dict[str, int] = defaultdict(int)
    for use in running:
        per_model[use.model] += 1
    evictable = [u for u in running if per_model[u.model] > min_replicas.get(u.model, 0)]
    for candidate in eviction_candidates(evictable, model.name):
        freed = fleet.capacity(ignoring=frozenset({candidate.replica_id}))
        if isinstance(place(freed, model.request, port_range), Placement):
            return candidate
    return None
