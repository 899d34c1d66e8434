"""What agents report, written to the store: hello, heartbeats, and status (shards, engine
load, GPUs, weights, stale desired states refused).

Each report is one transaction. A shard's row changes only for the generation of the replica
it belongs to and only on the node that runs it, so a late word about a process the
reconciler already replaced changes nothing. A replica's observed state is computed from its
shards' by the pure :func:`replica_observed`. Sessions coalesce what they write (see
:mod:`control.agent_sessions`); the functions here write what they are given.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from agents.protocol.messages import GpuInfo, Hello, ShardStatus, WeightsReport
from control.models import Event, Gpu, Node, Replica, Shard
from telemetry import metrics

logger = logging.getLogger(__name__)

Health = Node.Health
Observed = Replica.Observed


def agent_event(
    node: str, now: datetime, /, *, kind: str, subject: str, message: str, **data: Any
) -> bool:
    """Write an Event a node's report caused, unless that node has written
    ``LLMGW_NODE_EVENTS_PER_MINUTE`` of them in the last minute: however its agent behaves,
    one node cannot flood the audit log. The first event past the cap says that the rest of
    the minute's are dropped. Returns whether the event was written."""
    cap = int(settings.LLMGW_NODE_EVENTS_PER_MINUTE)
    recent = Event.objects.filter(
        created_at__gte=now - timedelta(minutes=1), data__reported_by=node
    ).count()
    if recent > cap:
        return False
    if recent == cap:
        kind, subject = Event.Kind.NODE, f"node/{node}"
        message = (
            f"node {node} caused more than {cap} events in a minute; its further events are "
            "dropped until the rate falls"
        )
        data = {}
        logger.warning("node %s: event cap of %s a minute reached", node, cap)
    Event.objects.create(
        created_at=now,
        kind=kind,
        subject=subject,
        message=message,
        data={**data, "reported_by": node},
    )
    return recent < cap


def register_hello(node_id: int, hello: Hello, *, over_loopback: bool = False) -> None:
    """Record who connected: addresses, agent version, GPUs, whether its stream came over
    loopback; the node is ready from now."""
    now = timezone.now()
    with transaction.atomic():
        node = Node.objects.select_for_update().get(pk=node_id)
        restarted = bool(node.boot_id) and node.boot_id != hello.boot_id
        was = node.health
        Node.objects.filter(pk=node_id).update(
            addresses=list(hello.addresses),
            agent_version=hello.agent_version,
            boot_id=hello.boot_id,
            last_heartbeat_at=now,
            health=Health.READY,
            port_min=hello.port_range[0] if hello.port_range else None,
            port_max=hello.port_range[1] if hello.port_range else None,
            agent_epoch=hello.highest_epoch,
            connected_over_loopback=over_loopback,
        )
        _store_gpus(node_id, hello.gpus, now, prune=True)
        if was != Health.READY or restarted or not node.boot_id:
            what = "agent restarted" if restarted else f"connected (was {was})"
            agent_event(
                node.name,
                now,
                kind=Event.Kind.NODE,
                subject=f"node/{node.name}",
                message=f"node {what}: agent {hello.agent_version}, {len(hello.gpus)} GPU(s), "
                f"addresses {', '.join(hello.addresses) or 'none'}",
                boot_id=hello.boot_id,
            )
    logger.info(
        "node %s connected: agent %s, %d GPU(s), addresses %s",
        node.name,
        hello.agent_version,
        len(hello.gpus),
        ",".join(hello.addresses),
    )


def _store_gpus(node_id: int, gpus: Sequence[GpuInfo], now: datetime, *, prune: bool) -> None:
    existing = {g.index: g for g in Gpu.objects.filter(node_id=node_id)}
    for info in gpus:
        row = existing.get(info.index)
        values = {
            "uuid": info.uuid,
            "model": info.model,
            "memory_total_mib": info.memory_total_mib,
            "memory_used_mib": info.memory_used_mib,
        }
        if row is None:
            Gpu.objects.create(node_id=node_id, index=info.index, updated_at=now, **values)
        elif any(getattr(row, k) != v for k, v in values.items()):
            Gpu.objects.filter(pk=row.pk).update(updated_at=now, **values)
    if prune:
        Gpu.objects.filter(node_id=node_id).exclude(index__in=[g.index for g in gpus]).delete()


def record_heartbeat(node_id: int) -> None:
    """The node is alive now. The caller coalesces: see
    :func:`control.health.heartbeat_write_interval`."""
    record_heartbeats([node_id])


def record_heartbeats(node_ids: Collection[int]) -> None:
    """These nodes are alive now: one statement for all of them (a web process writes the
    heartbeats of every stream it holds together, see :class:`control.health.HeartbeatWriter`).
    Nodes that were not ready are ready again, each with its event."""
    if not node_ids:
        return
    now = timezone.now()
    ids = sorted(set(node_ids))
    with transaction.atomic():
        Node.objects.filter(pk__in=ids).update(last_heartbeat_at=now)
        late = Node.objects.filter(pk__in=ids).exclude(health=Health.READY)
        # Locked, so a node another writer makes ready meanwhile gets one event, not two.
        back = list(late.select_for_update().values_list("pk", "name"))
        if back:
            Node.objects.filter(pk__in=[pk for pk, _ in back]).update(health=Health.READY)
            for _, name in back:
                agent_event(
                    name,
                    now,
                    kind=Event.Kind.NODE,
                    subject=f"node/{name}",
                    message="node ready: heartbeats back",
                )
    for _, name in back:
        logger.info("node %s ready again: heartbeats back", name)


