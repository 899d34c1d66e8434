"""Nodes: their tokens, what their agents report, their health, and their desired state.

One function per state change, each in one transaction with conditional updates; nudges to
the agent streams go out through the channel layer only after commit. Transports (the
WebSocket consumer today, gRPC later) call these through :mod:`control.agent_sessions`.

Heartbeats: an agent beats every ``LLMGW_AGENT_HEARTBEAT_INTERVAL`` seconds, but the session
writes ``last_heartbeat_at`` at most every :func:`heartbeat_write_interval` seconds per node,
so a thousand agents cost a few writes a second, not a write per message. Health is computed
from that column by the pure :func:`node_health` and applied by :func:`refresh_node_health`,
which the reconciler calls every tick.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from agents.protocol import (
    TOKEN_PREFIX,
    DesiredShard,
    DesiredShardState,
    DesiredState,
    Engine,
    GpuInfo,
    Hello,
    ShardStatus,
    WeightsReport,
)
from control import leases
from control.models import Event, Gpu, Node, Replica, Shard
from llmgw_site import metrics

logger = logging.getLogger(__name__)

Health = Node.Health
Observed = Replica.Observed

TOKEN_VISIBLE_CHARS: Final = len(TOKEN_PREFIX) + 6
MAX_TOKEN_LENGTH: Final = 200

# Channel-layer message types the agent consumer handles (dots become underscores).
DESIRED_CHANGED: Final = "desired.changed"
TOKEN_REVOKED: Final = "token.revoked"  # noqa: S105 - a message type, not a secret
SESSION_TAKEOVER: Final = "session.takeover"


def node_group(node_id: int) -> str:
    """The channel-layer group of every stream held for one node."""
    return f"llmgw.node.{node_id}"


# --------------------------------------------------------------------------- tokens


def hash_token(token: str) -> str:
    """A node token has 256 bits of entropy, so one SHA-256 is enough: nothing to brute-force,
    and a lookup by hash takes no time that depends on the secret."""
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class NodeIdentity:
    """Who is on the other end of a stream, as its token proved."""

    id: int
    name: str


class TokenRejected(Exception):
    """The handshake's token is missing, unknown or revoked, or claims another node."""


def issue_node_token(name: str) -> str:
    """A new token for node ``name`` (created if new), replacing any earlier one.

    Returned once; only its hash and visible prefix are kept. Streams holding the old token
    are closed after commit, so a leaked token stops working at once when re-issued.
    """
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    with transaction.atomic():
        node, created = Node.objects.get_or_create(name=name)
        Node.objects.filter(pk=node.pk).update(
            token_hash=hash_token(token),
            token_prefix=token[:TOKEN_VISIBLE_CHARS],
            token_issued_at=timezone.now(),
        )
        Event.objects.create(
            kind=Event.Kind.NODE,
            subject=f"node/{name}",
            message=f"node token issued ({token[:TOKEN_VISIBLE_CHARS]}…)"
            + (", node registered" if created else ", the previous token no longer works"),
        )
        if not created:
            _send_on_commit(node.pk, TOKEN_REVOKED)
    return token


def revoke_node_token(name: str) -> bool:
    """Revoke a node's token; its streams are closed after commit. False: nothing to revoke."""
    with transaction.atomic():
        node = Node.objects.filter(name=name).only("pk").first()
        if node is None:
            return False
        revoked = (
            Node.objects.filter(pk=node.pk)
            .exclude(token_hash="")
            .update(token_hash="", token_prefix="")
        )
        if revoked:
            Event.objects.create(
                kind=Event.Kind.NODE, subject=f"node/{name}", message="node token revoked"
            )
            _send_on_commit(node.pk, TOKEN_REVOKED)
    return bool(revoked)


def authenticate(token: str, claimed_node: str | None) -> NodeIdentity:
    """The node a token belongs to. Raises :class:`TokenRejected` with a reason for the log
    (never containing the token)."""
    if not token:
        raise TokenRejected("no node token")
    if not token.startswith(TOKEN_PREFIX) or len(token) > MAX_TOKEN_LENGTH:
        raise TokenRejected("not a node token")
    row = Node.objects.filter(token_hash=hash_token(token)).values_list("pk", "name").first()
    if row is None:
        raise TokenRejected("unknown or revoked node token")
    identity = NodeIdentity(id=row[0], name=row[1])
    if claimed_node is not None and claimed_node != identity.name:
        raise TokenRejected(f"the token of node {identity.name!r} claims node {claimed_node!r}")
    return identity


