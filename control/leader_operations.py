"""What the leader's reconciler does to the fleet: place a replica, note why one cannot be
placed, move a replica's desired state (drain, stop), let a held drain go, schedule and carry
out a restart after a failure, forget demand that was served, reset a recovered replica's
failures, settle a node's weight removals.

The operators' changes are in :mod:`control.operations`; these differ in who may make them.
One function per state change, each one transaction fenced by the lease
(:func:`control.leases.fenced` re-checks owner and epoch, so a deposed leader's late write
changes nothing and raises :class:`control.leases.LeadershipLost`), a conditional update whose
row count says whether the world still looked as the tick's decision assumed, an Event with the
leader's epoch for each change an operator would look for, and the nodes whose desired state
changed nudged on commit (:func:`control.nudges.nudge_node`). :mod:`control.reconciler.tick`
decides which to call.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import F
from django.utils import timezone

from control import gateway_counts, leases, lifecycle, nudges, placement
from control.leases import Leadership
from control.models import Event, Node, Profile, ProfileScale, Replica, ServedModel, Shard
from telemetry import tracing

logger = logging.getLogger(__name__)


def _event(lead: Leadership, kind: str, subject: str, message: str, **data: object) -> None:
    Event.objects.create(kind=kind, subject=subject, message=message, epoch=lead.epoch, data=data)
    logger.info("%s: %s", subject, message)


def _touch_nodes(node_ids: Iterable[int]) -> None:
    """The nodes' desired state changed: bump their revisions; their streams hear on commit."""
    for node_id in sorted(set(node_ids)):
        nudges.nudge_node(node_id)


def _node_ids(replica_id: int) -> list[int]:
    return list(Shard.objects.filter(replica_id=replica_id).values_list("node_id", flat=True))


def create_replica(
    lead: Leadership,
    model: ServedModel,
    where: placement.Placement,
    reason: str,
    profile: Profile | None = None,
    *,
    node_ids: Mapping[str, int] | None = None,
) -> int:
    """Place a new replica of ``model`` under ``profile`` (default: its default profile);
    raises LeadershipLost when the fence refuses it. ``node_ids`` maps the placement's node
    names to their ids when the caller has them (the tick's snapshot); else they are read."""
    profile = profile or model.default_profile
    attributes = {
        "llmgw.model": model.name,
        "llmgw.profile": profile.name,
        "llmgw.placement.reason": reason,
        "llmgw.placement.nodes": sorted({s.node for s in where.shards}),
    }
    with tracing.span("place replica", attributes) as span:
        replica_id = _create_replica(lead, model, where, reason, profile, node_ids=node_ids)
        span.set_attribute("llmgw.replica.id", replica_id)
        return replica_id


def _create_replica(
    lead: Leadership,
    model: ServedModel,
    where: placement.Placement,
    reason: str,
    profile: Profile,
    *,
    node_ids: Mapping[str, int] | None,
) -> int:
    if node_ids is None:
        names = [s.node for s in where.shards]
        node_ids = dict(Node.objects.filter(name__in=names).values_list("name", "pk"))
    under = "" if profile.pk == model.default_profile_id else f" under profile {profile.name}"
    with leases.fenced(lead):
        replica = Replica.objects.create(model=model, profile=profile, epoch=lead.epoch)
        Shard.objects.bulk_create(
            Shard(
                replica=replica,
                node_id=node_ids[shard.node],
                rank=shard.rank,
                gpu_indices=list(shard.gpu_indices),
                port=shard.port,
            )
            for shard in where.shards
        )
        if model.placement_note:  # only the leader writes notes: the snapshot's is current
            ServedModel.objects.filter(pk=model.pk).update(placement_note="")
            model.placement_note = ""
        layout = ", ".join(
            f"rank {s.rank} on {s.node} gpus {list(s.gpu_indices)} port {s.port}"
            for s in where.shards
        )
        _event(
            lead,
            Event.Kind.PLACEMENT,
            f"model/{model.name}",
            f"placed replica #{replica.pk}{under} ({reason}): {layout}",
            replica=replica.pk,
        )
        _touch_nodes(node_ids[shard.node] for shard in where.shards)
    return replica.pk


def note_unplaceable(lead: Leadership, model: ServedModel, reason: str) -> None:
    """Record why a wanted replica cannot be placed (an event only when the reason changes)."""
    with leases.fenced(lead):
        changed = (
            ServedModel.objects.filter(pk=model.pk)
            .exclude(placement_note=reason)
            .update(placement_note=reason)
        )
        if changed:
            _event(lead, Event.Kind.PLACEMENT, f"model/{model.name}", f"cannot place: {reason}")
    model.placement_note = reason


