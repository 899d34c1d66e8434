"""Pure decisions of the reconciler: how many replicas a model wants, when a failed replica
may restart, which replicas go first when scaling down or making room. Plain data in and out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta


def backoff_seconds(failures: int, base: float, cap: float) -> float:
    """Exponential backoff after the ``failures``-th failure in a row: base, 2·base, 4·base…"""
    if failures <= 0:
        return 0.0
    return float(min(cap, base * 2 ** min(failures - 1, 30)))


@dataclass(frozen=True)
class ModelDemand:
    """What the reconciler knows about one catalog entry's traffic."""

    enabled: bool
    min_replicas: int
    max_replicas: int
    idle_timeout: timedelta
    activation_timeout: timedelta
    last_request_at: datetime | None
    demand_at: datetime | None
    # Requests in flight on its replicas now (the gateway's count and the engines' own).
    requests_in_flight: int = 0


def is_busy(model: ModelDemand, now: datetime) -> bool:
    """A request is in flight, or one started or finished within its idle timeout. "Idle"
    counts from the end of the last request, never from its start: a generation longer than
    the idle timeout keeps its model."""
    if model.requests_in_flight > 0:
        return True
    return model.last_request_at is not None and now - model.last_request_at < model.idle_timeout


def has_waiting_demand(model: ModelDemand, now: datetime) -> bool:
    """A request found no ready replica recently enough that it may still be waiting."""
    return model.demand_at is not None and now - model.demand_at < model.activation_timeout


def wanted_replicas(model: ModelDemand, active: int, now: datetime) -> int:
    """How many replicas the model should run now.

    At least ``min_replicas``; at least one while a request waits for it (scale from zero); a
    model used within its idle timeout keeps what it has (no scale-down while busy); never
    above ``max_replicas``. Traffic alone never adds a replica: a model evicted to make room
    comes back when a request next finds it cold.
    """
    if not model.enabled or model.max_replicas == 0:
        return 0
    wanted = model.min_replicas
    if has_waiting_demand(model, now):
        wanted = max(wanted, 1)
    if is_busy(model, now):
        wanted = max(wanted, active)
    return min(wanted, model.max_replicas)


@dataclass(frozen=True)
class ReplicaUse:
    """A running replica as scale-down and eviction see it."""

    replica_id: int
    model: str
    ready: bool
    pinned: bool
    in_flight: int
    last_request_at: datetime | None


def _least_recently_used(replica: ReplicaUse) -> tuple[bool, float]:
    # Never-used sorts first; a datetime's timestamp orders the rest oldest first.
    used = replica.last_request_at
    return (used is not None, used.timestamp() if used else 0.0)


def surplus_to_stop(replicas: Sequence[ReplicaUse], wanted: int) -> list[ReplicaUse]:
    """Which of one model's replicas to stop to get down to ``wanted``: ones not yet ready
    first (they serve nobody), then least recently used. A replica with a request in flight
    is never chosen: the model stays above ``wanted`` until it finishes."""
    surplus = len(replicas) - wanted
    if surplus <= 0:
        return []
    idle = [r for r in replicas if r.in_flight == 0]
    ordered = sorted(idle, key=lambda r: (r.ready, *_least_recently_used(r), r.replica_id))
    return ordered[:surplus]


def eviction_candidates(replicas: Sequence[ReplicaUse], for_model: str) -> list[ReplicaUse]:
    """Replicas that may be stopped to make room for ``for_model``'s demand: other models',
    unpinned, idle (no request in flight), least recently used first. The caller passes only
    replicas above their model's minimum, or the reconciler would fight itself."""
    candidates = [r for r in replicas if r.model != for_model and not r.pinned and r.in_flight == 0]
    return sorted(candidates, key=lambda r: (*_least_recently_used(r), r.replica_id))