# --------------------------------------------------------------------------- nudges


def nudge_node(node_id: int) -> None:
    """Say "node N's desired state changed". Call inside the transaction that changed it.

    Bumps the node's desired revision now and tells its streams after commit; a nudge lost on
    the way (channel layer down, another process without Redis) is repaired by the periodic
    resync, because the stream re-reads everything from the database either way.
    """
    Node.objects.filter(pk=node_id).update(desired_revision=F("desired_revision") + 1)
    _send_on_commit(node_id, DESIRED_CHANGED)


def _send_on_commit(node_id: int, message_type: str, **extra: Any) -> None:
    transaction.on_commit(lambda: send_to_node(node_id, message_type, **extra))


def send_to_node(node_id: int, message_type: str, **extra: Any) -> bool:
    """Best effort: a channel layer that is down must never fail the caller's work."""
    layer = get_channel_layer()
    if layer is None:
        return False
    try:
        async_to_sync(layer.group_send)(node_group(node_id), {"type": message_type, **extra})
    except Exception as exc:
        logger.warning(
            "node %s: %s not delivered through the channel layer (%s); the periodic resync "
            "will deliver the change",
            node_id,
            message_type,
            type(exc).__name__,
        )
        return False
    return True


# --------------------------------------------------------------------------- health


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


@dataclass(frozen=True)
class HealthChange:
    node_id: int
    name: str
    old: str
    new: str


def refresh_node_health(now: datetime | None = None) -> list[HealthChange]:
    """Mark nodes whose heartbeats stopped unreachable, then lost. Returns what changed.

    A compare-and-set on (health, last_heartbeat_at): a heartbeat written between the read
    and the update wins, so a node that just came back is never marked late. Becoming ready
    again is the heartbeat writer's job, not this one's.
    """
    now = now or timezone.now()
    unreachable_after = float(settings.LLMGW_UNREACHABLE_AFTER)
    lost_after = float(settings.LLMGW_LOST_AFTER)
    changes: list[HealthChange] = []
    late = Node.objects.filter(
        last_heartbeat_at__lt=now - timedelta(seconds=unreachable_after)
    ).exclude(health=Health.LOST)
    for node_id, name, health, last in late.values_list(
        "pk", "name", "health", "last_heartbeat_at"
    ):
        if last is None:  # excluded by the filter; here for the type checker
            continue
        new = node_health(last, now, unreachable_after=unreachable_after, lost_after=lost_after)
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


# --------------------------------------------------------------------------- agent reports