def change_desired(
    lead: Leadership,
    replica_id: int,
    *,
    from_states: Iterable[str],
    to: str,
    subject: str,
    why: str,
) -> bool:
    """Move a replica's desired state if it is still in one of ``from_states``."""
    extra: dict[str, object] = {}
    if to == Replica.Desired.DRAINING:
        # Held back from the agent while the gateway has requests in flight on it.
        busy = gateway_counts.in_flight_by_replica().get(replica_id, 0) > 0
        extra = {"draining_since": timezone.now(), "drain_held": busy}
    with leases.fenced(lead):
        changed = Replica.objects.filter(pk=replica_id, desired__in=list(from_states)).update(
            desired=to, epoch=lead.epoch, **extra
        )
        if changed:
            _event(
                lead,
                Event.Kind.LIFECYCLE,
                subject,
                f"replica #{replica_id} → {to}: {why}",
                replica=replica_id,
            )
            _touch_nodes(_node_ids(replica_id))
    return bool(changed)


def release_drain(lead: Leadership, replica_id: int, subject: str, why: str) -> bool:
    """Let a held drain reach the agent: its engine now drains and stops."""
    with leases.fenced(lead):
        changed = Replica.objects.filter(
            pk=replica_id, desired=Replica.Desired.DRAINING, drain_held=True
        ).update(drain_held=False, epoch=lead.epoch)
        if changed:
            _event(
                lead,
                Event.Kind.LIFECYCLE,
                subject,
                f"replica #{replica_id} draining on its node: {why}",
                replica=replica_id,
            )
            _touch_nodes(_node_ids(replica_id))
    return bool(changed)


def schedule_restart(
    lead: Leadership, replica_id: int, failures: int, subject: str, now: datetime
) -> None:
    """A replica failed (its agent's report counted the ``failures``, as the tick's snapshot
    read them): set when it may restart."""
    failures = max(1, failures)
    delay = lifecycle.backoff_seconds(
        failures, settings.LLMGW_BACKOFF_BASE, settings.LLMGW_BACKOFF_MAX
    )
    with leases.fenced(lead):
        changed = Replica.objects.filter(
            pk=replica_id, observed=Replica.Observed.FAILED, backoff_until__isnull=True
        ).update(backoff_until=now + timedelta(seconds=delay))
        if changed:
            failure = Replica.objects.values_list("failure_class", flat=True).get(pk=replica_id)
            _event(
                lead,
                Event.Kind.LIFECYCLE,
                subject,
                f"replica #{replica_id} failed ({failure or 'unknown'}), failure {failures}; "
                f"restarting in {delay:g}s",
                replica=replica_id,
            )


def restart_replica(lead: Leadership, replica_id: int, subject: str) -> None:
    """Backoff over: a new generation makes the agents start the shards afresh."""
    with leases.fenced(lead):
        changed = Replica.objects.filter(
            pk=replica_id, observed=Replica.Observed.FAILED, backoff_until__isnull=False
        ).update(
            generation=F("generation") + 1,
            observed=Replica.Observed.PENDING,
            backoff_until=None,
            epoch=lead.epoch,
        )
        if changed:
            Shard.objects.filter(replica_id=replica_id).update(
                observed=Replica.Observed.PENDING, exit_code=None
            )
            _event(lead, Event.Kind.LIFECYCLE, subject, f"replica #{replica_id} restarting")
            _touch_nodes(_node_ids(replica_id))


def satisfy_demand(lead: Leadership, model: ServedModel) -> None:
    """A ready replica answers the waiting requests: forget the demand, unless a newer one
    arrived since the snapshot (the compare on ``demand_at`` keeps it). Their being served is
    use: the idle timeout counts from now, not from when they arrived."""
    now = timezone.now()
    with leases.fenced(lead):
        ServedModel.objects.filter(pk=model.pk, demand_at=model.demand_at).update(
            demand_at=None, last_request_at=now
        )
    model.demand_at = None
    model.last_request_at = now


def satisfy_profile_demand(lead: Leadership, row: ProfileScale) -> None:
    """As :func:`satisfy_demand`, for requests waiting for ``model@profile``."""
    now = timezone.now()
    with leases.fenced(lead):
        ProfileScale.objects.filter(pk=row.pk, demand_at=row.demand_at).update(
            demand_at=None, last_request_at=now
        )
    row.demand_at = None
    row.last_request_at = now


def reset_failures(lead: Leadership, replica_id: int) -> None:
    """Ready again: the next failure starts the backoff from the base."""
    with leases.fenced(lead):
        Replica.objects.filter(pk=replica_id, observed=Replica.Observed.READY).update(failures=0)


def settle_weight_removals(
    lead: Leadership, node_id: int, asked: list[object], keep: list[str]
) -> bool:
    """Narrow a node's weight removals to ``keep``, if they are still ``asked`` (what the
    tick's snapshot read): the agent finished the others, or a re-added model cancels them."""
    with leases.fenced(lead):
        changed = Node.objects.filter(pk=node_id, remove_weights=asked).update(remove_weights=keep)
        if changed:
            _touch_nodes([node_id])
    return bool(changed)
