"""What one reconciler tick reads: the catalog with each model's scaling units, every node with
its GPUs, and the replicas that hold or want resources, as plain values read in a handful of
set-based queries whatever the size of the fleet; and what placement sees of them (free GPUs
and ports of schedulable nodes, what one replica needs).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import cached_property
from typing import TypeVar

from django.db import connection
from django.db.models import Exists, OuterRef

from control import gateway_counts, lifecycle, placement, scaling
from control.models import (
    LIVE_SHARD_STATES,
    Node,
    Profile,
    ProfileScale,
    Replica,
    ServedModel,
    Shard,
)

_T = TypeVar("_T")


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
    """What a tick needs of a node, read as plain values (no model instances: at fleet scale,
    building those was most of a tick; docs/decisions.md, 'the tick's snapshot')."""

    pk: int
    name: str
    health: str
    schedule: str
    port_min: int | None
    port_max: int | None
    # The JSON columns as the store sent them, decoded only when a tick needs one: placing
    # reads labels and weight reports, settling removals a non-empty removal list. Decoding
    # all three for every node every tick was a large part of the snapshot (docs/decisions.md,
    # 'the tick's snapshot').
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
    ``select_related`` decoded the default profile's JSON once per model: at fleet scale a
    large part of a steady tick; docs/decisions.md, 'the tick's snapshot'.)"""
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
