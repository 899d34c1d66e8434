"""The reconciler: compare what the catalog and demand want with what the fleet runs, and
converge. Leader-gated and fenced: it acts only while this process holds the lease, and every
write happens inside :func:`control.leases.fenced`, so a deposed leader's late writes change
nothing.

A tick reads one snapshot, decides with pure functions (``control.lifecycle``,
``control.scaling``, ``control.placement``) and applies each decision as its own state
change: one function, one fenced transaction, a conditional update whose row count says
whether the world still looked as the decision assumed, an Event, and the affected nodes'
desired-state revision bumped with a nudge sent on commit. Running a tick twice is harmless:
the second finds nothing to do.
"""

from __future__ import annotations

import fcntl
import json
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import cached_property
from typing import TypeVar

from django.conf import settings
from django.db import DatabaseError, close_old_connections, connection
from django.db.models import Exists, F, Max, OuterRef
from django.utils import timezone

from control import (
    gateway_counts,
    health,
    leases,
    lifecycle,
    nudges,
    placement,
    scaling,
    weights,
)
from control.leases import Leadership, LeadershipLost
from control.models import (
    LIVE_SHARD_STATES,
    Event,
    Node,
    Profile,
    ProfileScale,
    Replica,
    ServedModel,
    Shard,
)

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


# --------------------------------------------------------------------------- the snapshot


@dataclass
class ShardView:
    id: int
    node_id: int
    rank: int
    gpu_indices: tuple[int, ...]
    port: int
    observed: str
    requests_running: int = 0


@dataclass
class ReplicaView:
    id: int
    model_id: int
    profile_id: int
    desired: str
    observed: str
    failures: int
    backoff_until: datetime | None
    last_request_at: datetime | None
    shards: list[ShardView] = field(default_factory=list)
    profile_name: str = ""
    # Requests the web processes have in flight on it (control.gateway_counts).
    gateway_in_flight: int = 0
    draining_since: datetime | None = None
    drain_held: bool = False

    @property
    def in_flight(self) -> int:
        """The gateway's count or the engines' own, whichever sees more: a request relayed by
        the gateway is also running in the engine, so the two are not added up."""
        engines = sum(s.requests_running for s in self.shards)
        return max(self.gateway_in_flight, engines)

    def holds_resources(self) -> bool:
        if self.desired != Replica.Desired.STOPPED:
            return True
        return any(shard.observed in LIVE_SHARD_STATES for shard in self.shards)


@dataclass
class NodeView:
    """What a tick needs of a node, read as plain values (no model instances: at a thousand
    nodes and eight thousand GPUs, building those was most of a tick)."""

    pk: int
    name: str
    health: str
    schedule: str
    port_min: int | None
    port_max: int | None
    # The JSON columns as the store sent them, decoded only when a tick needs one: placing
    # reads labels and weight reports, settling removals a non-empty removal list. Decoding
    # all three for a thousand nodes every tick was a third of a steady tick's snapshot.
    labels_json: str = "{}"
    weights_report_json: str = "[]"
    remove_weights_json: str = "[]"
    # Each GPU with the memory it has free (total minus what others use), built once here.
    gpus: list[placement.FreeGpu] = field(default_factory=list)

    @cached_property
    def labels(self) -> dict[str, object]:
        return _decoded(self.labels_json, dict)

    @cached_property
    def weights_report(self) -> list[object]:
        return _decoded(self.weights_report_json, list)

    @cached_property
    def remove_weights(self) -> list[object]:
        # As stored: settling compares it with the row before it writes.
        return _decoded(self.remove_weights_json, list)


def _decoded(text: object, kind: type[_T]) -> _T:
    """A JSON column's value if it is a ``kind`` (empty otherwise: a value of the wrong shape,
    whoever wrote it, must not fail a tick). Both backends hand JSON columns to a plain cursor
    as text; a driver that decodes them itself is taken as it is."""
    value = text
    if isinstance(text, str | bytes):
        try:
            value = json.loads(text)
        except ValueError:
            value = None
    return value if isinstance(value, kind) else kind()


