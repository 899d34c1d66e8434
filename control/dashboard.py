"""What the ``/admin/`` dashboard shows, as plain JSON-ready data, in a fixed handful of queries.

The page polls :func:`snapshot` every few seconds, so its cost must not grow with traffic:
the last hour of usage is aggregated by the database per model and minute (minutes that are
over once per minute, through the cache; the current one each poll), and the time to first
token percentiles come from counts per latency bucket (as Prometheus' ``histogram_quantile``
does) rather than from loading every row. Percentiles are therefore estimates within one
bucket's width, which is what a glance at a chart needs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any, cast

from django.core.cache import cache
from django.db.models import Count, F, Q, Sum
from django.db.models.functions import TruncMinute
from django.urls import reverse
from django.utils import timezone

from control import leases
from control.models import Event, Node, Replica, ServedModel, Shard
from control.reconciler import LIVE_SHARD_STATES
from gateway.models import UsageRecord

WINDOW_MINUTES = 60
USAGE_SETTLE = timedelta(seconds=15)
SETTLED_CACHE_S = 120
EVENTS_SHOWN = 15
# Upper bounds (ms) of the time-to-first-token buckets the percentiles are estimated from.
TTFT_BOUNDS_MS: tuple[float, ...] = (
    10, 25, 50, 75, 100, 150, 200, 300, 500, 750,
    1000, 1500, 2000, 3000, 5000, 7500, 10000, 20000, 30000, 60000,
)  # fmt: skip
ERROR_FINISH_REASONS = (
    UsageRecord.FinishReason.UPSTREAM_ERROR,
    UsageRecord.FinishReason.TIMEOUT,
    UsageRecord.FinishReason.ERROR,
)


def allocated_gpu_keys() -> dict[tuple[int, int], str]:
    """``(node id, GPU index)`` → the replica holding it, e.g. ``"llama3#4"``.

    A shard holds its GPUs while its replica is wanted, or while its process may still run
    (the reconciler's own rule, ``LIVE_SHARD_STATES``), so this agrees with placement.
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


def quantile(
    q: float, bounds: Sequence[float], cumulative: Sequence[int], total: int
) -> float | None:
    """Estimate the ``q`` quantile from cumulative counts per upper bound (``le`` buckets).

    Linear interpolation inside the bucket the rank falls in, starting from 0 for the first;
    a rank beyond the last bound answers the last bound (the estimate cannot see further).
    None when there is nothing to estimate from.
    """
    if total <= 0:
        return None
    rank = q * total
    previous_bound, previous_count = 0.0, 0
    for bound, count in zip(bounds, cumulative, strict=True):
        if count >= rank:
            in_bucket = count - previous_count
            if in_bucket <= 0:
                return float(bound)
            return previous_bound + (bound - previous_bound) * (rank - previous_count) / in_bucket
        previous_bound, previous_count = bound, count
    return float(bounds[-1])


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
    if not leases.election_enabled():
        return {"election": False}
    view = leases.read()
    if view is None:
        return {"election": True, "held": False, "holder": "", "epoch": 0, "expires_in": None}
    return {
        "election": True,
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


def _minute_rows(start: datetime, end: datetime) -> list[dict[str, Any]]:
    """Usage aggregated per model and minute in [start, end), as plain (cacheable) data."""
    le = {
        f"le{i}": Count("id", filter=Q(ttft_ms__lte=bound))
        for i, bound in enumerate(TTFT_BOUNDS_MS)
    }
    rows = (
        UsageRecord.objects.filter(started_at__gte=start, started_at__lt=end)
        .annotate(minute=TruncMinute("started_at"))
        .values("model", "minute")
        .annotate(
            requests=Count("id"),
            tokens=Sum(F("prompt_tokens") + F("completion_tokens")),
            errors=Count(
                "id", filter=Q(status__gte=400) | Q(finish_reason__in=ERROR_FINISH_REASONS)
            ),
            timed=Count("ttft_ms"),
            **le,
        )
        .order_by()
    )
    return [dict(row) for row in cast(Iterable[dict[str, Any]], rows)]


def _settled_rows(start: datetime, settled_until: datetime) -> list[dict[str, Any]]:
    """The minutes that are over, computed once per minute per cache, not once per poll.

    At 100 requests/s an hour is 360,000 rows and aggregating them takes about half a second
    on PostgreSQL; every open dashboard polls every few seconds, and minutes that are over do
    not change (rows replayed late from a usage journal show up at the next minute's key).
    """
    key = f"llmgw:dashboard:minutes:{start.isoformat()}:{settled_until.isoformat()}"
    rows: list[dict[str, Any]] | None = cache.get(key)
    if rows is None:
        rows = _minute_rows(start, settled_until)
        cache.set(key, rows, SETTLED_CACHE_S)
    return rows


def traffic(now: datetime, minutes: int = WINDOW_MINUTES) -> dict[str, Any]:
    """Per model and minute over the window: requests/s, tokens/s, errors, TTFT p50/p95."""
    end = now.replace(second=0, microsecond=0) + timedelta(minutes=1)
    start = end - timedelta(minutes=minutes)
    buckets = [start + timedelta(minutes=i) for i in range(minutes)]
    index = {bucket: i for i, bucket in enumerate(buckets)}
    # The current minute is not over: its rates are over the seconds it has had so far.
    spans = [60.0] * minutes
    spans[-1] = max(1.0, (now - buckets[-1]).total_seconds())
    # A minute counts as over once usage rows for it have had time to be written (they are
    # flushed within a second of the request ending); later minutes are read every poll.
    settled_until = max(start, (now - USAGE_SETTLE).replace(second=0, microsecond=0))
    rows = _settled_rows(start, settled_until) + _minute_rows(settled_until, end)

    series: dict[str, dict[str, list[float | None]]] = {}
    for row in rows:
        i = index.get(row["minute"])
        if i is None:
            continue
        model = series.setdefault(
            row["model"],
            {
                "requests_per_s": [0.0] * minutes,
                "tokens_per_s": [0.0] * minutes,
                "errors": [0.0] * minutes,
                "ttft_p50_ms": [None] * minutes,
                "ttft_p95_ms": [None] * minutes,
            },
        )
        model["requests_per_s"][i] = round(row["requests"] / spans[i], 3)
        model["tokens_per_s"][i] = round((row["tokens"] or 0) / spans[i], 1)
        model["errors"][i] = float(row["errors"])
        cumulative = [row[f"le{j}"] for j in range(len(TTFT_BOUNDS_MS))]
        for name, q in (("ttft_p50_ms", 0.5), ("ttft_p95_ms", 0.95)):
            value = quantile(q, TTFT_BOUNDS_MS, cumulative, row["timed"])
            model[name][i] = None if value is None else round(value, 1)
    return {
        "start": start.isoformat(),
        "bucket_s": 60,
        "minutes": [bucket.isoformat() for bucket in buckets],
        "models": dict(sorted(series.items())),
    }


def snapshot(now: datetime | None = None) -> dict[str, Any]:
    """Everything the dashboard shows, at one moment."""
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
        "traffic": traffic(now),
        "events": _events(),
    }