def register_hello(node_id: int, hello: Hello) -> None:
    """Record who connected: addresses, agent version, GPUs; the node is ready from now."""
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
        )
        _store_gpus(node_id, hello.gpus, now, prune=True)
        if was != Health.READY or restarted or not node.boot_id:
            what = "agent restarted" if restarted else f"connected (was {was})"
            Event.objects.create(
                kind=Event.Kind.NODE,
                subject=f"node/{node.name}",
                message=f"node {what}: agent {hello.agent_version}, {len(hello.gpus)} GPU(s), "
                f"addresses {', '.join(hello.addresses) or 'none'}",
                data={"boot_id": hello.boot_id},
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
    """The node is alive now. The caller coalesces (see the module docstring)."""
    now = timezone.now()
    with transaction.atomic():
        Node.objects.filter(pk=node_id).update(last_heartbeat_at=now)
        back = (
            Node.objects.filter(pk=node_id).exclude(health=Health.READY).update(health=Health.READY)
        )
        if back:
            name = Node.objects.filter(pk=node_id).values_list("name", flat=True).first()
            Event.objects.create(
                kind=Event.Kind.NODE, subject=f"node/{name}", message="node ready: heartbeats back"
            )
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
            updated = Shard.objects.filter(
                pk=report.shard_id,
                node_id=node_id,
                replica_id=report.replica_id,
                replica__generation=report.generation,
            ).update(
                observed=report.state.value,
                exit_code=report.exit_code,
                failure_class=report.failure_class.value,
                message=report.message[:500],
                last_log="\n".join(report.log_tail),
                requests_running=report.requests_running,
                requests_waiting=report.requests_waiting,
                updated_at=now,
            )
            if updated:
                touched.add(report.replica_id)
                if report.state.value == Observed.FAILED:
                    Event.objects.create(
                        kind=Event.Kind.LIFECYCLE,
                        subject=f"replica/{report.replica_id}",
                        message=f"shard {report.shard_id} on {name} failed "
                        f"({report.failure_class.value or 'unknown'}): {report.message}",
                        data={"exit_code": report.exit_code, "node": name},
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
    if report.stale_rejected is not None:
        changes["stale_desired_rejected"] = report.stale_rejected
        if report.stale_rejected:
            Event.objects.create(
                kind=Event.Kind.NODE,
                subject=f"node/{name}",
                message=f"agent rejected a desired state from a deposed leader (lower epoch); "
                f"{report.stale_rejected} so far",
            )
    if report.weights is not None:
        changes["weights_report"] = [w.to_dict() for w in report.weights]
        for item in report.weights:
            if item.state.value in ("refused", "removed"):
                Event.objects.create(
                    kind=Event.Kind.NODE,
                    subject=f"node/{name}",
                    message=f"weights {item.name} {item.state.value}: {item.message}",
                )
    if changes:
        Node.objects.filter(pk=node_id).update(**changes)
    if report.gpus is not None:
        _store_gpus(node_id, report.gpus, now, prune=False)


# --------------------------------------------------------------------------- desired state


def desired_revision(node_id: int) -> int | None:
    """The revision of a node's desired state (None: the node is gone)."""
    return Node.objects.filter(pk=node_id).values_list("desired_revision", flat=True).first()


def current_epoch() -> int:
    """The leader epoch desired state is stamped with (0 with leader election off)."""
    if not leases.election_enabled():
        return 0
    view = leases.read()
    return view.epoch if view is not None else 0


def build_desired_state(node_id: int) -> DesiredState:
    """The node's full desired state, read from the database (the one source of truth)."""
    with transaction.atomic():
        node = Node.objects.only("name", "desired_revision", "remove_weights").get(pk=node_id)
        shards = list(
            Shard.objects.filter(node_id=node_id)
            .select_related("replica__model", "replica__profile")
            .order_by("pk")
        )
        multi = [s.replica_id for s in shards if s.replica.profile.shards_per_replica > 1]
        heads = {
            head.replica_id: head
            for head in Shard.objects.filter(replica_id__in=multi, rank=0).select_related("node")
        }
        epoch = current_epoch()
    drain_timeout = float(settings.LLMGW_DRAIN_TIMEOUT)
    out: list[DesiredShard] = []
    for shard in shards:
        replica = shard.replica
        if replica.desired == Replica.Desired.STOPPED and shard.observed in (
            Observed.STOPPED,
            Observed.FAILED,
            Observed.PENDING,
        ):
            continue  # nothing runs that would need stopping; leave it out of the snapshot
        profile = replica.profile
        head = heads.get(replica.pk)
        out.append(
            DesiredShard(
                shard_id=shard.pk,
                replica_id=replica.pk,
                generation=replica.generation,
                state=DesiredShardState(str(replica.desired)),
                engine=Engine(str(profile.engine)),
                model=replica.model.name,
                source=replica.model.source,
                port=shard.port,
                args=tuple(str(a) for a in (profile.args or [])),
                env={str(k): str(v) for k, v in (profile.env or {}).items()},
                gpu_indices=tuple(int(i) for i in (shard.gpu_indices or [])),
                rank=shard.rank,
                world_size=profile.shards_per_replica,
                head_address=(head.node.addresses or [""])[0] if head is not None else "",
                head_port=head.port if head is not None else 0,
                health_path=profile.health_path,
                startup_timeout_s=float(profile.startup_timeout_s),
                drain_timeout_s=drain_timeout,
            )
        )
    return DesiredState(
        node=node.name,
        epoch=epoch,
        revision=node.desired_revision,
        shards=tuple(out),
        remove_weights=tuple(str(w) for w in (node.remove_weights or [])),
    )