@dataclass
class Snapshot:
    now: datetime
    models: dict[int, ServedModel]
    nodes: dict[int, NodeView]
    replicas: list[ReplicaView]
    # Every profile, and each model's scaling units (see units_of), read with the models.
    profiles: dict[int, Profile] = field(default_factory=dict)
    units: dict[int, list[ScaleUnit]] = field(default_factory=dict)

    def replicas_of(self, model_id: int) -> list[ReplicaView]:
        return self._replicas_by_model.get(model_id, [])

    @cached_property
    def node_ids(self) -> dict[str, int]:
        return {node.name: pk for pk, node in self.nodes.items()}

    @cached_property
    def _replicas_by_model(self) -> dict[int, list[ReplicaView]]:
        # Looked up once per model per tick: a scan each time was models × replicas.
        by_model: dict[int, list[ReplicaView]] = defaultdict(list)
        for replica in self.replicas:
            by_model[replica.model_id].append(replica)
        return by_model


# The same SQL on both backends; the columns in NodeView's order.
NODES_SQL = """
SELECT id, name, health, schedule, port_min, port_max, labels, weights_report, remove_weights
FROM control_node ORDER BY id
"""
GPUS_SQL = """
SELECT node_id, "index", memory_total_mib, memory_used_mib
FROM control_gpu ORDER BY node_id, "index"
"""


def read_nodes() -> dict[int, NodeView]:
    """Every node and its GPUs: two set-based queries, whatever the size of the fleet. Plain
    cursors: the ORM's row conversion (and its JSON decoding of every column of every node)
    cost more than the queries themselves."""
    with connection.cursor() as cursor:
        cursor.execute(NODES_SQL)
        nodes = {row[0]: NodeView(*row) for row in cursor.fetchall()}
        cursor.execute(GPUS_SQL)
        gpus = cursor.fetchall()
    for node_id, index, total, used in gpus:
        node = nodes.get(node_id)
        if node is not None:  # a node created after the first query: seen next tick
            node.gpus.append(placement.FreeGpu(index, max(0, total - used)))
    return nodes


def read_catalog() -> tuple[dict[int, ServedModel], dict[int, Profile], dict[int, list[ScaleUnit]]]:
    """The models, every profile, and each model's scaling units: four queries, and each
    profile built once. (``prefetch_related`` made a queryset per model and relation, and
    ``select_related`` decoded the default profile's JSON once per model: at 500 models that
    was 40% of a steady tick.)"""
    rows_of_models = list(ServedModel.objects.order_by("pk"))
    through = ServedModel.profiles.through.objects.values_list("servedmodel_id", "profile_id")
    listings = list(through)
    # Read last, so that it holds every profile the rows above name, unless one was deleted
    # in between: what names it is left to the next tick rather than failing this one.
    profiles = Profile.objects.in_bulk()
    models: dict[int, ServedModel] = {}
    for model in rows_of_models:
        if model.default_profile_id in profiles:
            model.default_profile = profiles[model.default_profile_id]
            models[model.pk] = model
    listed: dict[int, list[Profile]] = defaultdict(list)
    for model_id, profile_id in listings:
        if profile_id in profiles:
            listed[model_id].append(profiles[profile_id])
    rows: dict[int, dict[int, ProfileScale]] = defaultdict(dict)
    for row in ProfileScale.objects.all():
        rows[row.model_id][row.profile_id] = row
    units = {pk: units_of(model, listed[pk], rows[pk]) for pk, model in models.items()}
    return models, profiles, units


