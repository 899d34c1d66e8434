"""Node health, from heartbeats alone: ready, then unreachable, then lost as they stop.

An agent beats every ``LLMGW_AGENT_HEARTBEAT_INTERVAL`` seconds, but its stream marks
``last_heartbeat_at`` for writing at most every :func:`heartbeat_write_interval` seconds, and
each web process writes what its streams marked in one statement every
:func:`heartbeat_flush_interval`, so a thousand agents cost one or two commits a second, not
hundreds. Health is computed from that
column by the pure :func:`node_health` and applied by :func:`refresh_node_health`, which the
reconciler calls every tick. A node becomes ready again through the agent's own reports
(:mod:`control.agent_reports`), never here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from control.models import Event, Node

logger = logging.getLogger(__name__)

Health = Node.Health


def node_health(
    last_heartbeat_at: datetime | None,
    now: datetime,
    *,
    unreachable_after: float,
    lost_after: float,
) -> str:
    """A node's health from its last heartbeat alone (pure)."""
    if last_heartbeat_at is None:
        return str(Health.NEW)
    age = (now - last_heartbeat_at).total_seconds()
    if age >= lost_after:
        return str(Health.LOST)
    if age >= unreachable_after:
        return str(Health.UNREACHABLE)
    return str(Health.READY)


def heartbeat_write_interval() -> float:
    """How often a stream writes its node's heartbeat: coalesced, but well inside the
    unreachable threshold so a live node can never look late."""
    return float(min(5.0, settings.LLMGW_UNREACHABLE_AFTER / 3))


def heartbeat_flush_interval() -> float:
    """How often a web process writes the heartbeats its streams collected, all in one
    statement: a fraction of the write interval, so the flush adds little to a beat's age."""
    return min(1.0, heartbeat_write_interval() / 2)


@dataclass(frozen=True)
class HealthChange:
    node_id: int
    name: str
    old: str
    new: str


def refresh_node_health(
    now: datetime | None = None, *, heard_from: datetime | None = None
) -> list[HealthChange]:
    """Mark nodes whose heartbeats stopped unreachable, then lost. Returns what changed.

    A compare-and-set on (health, last_heartbeat_at): a heartbeat written between the read
    and the update wins, so a node that just came back is never marked late. Becoming ready
    again is the heartbeat writer's job, not this one's.

    ``heard_from``: when the store could be written to again after an outage. No heartbeat
    could be written before it, so a node's silence counts from then at the earliest: after a
    store outage longer than ``lost_after`` every node would otherwise be lost at once, and
    every replica stopped and placed again, however well the nodes ran through it.
    """
    now = now or timezone.now()
    unreachable_after = float(settings.LLMGW_UNREACHABLE_AFTER)
    lost_after = float(settings.LLMGW_LOST_AFTER)
    changes: list[HealthChange] = []
    if heard_from is not None and heard_from > now - timedelta(seconds=unreachable_after):
        return changes  # nobody can have been silent long enough yet
    late = Node.objects.filter(
        last_heartbeat_at__lt=now - timedelta(seconds=unreachable_after)
    ).exclude(health=Health.LOST)
    for node_id, name, health, last in late.values_list(
        "pk", "name", "health", "last_heartbeat_at"
    ):
        if last is None:  # excluded by the filter; here for the type checker
            continue
        since = last if heard_from is None else max(last, heard_from)
        new = node_health(since, now, unreachable_after=unreachable_after, lost_after=lost_after)
        if new in (health, Health.READY):
            continue
        with transaction.atomic():
            updated = Node.objects.filter(pk=node_id, health=health, last_heartbeat_at=last).update(
                health=new
            )
            if updated:
                age = (now - last).total_seconds()
                Event.objects.create(
                    kind=Event.Kind.NODE,
                    subject=f"node/{name}",
                    message=f"node {new}: no heartbeat for {age:.1f}s",
                    data={"from": health, "to": new},
                )
        if updated:
            logger.warning("node %s is %s (last heartbeat %.1fs ago)", name, new, age)
            changes.append(HealthChange(node_id, name, health, new))
    return changes
