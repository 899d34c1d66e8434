"""What the ``/admin/`` dashboard shows of the fleet, as plain JSON-ready data.

Nodes with their GPUs, models with their replicas, the lease and the latest events, in a fixed
handful of queries (the page polls every few seconds). The traffic half of the page comes from
the gateway (``gateway.ledger.traffic``); the dashboard view (``llmgw_site.views``) puts the two
together. ``manage.py list_nodes`` prints :func:`nodes`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db.models import Count, Q
from django.urls import reverse
from django.utils import timezone

from control import leases
from control.models import LIVE_SHARD_STATES, Event, Node, Replica, ServedModel, Shard

EVENTS_SHOWN = 15


def allocated_gpu_keys() -> dict[tuple[int, int], str]:
    """``(node id, GPU index)`` → the replica holding it, e.g. ``"llama3#4"``.

    A shard holds its GPUs while its replica is wanted, or while its process may still run
    (``LIVE_SHARD_STATES``, the reconciler's own rule), so this agrees with placement.
    """
    held: dict[tuple[int, int], str] = {}
    shards = (
        Shard.objects.filter(
            ~Q(replica__desired=Replica.Desired.STOPPED) | Q(observed__in=LIVE_SHARD_STATES)
        )
        .values_list("node_id", "gpu_indices", "replica_id", "replica__model__name")
        .order_by()
    )
    for node_id, indices, replica_id, model_name in shards:
        for index in indices or []:
            held[(node_id, int(index))] = f"{model_name}#{replica_id}"
    return held


def _seconds_ago(moment: datetime | None, now: datetime) -> float | None:
    return None if moment is None else round((now - moment).total_seconds(), 1)


def nodes(now: datetime | None = None) -> list[dict[str, Any]]:
    """Every node with its GPUs, each marked with the replica holding it (if any)."""
    now = now or timezone.now()
    held = allocated_gpu_keys()
    out = []
    for node in Node.objects.prefetch_related("gpus").order_by("name"):
        out.append(
            {
                "id": node.pk,
                "name": node.name,
                "url": reverse("admin:control_node_change", args=[node.pk]),
                "state": node.state,
                "schedule": node.schedule,
                "health": node.health,
                "heartbeat_age_s": _seconds_ago(node.last_heartbeat_at, now),
                "agent_version": node.agent_version,
                "gpus": [
                    {
                        "index": gpu.index,
                        "model": gpu.model,
                        "memory_total_mib": gpu.memory_total_mib,
                        "memory_used_mib": gpu.memory_used_mib,
                        "allocated_to": held.get((node.pk, gpu.index)),
                    }
                    for gpu in node.gpus.all()
                ],
            }
        )
    return out


def _models(now: datetime) -> list[dict[str, Any]]:
    running = Q(replicas__desired=Replica.Desired.RUNNING)
    rows = ServedModel.objects.annotate(
        desired=Count("replicas", filter=running),
        ready=Count("replicas", filter=running & Q(replicas__observed=Replica.Observed.READY)),
        starting=Count(
            "replicas",
            filter=running
            & Q(replicas__observed__in=[Replica.Observed.PENDING, Replica.Observed.STARTING]),
        ),
        failed=Count("replicas", filter=running & Q(replicas__observed=Replica.Observed.FAILED)),
        draining=Count("replicas", filter=Q(replicas__desired=Replica.Desired.DRAINING)),
    ).order_by("name")
    out = []
    for model in rows:
        waiting = (
            model.demand_at is not None
            and (now - model.demand_at).total_seconds() < model.activation_timeout_s
        )
        out.append(
            {
                "name": model.name,
                "url": reverse("admin:control_servedmodel_change", args=[model.pk]),
                "enabled": model.enabled,
                "pinned": model.pinned,
                "min_replicas": model.min_replicas,
                "max_replicas": model.max_replicas,
                "desired": model.desired,
                "ready": model.ready,
                "starting": model.starting,
                "failed": model.failed,
                "draining": model.draining,
                "demand_waiting": waiting,
                "placement_note": model.placement_note,
                "last_request_age_s": _seconds_ago(model.last_request_at, now),
            }
        )
    return out


def _lease() -> dict[str, Any]:
    view = leases.read()
    if view is None:
        return {"held": False, "holder": "", "epoch": 0, "expires_in": None}
    return {
        "held": view.held,
        "holder": view.owner,
        "epoch": view.epoch,
        "expires_in": round(view.expires_in, 1),
    }


def _events() -> list[dict[str, Any]]:
    return [
        {
            "at": event.created_at.isoformat(),
            "kind": event.kind,
            "subject": event.subject,
            "message": event.message,
            "epoch": event.epoch,
        }
        for event in Event.objects.order_by("-created_at", "-id")[:EVENTS_SHOWN]
    ]


def snapshot(now: datetime | None = None) -> dict[str, Any]:
    """The fleet's half of the dashboard, at one moment."""
    now = now or timezone.now()
    fleet = nodes(now)
    models = _models(now)
    gpus = [gpu for node in fleet for gpu in node["gpus"]]
    return {
        "generated_at": now.isoformat(),
        "summary": {
            "nodes": len(fleet),
            "nodes_ready": sum(1 for node in fleet if node["state"] == "ready"),
            "gpus": len(gpus),
            "gpus_allocated": sum(1 for gpu in gpus if gpu["allocated_to"]),
            "replicas_ready": sum(model["ready"] for model in models),
            "replicas_desired": sum(model["desired"] for model in models),
        },
        "nodes": fleet,
        "models": models,
        "lease": _lease(),
        "events": _events(),
    }