def read_snapshot(now: datetime) -> Snapshot:
    """Everything one tick decides on, in a handful of set-based queries."""
    models, profiles, units = read_catalog()
    fleet = read_nodes()
    replicas: dict[int, ReplicaView] = {}
    # Stopped replicas matter only while a shard may still run (its GPUs are not free yet).
    live_shard = Shard.objects.filter(replica=OuterRef("pk"), observed__in=LIVE_SHARD_STATES)
    current = Replica.objects.exclude(desired=Replica.Desired.STOPPED) | Replica.objects.filter(
        Exists(live_shard)
    )
    in_flight = gateway_counts.in_flight_by_replica()
    for row in current.order_by("id").values_list(
        "pk",
        "model_id",
        "profile_id",
        "desired",
        "observed",
        "failures",
        "backoff_until",
        "last_request_at",
        "draining_since",
        "drain_held",
    ):
        (pk, model_id, profile_id, desired, observed, failures, backoff, last, since, held) = row
        replicas[pk] = ReplicaView(
            pk,
            model_id,
            profile_id,
            desired,
            observed,
            failures,
            backoff,
            last,
            profile_name=profiles[profile_id].name if profile_id in profiles else "",
            gateway_in_flight=in_flight.get(pk, 0),
            draining_since=since,
            drain_held=held,
        )
    shards = Shard.objects.filter(replica_id__in=list(replicas)).order_by("replica_id", "rank")
    for shard_id, replica_id, node_id, rank, gpus, port, observed, running in shards.values_list(
        "pk", "replica_id", "node_id", "rank", "gpu_indices", "port", "observed", "requests_running"
    ):
        replicas[replica_id].shards.append(
            ShardView(
                shard_id,
                node_id,
                rank,
                tuple(int(i) for i in gpus),
                port,
                observed,
                running or 0,
            )
        )
    return Snapshot(now, models, fleet, list(replicas.values()), profiles, units)


def _schedulable(node: NodeView) -> bool:
    return node.health == Node.Health.READY and node.schedule == Node.Schedule.ACTIVE


def fleet_of(snapshot: Snapshot) -> scaling.Fleet:
    """Schedulable nodes with all their GPUs, and what every replica holding resources holds."""
    nodes = []
    for node in snapshot.nodes.values():
        if not _schedulable(node):
            continue
        present = {
            str(w.get("name"))
            for w in node.weights_report
            if isinstance(w, dict) and w.get("state") == "present"
        }
        port_range = (node.port_min, node.port_max) if node.port_min and node.port_max else None
        nodes.append(
            placement.NodeCapacity(
                node.name,
                tuple(node.gpus),
                labels={str(k): str(v) for k, v in node.labels.items()},
                cached_sources=frozenset(present),
                port_range=port_range,
            )
        )
    holdings = tuple(
        scaling.Holding(
            replica.id, snapshot.nodes[shard.node_id].name, shard.gpu_indices, shard.port
        )
        for replica in snapshot.replicas
        if replica.holds_resources()
        for shard in replica.shards
    )
    return scaling.Fleet(tuple(nodes), holdings)


def capacity(snapshot: Snapshot, *, ignoring: Iterable[int] = ()) -> list[placement.NodeCapacity]:
    """Free GPUs and ports of schedulable nodes; ``ignoring`` replica ids count as gone."""
    return fleet_of(snapshot).capacity(frozenset(ignoring))


def replica_request(model: ServedModel, profile: Profile | None = None) -> placement.ReplicaRequest:
    """What one replica of ``model`` under ``profile`` (default: its default profile) needs."""
    profile = profile or model.default_profile
    return placement.ReplicaRequest(
        model=model.name,
        source=model.source,
        gpus_per_shard=profile.gpus_per_shard,
        shards=profile.shards_per_replica,
        gpu_memory_mib=profile.gpu_memory_mib,
        selector={str(k): str(v) for k, v in profile.gpu_selector.items()},
        strategy="spread" if profile.placement_strategy == "spread" else "binpack",
    )


