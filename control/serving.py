"""What the gateway needs from the control plane, as plain data: the one module it imports.

The gateway routes by a table it builds from :func:`routing_snapshot` (the catalog, and the
replicas ready to take traffic with where they listen), and reports back what the reconciler
acts on: :func:`record_demand` (a request found no ready replica: start one),
:func:`record_requests` (a model is in use), :func:`record_finished` (when a replica last
finished a request: idle time and least-recently-used order count from it) and
:func:`report_in_flight` (what this process has in flight per replica: such a replica is not
scaled down, evicted or drained from under it). Activation waiters are counted across
processes through :func:`take_waiting_slot` / :func:`leave_waiting_slot`. It hears of
changes to routing rows through :func:`on_routing_change`; a tick is asked for early
(:func:`request_tick`) through the sender the site registers with :func:`send_ticks_with`.
Nothing here hands out a model instance, so the control plane may change its tables behind
these functions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

from django.conf import settings
from django.db.models import Q
from django.db.models.signals import post_delete, post_save
from django.utils import timezone

from agents.protocol.names import address_problem, is_loopback
from control import gateway_counts, leases
from control.models import Event, Node, Profile, ProfileScale, Replica, ServedModel, Shard

logger = logging.getLogger(__name__)

# Demand and last-request stamps are precise to this many seconds: a stamp younger than this is
# left alone, so web processes do not pile up writes (and each coalesces its own to this rate).
STAMP_EVERY_S = 5.0
# A web process reports what it has in flight at least this often (its heartbeat).
CONFIRM_EVERY_S = gateway_counts.CONFIRM_EVERY_S
# The reconcile tick's Celery name (``control.tasks``), sent by name so that asking for a tick
# does not import the reconciler into the web process.
RECONCILE_TASK = "control.tasks.reconcile"


@dataclass(frozen=True)
class CatalogEntry:
    """A model clients may ask for, with what routing needs of it."""

    id: int
    name: str
    aliases: tuple[str, ...]
    enabled: bool
    activation_timeout_s: float
    max_waiting: int
    connect_timeout_s: float | None
    first_byte_timeout_s: float | None
    stream_idle_timeout_s: float | None
    profiles: frozenset[str]  # the profiles it may run under, its default included
    default_profile: str = ""
    context_length: int | None = None  # None: as its engine reports it


@dataclass(frozen=True)
class ReadyReplica:
    """A replica that may take traffic, with the address of its rank-0 shard."""

    id: int
    model_id: int
    profile: str
    host: str
    port: int
    engine_key: str = field(default="", repr=False)
    # Goes up when the replica restarts: what the gateway learned of its cache is then void.
    generation: int = 1
    # Its engine's KV cache capacity in tokens, as the head shard's agent last reported it
    # (None: not known): what the gateway remembers of that cache is bounded by it.
    cache_tokens: int | None = None
    # Its node's agent stream came over loopback (the local agent): loopback is its own.
    local_node: bool = False


@dataclass(frozen=True)
class RoutingSnapshot:
    models: list[CatalogEntry]
    replicas: list[ReadyReplica]


def routing_snapshot() -> RoutingSnapshot:
    """The catalog and the replicas that take traffic now.

    Every query reads one table and the join happens here. A query over several tables holds
    a lock on one while it waits for the next, and that deadlocks against anything that locks
    them all exclusively (a migration, a TRUNCATE): PostgreSQL then aborts one side. One
    table per statement cannot be part of such a cycle. Hence ``order_by()`` on each: a
    model's default ordering by a related name joins that table in (and costs compiling).
    """
    rows = list(
        ServedModel.objects.order_by().values(
            "id",
            "name",
            "aliases",
            "enabled",
            "activation_timeout_s",
            "max_waiting",
            "connect_timeout_s",
            "first_byte_timeout_s",
            "stream_idle_timeout_s",
            "default_profile_id",
            "context_length",
        )
    )
    profile_names = dict(Profile.objects.order_by().values_list("id", "name"))
    profiles: dict[int, set[str]] = {}
    links = ServedModel.profiles.through.objects.order_by().values_list(
        "servedmodel_id", "profile_id"
    )
    pairs = [*links, *((row["id"], row["default_profile_id"]) for row in rows)]
    for model_id, profile_id in pairs:
        if profile_id in profile_names:
            profiles.setdefault(model_id, set()).add(profile_names[profile_id])
    models = [
        CatalogEntry(
            id=row["id"],
            name=row["name"],
            aliases=tuple(str(a) for a in (row["aliases"] or [])),
            enabled=row["enabled"],
            activation_timeout_s=float(row["activation_timeout_s"]),
            max_waiting=int(row["max_waiting"]),
            connect_timeout_s=row["connect_timeout_s"],
            first_byte_timeout_s=row["first_byte_timeout_s"],
            stream_idle_timeout_s=row["stream_idle_timeout_s"],
            profiles=frozenset(profiles.get(row["id"], ())),
            default_profile=profile_names.get(row["default_profile_id"], ""),
            context_length=row["context_length"],
        )
        for row in rows
    ]

    # A replica takes traffic when it is observed ready, meant to run, and its head shard's
    # node is healthy and not draining (drained nodes finish what they hold, take nothing new).
    live = {
        replica_id: (model_id, profile_id, key, generation)
        for replica_id, model_id, profile_id, key, generation in Replica.objects.filter(
            observed=Replica.Observed.READY, desired=Replica.Desired.RUNNING
        )
        .order_by()
        .values_list("id", "model_id", "profile_id", "engine_key", "generation")
    }
    nodes = {
        node_id: (addresses, local)
        for node_id, addresses, local in Node.objects.filter(health=Node.Health.READY)
        .exclude(schedule=Node.Schedule.DRAINING)
        .order_by()
        .values_list("id", "addresses", "connected_over_loopback")
    }
    replicas = []
    for replica_id, node_id, port, cache_tokens in (
        Shard.objects.filter(rank=0)
        .order_by()
        .values_list("replica_id", "node_id", "port", "cache_tokens")
    ):
        if replica_id not in live or node_id not in nodes:
            continue
        addresses, local = nodes[node_id]
        host = next((str(a) for a in (addresses or []) if a), "")
        if not host:
            logger.warning("replica %s: its node reports no address; not routed", replica_id)
            continue
        problem = address_problem(host)
        if problem is not None:
            # Agents cannot send such an address; a row edited around them is not trusted.
            logger.warning("replica %s: node address %r %s; not routed", replica_id, host, problem)
            continue
        if is_loopback(host) and not local:
            # Refused at hello; a row written around it (or left from before) is not trusted.
            logger.warning(
                "replica %s: node address %s is loopback, but its agent did not connect over "
                "loopback; not routed",
                replica_id,
                host,
            )
            continue
        model_id, profile_id, key, generation = live[replica_id]
        profile = profile_names.get(profile_id, "")
        replicas.append(
            ReadyReplica(
                replica_id, model_id, profile, host, port, key, generation, cache_tokens, local
            )
        )
    return RoutingSnapshot(models, replicas)


def catalog_names() -> list[str]:
    """Every model name in the catalog, sorted."""
    return list(ServedModel.objects.order_by("name").values_list("name", flat=True))


_listeners: list[Callable[[], None]] = []


def on_routing_change(callback: Callable[[], None]) -> None:
    """Call ``callback`` (with no arguments) whenever this process saves or deletes a row that
    :func:`routing_snapshot` reads; other processes' writes are not seen here. It runs in the
    thread that wrote, so it must be thread-safe and quick. Subscribing twice is harmless."""
    if callback in _listeners:
        return
    _listeners.append(callback)
    for model in (ServedModel, Profile, Replica, Shard, Node):
        uid = f"llmgw-routing-{model.__name__}"
        post_save.connect(_routing_row_changed, sender=model, dispatch_uid=uid)
        post_delete.connect(_routing_row_changed, sender=model, dispatch_uid=f"{uid}-deleted")


def _routing_row_changed(sender: Any, **kwargs: Any) -> None:
    for callback in _listeners:
        callback()


def record_demand(model_ids: Collection[int]) -> None:
    """Requests for these models found no ready replica: the reconciler places one.

    A conditional update (a stamp younger than ``STAMP_EVERY_S`` is left alone); when it
    recorded anything, a tick is asked for now rather than at the next beat."""
    if not model_ids:
        return
    now = timezone.now()
    fresh = now - timedelta(seconds=STAMP_EVERY_S)
    recorded = (
        ServedModel.objects.filter(pk__in=model_ids)
        .filter(Q(demand_at__isnull=True) | Q(demand_at__lt=fresh))
        .update(demand_at=now)
    )
    if recorded:
        request_tick()


def record_profile_demand(wanted: Collection[tuple[int, str]]) -> None:
    """Requests for ``model@profile`` (model id, profile name; not the default profile) found
    no ready replica of that profile: the reconciler places one under it. Conditional like
    :func:`record_demand`; the profile's row is made on first demand (0 to 1 replicas)."""
    now = timezone.now()
    fresh = now - timedelta(seconds=STAMP_EVERY_S)
    recorded = 0
    for model_id, profile_name in wanted:
        model = ServedModel.objects.filter(pk=model_id).values("default_profile_id").first()
        profile_id = (
            ServedModel.profiles.through.objects.filter(
                servedmodel_id=model_id, profile__name=profile_name
            )
            .values_list("profile_id", flat=True)
            .first()
        )
        if model is None or profile_id is None or profile_id == model["default_profile_id"]:
            continue
        scale, _ = ProfileScale.objects.get_or_create(model_id=model_id, profile_id=profile_id)
        recorded += (
            ProfileScale.objects.filter(pk=scale.pk)
            .filter(Q(demand_at__isnull=True) | Q(demand_at__lt=fresh))
            .update(demand_at=now)
        )
    if recorded:
        request_tick()


