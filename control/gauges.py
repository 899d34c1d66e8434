"""The fleet as Prometheus gauges, read from the store at scrape time.

Nodes by state, GPUs, replicas per model and the lease are not kept in processes at all: they
are computed from the database whenever ``/metrics`` is scraped, so every web process answers
the same and nothing drifts. The ``/metrics`` view (``llmgw_site.views``) puts them beside the
counters the processes keep (``telemetry.metrics``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from datetime import timedelta

from django.db import DatabaseError, connection
from django.db.models import Count
from django.utils import timezone
from prometheus_client.core import GaugeMetricFamily, Metric

from control import leases
from control.dashboard import allocated_gpu_keys
from control.models import Gpu, Node, Replica

logger = logging.getLogger(__name__)

NODE_STATES = ("new", "ready", "cordoned", "draining", "unreachable", "lost")


class FleetCollector:
    """Gauges read from the database at scrape time. Six small queries; a store that cannot
    be reached yields ``llmgw_store_up 0`` and no fleet gauges instead of a failed scrape."""

    def collect(self) -> Iterable[Metric]:
        try:
            families = list(self._fleet())
        except DatabaseError as exc:
            connection.close_if_unusable_or_obsolete()
            logger.warning("metrics: fleet gauges skipped, store unreachable (%s)", exc)
            families = []
        up = GaugeMetricFamily("llmgw_store_up", "1 if the database answered this scrape.")
        up.add_metric([], 1.0 if families else 0.0)
        yield up
        yield from families

    def _fleet(self) -> Iterator[Metric]:
        nodes = GaugeMetricFamily("llmgw_nodes", "Nodes by state.", labels=["state"])
        counts = dict.fromkeys(NODE_STATES, 0)
        for node in Node.objects.only("schedule", "health"):
            counts[node.state] = counts.get(node.state, 0) + 1
        for state, count in counts.items():
            nodes.add_metric([state], count)
        yield nodes

        gpus = list(
            Gpu.objects.values_list("node_id", "index", "memory_total_mib", "memory_used_mib")
        )
        allocated = allocated_gpu_keys()
        yield _gauge("llmgw_gpus", "GPUs the agents report.", len(gpus))
        yield _gauge(
            "llmgw_gpus_allocated",
            "GPUs held by a shard of a replica that is not stopped.",
            sum(1 for node_id, index, _, _ in gpus if (node_id, index) in allocated),
        )
        mib = 1024 * 1024
        yield _gauge(
            "llmgw_gpu_memory_total_bytes",
            "GPU memory the agents report, in total.",
            sum(total for _, _, total, _ in gpus) * mib,
        )
        yield _gauge(
            "llmgw_gpu_memory_used_bytes",
            "GPU memory in use, as the agents last reported it.",
            sum(used for _, _, _, used in gpus) * mib,
        )

        replicas = GaugeMetricFamily(
            "llmgw_replicas",
            "Replicas that are wanted or still running, by model and observed state.",
            labels=["model", "state"],
        )
        rows = (
            Replica.objects.exclude(
                desired=Replica.Desired.STOPPED,
                observed__in=[Replica.Observed.STOPPED, Replica.Observed.FAILED],
            )
            .values_list("model__name", "observed")
            .annotate(n=Count("id"))
            .order_by()
        )
        for model_name, observed, count in rows:
            replicas.add_metric([model_name, observed], count)
        yield replicas

        cold = GaugeMetricFamily(
            "llmgw_replica_last_cold_start_seconds",
            "Placement to first ready report of each model's most recent replica.",
            labels=["model"],
        )
        latest: dict[str, float] = {}
        recent = (
            Replica.objects.filter(
                ready_at__isnull=False, ready_at__gte=timezone.now() - timedelta(days=7)
            )
            .order_by("model__name", "-ready_at")
            .values_list("model__name", "created_at", "ready_at")
        )
        for model_name, created_at, ready_at in recent:
            if model_name not in latest and ready_at is not None:
                latest[model_name] = max(0.0, (ready_at - created_at).total_seconds())
        for model_name, seconds in latest.items():
            cold.add_metric([model_name], seconds)
        yield cold

        view = leases.read()
        held = view is not None and view.held
        yield _gauge("llmgw_lease_held", "1 if some process holds the lease now.", float(held))
        yield _gauge(
            "llmgw_leader_epoch",
            "The lease's epoch (0 before any claim).",
            view.epoch if view else 0,
        )
        yield _gauge(
            "llmgw_lease_expires_in_seconds",
            "Seconds until the lease expires unless renewed (negative: expired).",
            view.expires_in if view else 0.0,
        )
        leader = GaugeMetricFamily(
            "llmgw_leader_info", "1 for the process that holds the lease.", labels=["owner"]
        )
        if view is not None and held:
            leader.add_metric([view.owner], 1.0)
        yield leader


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation)
    family.add_metric([], float(value))
    return family