@dataclass
class ScaleUnit:
    """One model under one profile, which scales as one: under its default profile with the
    model's own counts and demand, under another with a ProfileScale row's (none yet: 0 to 1
    replicas). Its ``key`` names it in scaling: ``model`` or ``model@profile``."""

    model: ServedModel
    profile: Profile
    row: ProfileScale | None = None
    retired: bool = False  # replicas of a profile the model no longer lists: none wanted

    @property
    def default(self) -> bool:
        return self.profile.pk == self.model.default_profile_id

    @property
    def key(self) -> str:
        return unit_key(self.model, self.profile)

    @property
    def min_replicas(self) -> int:
        """The replicas it keeps however idle (as :meth:`demand` reports it)."""
        if self.default:
            return self.model.min_replicas
        return self.row.min_replicas if self.row is not None else 0

    def demand(self, uses: Iterable[lifecycle.ReplicaUse] = ()) -> lifecycle.ModelDemand:
        """Its traffic: the last request (started, or finished on one of its replicas,
        whichever is later) and what is in flight on its replicas now."""
        model, row = self.model, self.row
        uses = list(uses)
        if self.default:
            low, high, stamp, demand_at = (
                model.min_replicas,
                model.max_replicas,
                model.last_request_at,
                model.demand_at,
            )
        elif row is not None:
            low, high, stamp, demand_at = (
                row.min_replicas,
                row.max_replicas,
                row.last_request_at,
                row.demand_at,
            )
        else:
            low, high, stamp, demand_at = 0, 1, None, None
        known = [s for s in (stamp, *(u.last_request_at for u in uses)) if s is not None]
        return lifecycle.ModelDemand(
            enabled=model.enabled and not self.retired,
            min_replicas=low,
            max_replicas=high,
            idle_timeout=timedelta(seconds=model.idle_timeout_s),
            activation_timeout=timedelta(seconds=model.activation_timeout_s),
            last_request_at=max(known) if known else None,
            demand_at=demand_at,
            requests_in_flight=sum(u.in_flight for u in uses),
        )


def unit_key(model: ServedModel, profile: Profile) -> str:
    if profile.pk == model.default_profile_id:
        return model.name
    return f"{model.name}@{profile.name}"


def units_of(
    model: ServedModel, listed: Iterable[Profile], rows: dict[int, ProfileScale]
) -> list[ScaleUnit]:
    """The model under its default profile first, then under each other profile it lists
    (``listed``), with that profile's ProfileScale row from ``rows`` by profile id (pure)."""
    units = [ScaleUnit(model, model.default_profile)]
    for profile in sorted(listed, key=lambda p: p.name):
        if profile.pk != model.default_profile_id:
            units.append(ScaleUnit(model, profile, rows.get(profile.pk)))
    return units


# --------------------------------------------------------------------------- state changes


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


def schedule_restart(lead: Leadership, replica: ReplicaView, subject: str, now: datetime) -> None:
    """A replica failed (its agent's report counted the failure): set when it may restart."""
    failures = max(1, replica.failures)
    delay = lifecycle.backoff_seconds(
        failures, settings.LLMGW_BACKOFF_BASE, settings.LLMGW_BACKOFF_MAX
    )
    with leases.fenced(lead):
        changed = Replica.objects.filter(
            pk=replica.id, observed=Replica.Observed.FAILED, backoff_until__isnull=True
        ).update(backoff_until=now + timedelta(seconds=delay))
        if changed:
            failure = Replica.objects.values_list("failure_class", flat=True).get(pk=replica.id)
            _event(
                lead,
                Event.Kind.LIFECYCLE,
                subject,
                f"replica #{replica.id} failed ({failure or 'unknown'}), failure {failures}; "
                f"restarting in {delay:g}s",
                replica=replica.id,
            )


def restart_replica(lead: Leadership, replica: ReplicaView, subject: str) -> None:
    """Backoff over: a new generation makes the agents start the shards afresh."""
    with leases.fenced(lead):
        changed = Replica.objects.filter(
            pk=replica.id, observed=Replica.Observed.FAILED, backoff_until__isnull=False
        ).update(
            generation=F("generation") + 1,
            observed=Replica.Observed.PENDING,
            backoff_until=None,
            epoch=lead.epoch,
        )
        if changed:
            Shard.objects.filter(replica_id=replica.id).update(
                observed=Replica.Observed.PENDING, exit_code=None
            )
            _event(lead, Event.Kind.LIFECYCLE, subject, f"replica #{replica.id} restarting")
            _touch_nodes(_node_ids(replica.id))


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