def record_requests(model_ids: Collection[int], replica_ids: Collection[int]) -> None:
    """These models and replicas served requests just now (idle scale-down counts from the
    last one). Conditional updates, like :func:`record_demand`."""
    now = timezone.now()
    fresh = now - timedelta(seconds=STAMP_EVERY_S)
    stale = Q(last_request_at__isnull=True) | Q(last_request_at__lt=fresh)
    if model_ids:
        ServedModel.objects.filter(pk__in=model_ids).filter(stale).update(last_request_at=now)
    if replica_ids:
        Replica.objects.filter(pk__in=replica_ids).filter(stale).update(last_request_at=now)


def record_finished(finished: Mapping[int, datetime]) -> None:
    """Replicas finished a request at these times: their ``last_request_at`` moves up to it
    (never back), so idle scale-down and eviction count from the end of the last request."""
    for replica_id, at in finished.items():
        Replica.objects.filter(pk=replica_id).filter(
            Q(last_request_at__isnull=True) | Q(last_request_at__lt=at)
        ).update(last_request_at=at)


def process_id() -> str:
    """This web process's id in shared counts: random, made after fork."""
    return leases.owner_id()


def report_in_flight(in_flight: Mapping[int, int]) -> None:
    """This process's requests in flight per replica (all of them; coalesced by the caller)."""
    gateway_counts.report_in_flight(process_id(), in_flight)


