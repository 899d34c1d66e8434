"""What operators do to the fleet: cordon, drain and undrain a node, restart a replica; scale,
pin and delete a catalog model; delete a profile.

One function per state change, each one transaction with a conditional update (the row count
says whether anything changed, so a second click or a racing operator changes nothing twice),
an Event naming who did it, and the agents told after commit through
:func:`control.nudges.nudge_node`. The admin's actions and the ``cordon``/``drain``/``undrain``
commands are thin edges over these.

A node's schedule is not part of any agent's desired state: the reconciler reads it on its
next tick (about a second) and moves replicas off a draining node, placing nothing new on a
cordoned one. So schedule changes nudge nobody; a restart changes what the agents must run
and nudges every node the replica spans.
"""

from __future__ import annotations

import logging

from django.db import transaction
from django.db.models import F, ProtectedError

from control import nudges
from control.models import Event, Node, Profile, Replica, ServedModel, Shard

logger = logging.getLogger(__name__)


class NotFound(Exception):
    """The node, replica or model named does not exist."""


class Invalid(ValueError):
    """The change asked for is not allowed; ``field`` names the value at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class InUse(Invalid):
    """The row is still needed (a profile some model defaults to or a replica runs under)."""


def _node_name(node_id: int) -> str:
    name = Node.objects.filter(pk=node_id).values_list("name", flat=True).first()
    if name is None:
        raise NotFound(f"node {node_id} does not exist")
    return name


def _set_schedule(node_id: int, to: str, *, actor: str, why: str) -> bool:
    with transaction.atomic():
        name = _node_name(node_id)
        changed = Node.objects.filter(pk=node_id).exclude(schedule=to).update(schedule=to)
        if changed:
            Event.objects.create(
                kind=Event.Kind.OPERATOR,
                subject=f"node/{name}",
                message=f"{to} by {actor}: {why}",
                data={"actor": actor, "schedule": to},
            )
            logger.info("node %s: schedule %s by %s", name, to, actor)
    return bool(changed)


def cordon_node(node_id: int, *, actor: str) -> bool:
    """No new placements on the node; what runs there keeps running. False: already so."""
    return _set_schedule(node_id, Node.Schedule.CORDONED, actor=actor, why="no new placements here")


def drain_node(node_id: int, *, actor: str) -> bool:
    """Move everything off the node: no new traffic, in-flight requests finish, then stop."""
    return _set_schedule(
        node_id,
        Node.Schedule.DRAINING,
        actor=actor,
        why="replicas here are moved elsewhere and stopped once idle",
    )


def undrain_node(node_id: int, *, actor: str) -> bool:
    """Make a cordoned or draining node schedulable again."""
    return _set_schedule(node_id, Node.Schedule.ACTIVE, actor=actor, why="schedulable again")


def restart_replica(replica_id: int, *, actor: str) -> bool:
    """Start a running replica's shards afresh, now (also cutting short a failure backoff).

    A new generation changes every shard's identity, so the agents stop the old processes and
    start new ones; reports about the old generation are ignored from here on. Observed state
    goes back to pending for the same reason: nothing of the new generation has been seen yet,
    and the router must not send traffic to the incarnation being replaced. False when the
    replica is not wanted running (stopped or draining replicas are not restarted).
    """
    with transaction.atomic():
        replica = (
            Replica.objects.filter(pk=replica_id)
            .select_related("model")
            .only("model__name")
            .first()
        )
        if replica is None:
            raise NotFound(f"replica {replica_id} does not exist")
        changed = Replica.objects.filter(pk=replica_id, desired=Replica.Desired.RUNNING).update(
            generation=F("generation") + 1,
            observed=Replica.Observed.PENDING,
            failures=0,
            backoff_until=None,
        )
        if changed:
            shards = Shard.objects.filter(replica_id=replica_id)
            shards.update(observed=Replica.Observed.PENDING, exit_code=None)
            Event.objects.create(
                kind=Event.Kind.OPERATOR,
                subject=f"model/{replica.model.name}",
                message=f"replica #{replica_id} restarted by {actor}",
                data={"actor": actor, "replica": replica_id},
            )
            for node_id in sorted(set(shards.values_list("node_id", flat=True))):
                nudges.nudge_node(node_id)
            logger.info("replica %s: restarted by %s", replica_id, actor)
    return bool(changed)


def _model_name(model_id: int) -> str:
    name = ServedModel.objects.filter(pk=model_id).values_list("name", flat=True).first()
    if name is None:
        raise NotFound(f"model {model_id} does not exist")
    return name


def scale_model(model_id: int, *, min_replicas: int, max_replicas: int, actor: str) -> bool:
    """Set how many replicas a model may have. The reconciler acts on its next tick: it places
    up to the minimum and scales idle replicas down to it. False: already so."""
    if min_replicas < 0:
        raise Invalid("min_replicas", "must not be negative")
    if max_replicas < 1:
        raise Invalid("max_replicas", "must be at least 1")
    if min_replicas > max_replicas:
        raise Invalid("min_replicas", f"{min_replicas} is above max_replicas ({max_replicas})")
    with transaction.atomic():
        name = _model_name(model_id)
        previous = ServedModel.objects.filter(pk=model_id).values_list(
            "min_replicas", "max_replicas"
        )[0]
        changed = (
            ServedModel.objects.filter(pk=model_id)
            .exclude(min_replicas=min_replicas, max_replicas=max_replicas)
            .update(min_replicas=min_replicas, max_replicas=max_replicas)
        )
        if changed:
            Event.objects.create(
                kind=Event.Kind.OPERATOR,
                subject=f"model/{name}",
                message=f"scaled to {min_replicas}..{max_replicas} replicas by {actor} "
                f"(was {previous[0]}..{previous[1]})",
                data={"actor": actor, "min_replicas": min_replicas, "max_replicas": max_replicas},
            )
            logger.info("model %s: scaled %s..%s by %s", name, min_replicas, max_replicas, actor)
    return bool(changed)


def pin_model(model_id: int, *, pinned: bool, actor: str) -> bool:
    """Pin (never evicted to make room for another model) or unpin. False: already so."""
    with transaction.atomic():
        name = _model_name(model_id)
        changed = (
            ServedModel.objects.filter(pk=model_id).exclude(pinned=pinned).update(pinned=pinned)
        )
        if changed:
            verb = "pinned" if pinned else "unpinned"
            Event.objects.create(
                kind=Event.Kind.OPERATOR,
                subject=f"model/{name}",
                message=f"{verb} by {actor}",
                data={"actor": actor, "pinned": pinned},
            )
            logger.info("model %s: %s by %s", name, verb, actor)
    return bool(changed)


def delete_model(model_id: int, *, actor: str) -> bool:
    """Remove a model from the catalog, with its replicas; the nodes that ran them are told to
    stop them. False: it was already gone."""
    with transaction.atomic():
        name = ServedModel.objects.filter(pk=model_id).values_list("name", flat=True).first()
        if name is None:
            return False
        nodes = sorted(
            set(Shard.objects.filter(replica__model_id=model_id).values_list("node_id", flat=True))
        )
        deleted, _ = ServedModel.objects.filter(pk=model_id).delete()
        if deleted:
            Event.objects.create(
                kind=Event.Kind.OPERATOR,
                subject=f"model/{name}",
                message=f"deleted by {actor}",
                data={"actor": actor, "deleted": True},
            )
            # The shards are gone from these nodes' desired state: the agents stop them.
            for node_id in nodes:
                nudges.nudge_node(node_id)
            logger.info("model %s: deleted by %s", name, actor)
    return bool(deleted)


def delete_profile(profile_id: int, *, actor: str) -> bool:
    """Remove a profile from the catalog; the models that also offered it stop offering it,
    with their replica counts under it. InUse: it is a model's default profile or a replica
    runs under it (delete or move those first). False: it was already gone."""
    with transaction.atomic():
        name = Profile.objects.filter(pk=profile_id).values_list("name", flat=True).first()
        if name is None:
            return False
        defaults = sorted(
            ServedModel.objects.filter(default_profile_id=profile_id).values_list("name", flat=True)
        )
        if defaults:
            raise InUse("name", f"profile {name!r} is the default of {', '.join(defaults)}")
        running = sorted(
            set(Replica.objects.filter(profile_id=profile_id).values_list("model__name", flat=True))
        )
        if running:
            raise InUse("name", f"profile {name!r} runs replicas of {', '.join(running)}")
        listed = sorted(
            ServedModel.objects.filter(profiles=profile_id).values_list("name", flat=True)
        )
        try:
            # A savepoint: a replica the reconciler placed under it since the check above
            # protects the row, and the caller's transaction must stay usable for the answer.
            with transaction.atomic():
                deleted, _ = Profile.objects.filter(pk=profile_id).delete()
        except ProtectedError:
            raise InUse("name", f"profile {name!r} runs a replica placed just now") from None
        if deleted:
            Event.objects.create(
                kind=Event.Kind.OPERATOR,
                subject=f"profile/{name}",
                message=f"deleted by {actor}"
                + (f" (offered by {', '.join(listed)})" if listed else ""),
                data={"actor": actor, "deleted": True, "models": listed},
            )
            logger.info("profile %s: deleted by %s", name, actor)
    return bool(deleted)