def reset_failures(lead: Leadership, replica: ReplicaView) -> None:
    """Ready again: the next failure starts the backoff from the base."""
    with leases.fenced(lead):
        Replica.objects.filter(pk=replica.id, observed=Replica.Observed.READY).update(failures=0)


# --------------------------------------------------------------------------- the tick


# The share of a tick's budget the scaling step has however long the snapshot took.
MIN_SCALING_SHARE = 0.25


@dataclass
class TickResult:
    acted: bool
    epoch: int = 0
    placed: int = 0
    changed: int = 0
    lost_leadership: bool = False
    # The budget ran out after this model: the next tick goes on from the one after it.
    resume_after: int | None = None

    @property
    def more_to_place(self) -> bool:
        """It placed, and stopped on its budget with models left: a wave is being placed,
        and the next tick should come now rather than at the next beat."""
        return self.placed > 0 and self.resume_after is not None


def tick(
    lead: Leadership,
    now: datetime | None = None,
    *,
    budget: float | None = None,
    resume_after: int | None = None,
) -> TickResult:
    """One pass over the whole fleet. Raises LeadershipLost if the lease goes mid-tick.

    ``budget`` (seconds) bounds the tick: each placement is a transaction of its own, so a
    wave of hundreds of activations would make one tick last seconds; past the budget the tick
    stops between two models and the next one goes on after ``resume_after``. The budget
    counts from the tick's start (a slow read of the fleet leaves less for placing), but the
    scaling step always has a quarter of it, so a loaded store still sees progress."""
    started = time.monotonic()
    now = now or timezone.now()
    with leases.fenced(lead):
        health.refresh_node_health(now)
    snapshot = read_snapshot(now)
    result = TickResult(acted=True, epoch=lead.epoch)
    _abandon_lost(lead, snapshot, result)
    _restart_failed(lead, snapshot, result)
    _release_held_drains(lead, snapshot, result)
    _finish_drains(lead, snapshot, result)
    deadline = None
    if budget is not None:
        deadline = max(started + budget, time.monotonic() + budget * MIN_SCALING_SHARE)
    _scale_all(lead, snapshot, result, deadline=deadline, resume_after=resume_after)
    _settle_weight_removals(lead, snapshot, result)
    return result


def _settle_weight_removals(lead: Leadership, snapshot: Snapshot, result: TickResult) -> None:
    """Drop weight removals the agent finished, or that a re-added model cancels."""
    sources = {model.source for model in snapshot.models.values()}
    for node in snapshot.nodes.values():
        if not node.remove_weights:  # the common case: nothing to settle, no report to decode
            continue
        keep = weights.settled_removals(node, sources)
        if keep != node.remove_weights:
            with leases.fenced(lead):
                changed = Node.objects.filter(
                    pk=node.pk, remove_weights=node.remove_weights
                ).update(remove_weights=keep)
                if changed:
                    _touch_nodes([node.pk])
                    result.changed += 1


def _subject(snapshot: Snapshot, replica: ReplicaView) -> str:
    return f"model/{snapshot.models[replica.model_id].name}"


def _abandon_lost(lead: Leadership, snapshot: Snapshot, result: TickResult) -> None:
    """Replicas with a shard on a lost node are stopped; the scale step places replacements.
    A lost node that returns is sent "stop" for them, so duplicates do not survive."""
    lost = {pk for pk, node in snapshot.nodes.items() if node.health == Node.Health.LOST}
    for replica in snapshot.replicas:
        on_lost = sorted(
            {snapshot.nodes[s.node_id].name for s in replica.shards if s.node_id in lost}
        )
        if on_lost and replica.desired != Replica.Desired.STOPPED:
            if change_desired(
                lead,
                replica.id,
                from_states=[Replica.Desired.RUNNING, Replica.Desired.DRAINING],
                to=Replica.Desired.STOPPED,
                subject=_subject(snapshot, replica),
                why=f"node {', '.join(on_lost)} lost",
            ):
                replica.desired = Replica.Desired.STOPPED
                result.changed += 1