def take_waiting_slot(model_id: int, limit: int) -> bool:
    """Room for one more request waiting for ``model_id`` to start, counted over every web
    process (``max_waiting`` is per model, not per process)? Takes it if so."""
    return gateway_counts.take_waiting_slot(process_id(), model_id, limit)


def leave_waiting_slot(model_id: int) -> None:
    gateway_counts.leave_waiting_slot(process_id(), model_id)


class TaskSender(Protocol):
    """Sends a Celery task by name (the Celery app's ``send_task``, with the options used)."""

    def __call__(self, name: str, *, expires: float, retry: bool) -> object: ...


_send_task: TaskSender | None = None


def send_ticks_with(send: TaskSender) -> None:
    """How :func:`request_tick` sends the reconcile task: through the site's Celery app,
    registered by the site when Django starts (the control plane sits below the site and
    never imports it). Registering again replaces the sender."""
    global _send_task
    _send_task = send


def request_tick() -> None:
    """Ask for a tick now instead of at the next beat (a cold model has a request waiting).
    Best effort and never blocking: the beat's next tick does the same work anyway."""
    if _send_task is None:
        logger.warning("could not ask for an early reconcile tick: no task sender registered")
        return
    try:
        _send_task(RECONCILE_TASK, expires=settings.LLMGW_RECONCILE_INTERVAL, retry=False)
    except Exception as exc:  # a broker that is down must not fail the request path
        logger.warning("could not ask for an early reconcile tick: %s", type(exc).__name__)


def record_gateway_event(subject: str, message: str, data: dict[str, Any]) -> None:
    """An audit line from the gateway's request path (an upstream reporting nonsense, a usage
    row the store refused), where operators already look for what happened and why."""
    Event.objects.create(
        kind=Event.Kind.LIFECYCLE, subject=subject[:200], message=message, data=data
    )


def record_operator_event(subject: str, message: str, data: dict[str, Any]) -> None:
    """An operator's change to the gateway's rows (a user's or a team's limits) in the audit
    trail beside the fleet's changes: who did it and what it was before. Call inside the
    change's transaction, so the line and the change commit together."""
    Event.objects.create(
        kind=Event.Kind.OPERATOR, subject=subject[:200], message=message, data=data
    )


def this_process_leads() -> bool:
    """Whether this process holds the reconciler's lease now (confirmed within its renew
    deadline): the gate for the gateway's periodic jobs (usage rollups), which run in the
    worker beside the ticks and must run on one control plane only."""
    # Imported here: web processes import this module but never run the reconciler.
    from control.reconciler.runner import process_reconciler  # noqa: PLC0415

    lead = process_reconciler().leadership
    return lead is not None and lead.may_act()