def replica_observed(shard_states: Iterable[str]) -> str:
    """A replica's observed state from its shards' (pure): ready only when all are."""
    states = list(shard_states)
    if not states:
        return str(Observed.PENDING)
    if Observed.FAILED in states:
        return str(Observed.FAILED)
    if all(s == Observed.READY for s in states):
        return str(Observed.READY)
    if Observed.DRAINING in states:
        return str(Observed.DRAINING)
    if all(s == Observed.STOPPED for s in states):
        return str(Observed.STOPPED)
    if Observed.STARTING in states or Observed.READY in states:
        return str(Observed.STARTING)
    return str(Observed.PENDING)


@dataclass(frozen=True)
class NodeReport:
    """The node-level part of a status that changed since it was last written."""

    observed_revision: int | None = None
    stale_rejected: int | None = None
    weights: tuple[WeightsReport, ...] | None = None
    gpus: tuple[GpuInfo, ...] | None = None


def record_status(
    node_id: int,
    shards: Sequence[ShardStatus],
    node: NodeReport,
) -> None:
    """Write what an agent observed, in one transaction.

    ``shards`` holds only shards whose report changed. A report for an older generation
    of a replica (a late word about a process the reconciler already replaced) or for a
    shard of another node changes nothing.
    """
    now = timezone.now()
    with transaction.atomic():
        name = Node.objects.filter(pk=node_id).values_list("name", flat=True).first()
        touched: set[int] = set()
        for report in shards:
            row = Shard.objects.filter(
                pk=report.shard_id,
                node_id=node_id,
                replica_id=report.replica_id,
                replica__generation=report.generation,
            )
            # An event only for a change: a failure reported again (a reconnect re-sends
            # every shard) is not a second failure.
            before = row.values_list("observed", "exit_code", "message").first()
            updated = row.update(
                observed=report.state.value,
                exit_code=report.exit_code,
                failure_class=report.failure_class.value,
                message=report.message[:500],
                last_log="\n".join(report.log_tail),
                requests_running=report.requests_running,
                requests_waiting=report.requests_waiting,
                cache_tokens=report.cache_tokens,
                updated_at=now,
            )
            if updated:
                touched.add(report.replica_id)
                now_is = (report.state.value, report.exit_code, report.message[:500])
                if report.state.value == Observed.FAILED and before != now_is:
                    agent_event(
                        str(name),
                        now,
                        kind=Event.Kind.LIFECYCLE,
                        subject=f"replica/{report.replica_id}",
                        message=f"shard {report.shard_id} on {name} failed "
                        f"({report.failure_class.value or 'unknown'}): {report.message}",
                        exit_code=report.exit_code,
                        node=name,
                    )
        for replica_id in sorted(touched):
            _refresh_replica(replica_id, now)
        _record_node_report(node_id, name or "?", node, now)


def _refresh_replica(replica_id: int, now: datetime) -> None:
    # Lock the replica first: two agents of one multi-node replica report at once, and each
    # must compute the aggregate from the other's committed shard state.
    replica = (
        Replica.objects.select_for_update(of=("self",))
        .select_related("model")
        .filter(pk=replica_id)
        .first()
    )
    if replica is None:
        return
    rows = list(
        Shard.objects.filter(replica_id=replica_id).values_list("observed", "failure_class")
    )
    observed = replica_observed(state for state, _ in rows)
    if observed == replica.observed:
        return
    failure = next((fc for state, fc in rows if state == Observed.FAILED and fc), "")
    changes: dict[str, Any] = {"observed": observed}
    if observed == Observed.READY:
        changes.update(ready_at=now, failure_class="")
        if replica.ready_at is None:
            cold_start = (now - replica.created_at).total_seconds()
            model = str(replica.model.name)
            transaction.on_commit(lambda: metrics.observe_cold_start(model, cold_start))
    if observed == Observed.FAILED:
        changes.update(failure_class=failure, failures=F("failures") + 1)
    Replica.objects.filter(pk=replica_id, observed=replica.observed).update(**changes)


def _record_node_report(node_id: int, name: str, report: NodeReport, now: datetime) -> None:
    changes: dict[str, Any] = {}
    if report.observed_revision is not None:
        changes["observed_revision"] = report.observed_revision
    stored = (
        Node.objects.filter(pk=node_id)
        .values_list("stale_desired_rejected", "weights_report")
        .first()
    ) or (0, [])
    if report.stale_rejected is not None:
        changes["stale_desired_rejected"] = report.stale_rejected
        if report.stale_rejected and report.stale_rejected != stored[0]:
            agent_event(
                name,
                now,
                kind=Event.Kind.NODE,
                subject=f"node/{name}",
                message=f"agent rejected a desired state from a deposed leader (lower epoch); "
                f"{report.stale_rejected} so far",
            )
    if report.weights is not None:
        changes["weights_report"] = [w.to_dict() for w in report.weights]
        # Only entries whose outcome changed: an unchanged list re-sent costs no event.
        known = {
            (str(w.get("name")), str(w.get("state")), str(w.get("message")))
            for w in (stored[1] or [])
            if isinstance(w, dict)
        }
        for item in report.weights:
            if item.state.value in ("refused", "removed") and (
                (item.name, item.state.value, item.message) not in known
            ):
                agent_event(
                    name,
                    now,
                    kind=Event.Kind.NODE,
                    subject=f"node/{name}",
                    message=f"weights {item.name} {item.state.value}: {item.message}",
                )
    if changes:
        Node.objects.filter(pk=node_id).update(**changes)
    if report.gpus is not None:
        _store_gpus(node_id, report.gpus, now, prune=False)