def _restart_failed(lead: Leadership, snapshot: Snapshot, result: TickResult) -> None:
    for replica in snapshot.replicas:
        if replica.desired != Replica.Desired.RUNNING:
            continue
        if replica.observed == Replica.Observed.READY and replica.failures:
            reset_failures(lead, replica)
        if replica.observed != Replica.Observed.FAILED:
            continue
        if replica.backoff_until is None:
            schedule_restart(lead, replica, _subject(snapshot, replica), snapshot.now)
            result.changed += 1
        elif replica.backoff_until <= snapshot.now:
            restart_replica(lead, replica, _subject(snapshot, replica))
            result.changed += 1


def _release_held_drains(lead: Leadership, snapshot: Snapshot, result: TickResult) -> None:
    """A draining replica held for the gateway's requests in flight is let go to its agent
    once they finished, or once the drain timeout passed."""
    timeout = timedelta(seconds=float(settings.LLMGW_DRAIN_TIMEOUT))
    for replica in snapshot.replicas:
        if replica.desired != Replica.Desired.DRAINING or not replica.drain_held:
            continue
        began = replica.draining_since or snapshot.now
        if replica.gateway_in_flight == 0 or snapshot.now >= began + timeout:
            why = "no request in flight" if replica.gateway_in_flight == 0 else "drain timeout"
            if release_drain(lead, replica.id, _subject(snapshot, replica), why):
                replica.drain_held = False
                result.changed += 1


def _finish_drains(lead: Leadership, snapshot: Snapshot, result: TickResult) -> None:
    """A draining replica whose shards all stopped is stopped."""
    for replica in snapshot.replicas:
        if replica.desired != Replica.Desired.DRAINING:
            continue
        if all(s.observed not in LIVE_SHARD_STATES for s in replica.shards):
            if change_desired(
                lead,
                replica.id,
                from_states=[Replica.Desired.DRAINING],
                to=Replica.Desired.STOPPED,
                subject=_subject(snapshot, replica),
                why="drained",
            ):
                replica.desired = Replica.Desired.STOPPED
                result.changed += 1


def _leaving(snapshot: Snapshot, replica: ReplicaView) -> bool:
    """On a node the operator is draining: to be replaced, then drained."""
    return any(snapshot.nodes[s.node_id].schedule == Node.Schedule.DRAINING for s in replica.shards)


def _unit_key_of(model: ServedModel, replica: ReplicaView) -> str:
    if replica.profile_id == model.default_profile_id:
        return model.name
    return f"{model.name}@{replica.profile_name}"


def _use(model: ServedModel, replica: ReplicaView) -> lifecycle.ReplicaUse:
    return lifecycle.ReplicaUse(
        replica_id=replica.id,
        model=_unit_key_of(model, replica),
        ready=replica.observed == Replica.Observed.READY,
        pinned=model.pinned,
        in_flight=replica.in_flight,
        last_request_at=replica.last_request_at or model.last_request_at,
    )


@dataclass
class ScalingView:
    """What scaling sees during one tick. A replica placed for one model is added at once, so
    the models after it see the GPUs and ports it took."""

    snapshot: Snapshot
    replicas: list[scaling.ReplicaState]
    min_replicas: dict[str, int]

    @cached_property
    def fleet(self) -> scaling.Fleet:
        """Built when a model first needs it (to place, or to evict for): most ticks place
        nothing, and at a thousand nodes building it was a tenth of a steady tick."""
        return fleet_of(self.snapshot)

    @classmethod
    def of(cls, snapshot: Snapshot) -> ScalingView:
        replicas = [
            scaling.ReplicaState(
                _use(snapshot.models[r.model_id], r),
                draining=r.desired == Replica.Desired.DRAINING,
                leaving=_leaving(snapshot, r),
            )
            for r in snapshot.replicas
            if r.desired in (Replica.Desired.RUNNING, Replica.Desired.DRAINING)
        ]
        minimum = {
            unit.key: unit.min_replicas for units in snapshot.units.values() for unit in units
        }
        return cls(snapshot, replicas, minimum)

    @cached_property
    def _by_unit(self) -> dict[str, list[scaling.ReplicaState]]:
        by_unit: dict[str, list[scaling.ReplicaState]] = defaultdict(list)
        for state in self.replicas:
            by_unit[state.use.model].append(state)
        return by_unit

    def replicas_of(self, key: str) -> list[scaling.ReplicaState]:
        """The running and draining replicas of one scaling unit, without a scan of all."""
        return self._by_unit.get(key, [])

    def record_placement(
        self, unit: ScaleUnit, replica_id: int, where: placement.Placement
    ) -> None:
        self.fleet = self.fleet.holding(replica_id, where)
        use = lifecycle.ReplicaUse(
            replica_id, unit.key, False, unit.model.pinned, 0, unit.model.last_request_at
        )
        state = scaling.ReplicaState(use, draining=False)
        self._by_unit[unit.key].append(state)  # (the index first: built now, it would hold it)
        self.replicas.append(state)


def models_in_turn(models: Iterable[ServedModel], resume_after: int | None) -> list[ServedModel]:
    """Models by id, starting after ``resume_after`` and wrapping around, so a tick cut short
    by its budget does not leave the same models waiting tick after tick (pure)."""
    ordered = sorted(models, key=lambda m: m.pk)
    if resume_after is None:
        return ordered
    return [m for m in ordered if m.pk > resume_after] + [
        m for m in ordered if m.pk <= resume_after
    ]


def _scale_all(
    lead: Leadership,
    snapshot: Snapshot,
    result: TickResult,
    *,
    deadline: float | None = None,
    resume_after: int | None = None,
) -> None:
    view = ScalingView.of(snapshot)
    for model in models_in_turn(snapshot.models.values(), resume_after):
        units = list(snapshot.units[model.pk])
        # Replicas under a profile the model no longer lists are retired as a unit of their
        # own (nothing wanted), so they drain once idle instead of running on for ever.
        listed = {unit.profile.pk for unit in units}
        gone = {r.profile_id for r in snapshot.replicas_of(model.pk)} - listed
        units += [
            ScaleUnit(model, profile, retired=True)
            for profile in sorted(
                (snapshot.profiles[pk] for pk in gone if pk in snapshot.profiles),
                key=lambda p: p.name,
            )
        ]
        for unit in units:
            _scale(lead, view, unit, snapshot.now, result)
        if deadline is not None and time.monotonic() >= deadline:
            result.resume_after = model.pk
            break


def _scale(
    lead: Leadership, view: ScalingView, unit: ScaleUnit, now: datetime, result: TickResult
) -> None:
    """Carry out the scaling decision for one model under one profile, one state change per
    action, in order."""
    model = unit.model
    mine = [r.use for r in view.replicas_of(unit.key) if not r.draining]
    decision = scaling.scale(
        scaling.ModelScale(unit.key, unit.demand(mine), replica_request(model, unit.profile)),
        view.replicas,
        lambda: view.fleet,
        own=view.replicas_of(unit.key),
        min_replicas=view.min_replicas,
        now=now,
        port_range=settings.LLMGW_PORT_RANGE,
    )
    for action in decision:
        match action:
            case scaling.SatisfyDemand():
                if unit.default:
                    satisfy_demand(lead, model)
                elif unit.row is not None:
                    satisfy_profile_demand(lead, unit.row)
            case scaling.Place(where, why):
                replica_id = create_replica(
                    lead, model, where, why, unit.profile, node_ids=view.snapshot.node_ids
                )
                view.record_placement(unit, replica_id, where)
                result.placed += 1
            case scaling.NoteUnplaceable(reason):
                note = reason if unit.default else f"under profile {unit.profile.name}: {reason}"
                note_unplaceable(lead, model, note)
            case scaling.Drain(replica_id, owner, why):
                if _retire(lead, replica_id, Replica.Desired.DRAINING, owner, why):
                    result.changed += 1
            case scaling.Stop(replica_id, owner, why):
                if _retire(lead, replica_id, Replica.Desired.STOPPED, owner, why):
                    result.changed += 1


def _retire(lead: Leadership, replica_id: int, to: str, model: str, why: str) -> bool:
    """A running replica of ``model`` is to drain or stop."""
    return change_desired(
        lead,
        replica_id,
        from_states=[Replica.Desired.RUNNING],
        to=to,
        subject=f"model/{model}",
        why=why,
    )


# --------------------------------------------------------------------------- running it


def highest_agent_epoch() -> int:
    """The highest leader epoch any agent reported having seen (0: none reported one)."""
    return int(Node.objects.aggregate(highest=Max("agent_epoch"))["highest"] or 0)


class Reconciler:
    """Keeps this process's claim between ticks and runs one tick at a time on this host."""

    def __init__(self) -> None:
        self.leadership: Leadership | None = None
        self.resume_after: int | None = None

    def run_once(self) -> TickResult:
        with _one_tick_at_a_time() as got_it:
            if not got_it:
                logger.info("a tick is already running on this host; skipping")
                return TickResult(acted=False)
            close_old_connections()
            started = time.monotonic()
            self.leadership = leases.claim(previous=self.leadership)
            if not self.leadership.may_act():
                logger.debug("tick: follower (epoch %s)", self.leadership.epoch)
                return TickResult(acted=False, epoch=self.leadership.epoch)
            try:
                self.leadership = leases.advance_epoch(self.leadership, highest_agent_epoch())
                with nudges.batched():
                    result = tick(
                        self.leadership,
                        budget=settings.LLMGW_RECONCILE_TICK_BUDGET,
                        resume_after=self.resume_after,
                    )
                self.resume_after = result.resume_after
                logger.debug(
                    "tick: leader epoch %s, %s placed, %s changed, %.0f ms",
                    result.epoch,
                    result.placed,
                    result.changed,
                    (time.monotonic() - started) * 1000,
                )
                return result
            except LeadershipLost as exc:
                logger.warning("lost leadership mid-tick; remaining writes dropped: %s", exc)
                return TickResult(acted=True, epoch=self.leadership.epoch, lost_leadership=True)
            except DatabaseError as exc:
                logger.warning("tick aborted, store error: %s", type(exc).__name__)
                connection.close_if_unusable_or_obsolete()
                return TickResult(acted=False, epoch=self.leadership.epoch)

    def shutdown(self) -> None:
        """Graceful stop: give the lease back so a standby takes over at once."""
        if self.leadership is not None:
            leases.release(self.leadership)
            self.leadership = None


@contextmanager
def _one_tick_at_a_time() -> Iterator[bool]:
    """A host-wide lock (a worker with several processes, or a `reconcile --loop` beside it)."""
    path = settings.VAR_DIR / "reconciler.lock"
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


_process_reconciler: Reconciler | None = None


def process_reconciler() -> Reconciler:
    """The one Reconciler of this process (the Celery task's state between ticks)."""
    global _process_reconciler
    if _process_reconciler is None:
        _process_reconciler = Reconciler()
    return _process_reconciler


def run_loop(interval: float, stop: threading.Event) -> None:
    """`manage.py reconcile --loop`: tick every ``interval`` seconds until ``stop`` is set."""
    reconciler = process_reconciler()
    try:
        while not stop.is_set():
            started = time.monotonic()
            result = reconciler.run_once()
            if not result.more_to_place:
                stop.wait(max(0.0, interval - (time.monotonic() - started)))
    finally:
        reconciler.shutdown()
