"""Prometheus metrics: what the request path counts, and the fleet as the database sees it.

Several web processes serve one port, so a scrape lands on any one of them. Counters and
histograms therefore live in prometheus_client's *multiprocess* mode: every process writes its
samples to memory-mapped files under ``PROMETHEUS_MULTIPROC_DIR`` (set by the settings module,
before anything imports prometheus_client) and the scrape sums the files of all of them. A
process that died keeps its counters in the sum (counters must not go backwards); its *live*
gauges are dropped at the next scrape (:func:`forget_dead_processes`).

Fleet gauges (nodes by state, GPUs, replicas per model, the lease) are not kept in processes
at all: they are computed from the database at scrape time (:class:`FleetCollector`), so every
process answers the same and nothing drifts.

``/metrics`` is not public: it answers only a request carrying ``Authorization: Bearer
$LLMGW_METRICS_TOKEN``, and is off (404) while that variable is unset.

The request path calls the ``observe_*`` functions below. Model labels must be catalog names
(or ``UNKNOWN_MODEL``), never a string a client sent, so a client cannot grow the label set.
``observe_request``, called once per request, only adds to an in-memory tally; the event loop
writes the tally to the shared files about once a second (writing them per request cost
14-18 us of CPU, measured). A process killed with ``kill -9`` loses at most that last second
of request counts, never a usage row (those are journaled, see ``gateway.usage``).
"""

from __future__ import annotations

import asyncio
import atexit
import bisect
import contextlib
import glob
import hmac
import logging
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.db import DatabaseError, connection
from django.db.models import Count
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from control import leases
from control.dashboard import allocated_gpu_keys
from control.models import Gpu, Node, Replica

logger = logging.getLogger(__name__)

UNKNOWN_MODEL = "(unknown)"
_MAX_LABEL = 200

# Seconds. Time to first token spans a warm small model (tens of ms) to a cold queue (minutes).
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
WAIT_BUCKETS = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0)
COLD_START_BUCKETS = (1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0)

REQUESTS = Counter(
    "llmgw_requests",
    "Requests answered on /v1, by model and HTTP status.",
    ["model", "status"],
)
TOKENS = Counter(
    "llmgw_tokens",
    "Tokens the engines reported, by model and kind (prompt, completion).",
    ["model", "kind"],
)
TTFT = Histogram(
    "llmgw_time_to_first_token_seconds",
    "Time from receiving a request to relaying the first byte of the engine's answer.",
    ["model", "status"],
    buckets=TTFT_BUCKETS,
)
DURATION = Histogram(
    "llmgw_request_duration_seconds",
    "Time from receiving a request to the end of its answer.",
    ["model", "status"],
    buckets=DURATION_BUCKETS,
)
UPSTREAM_ERRORS = Counter(
    "llmgw_upstream_errors",
    "Failed attempts to reach an engine or static endpoint, by model and reason.",
    ["model", "reason"],
)
RETRIES = Counter(
    "llmgw_upstream_retries",
    "Attempts retried on another upstream before the first byte, by model and reason.",
    ["model", "reason"],
)
ACTIVATION_WAIT = Histogram(
    "llmgw_activation_wait_seconds",
    "How long a request waited for a cold model to get a ready replica, by outcome.",
    ["model", "outcome"],
    buckets=WAIT_BUCKETS,
)
# livesum: the sum over live processes; a dead process's share is dropped at the next scrape.
WAITING = Gauge(
    "llmgw_activation_waiting",
    "Requests waiting now for a cold model, over all web processes.",
    ["model"],
    multiprocess_mode="livesum",
)
COLD_START = Histogram(
    "llmgw_replica_cold_start_seconds",
    "Time from placing a replica to its first ready report.",
    ["model"],
    buckets=COLD_START_BUCKETS,
)


def _model(model: str) -> str:
    return (model or UNKNOWN_MODEL)[:_MAX_LABEL]


# --------------------------------------------------------------------------- the hooks


# Seconds between writes of the request tally to the shared files.
FLUSH_EVERY_S = 1.0


@dataclass
class _Buckets:
    """Observations of one histogram series, counted per bucket as ``Histogram`` would."""

    bounds: Sequence[float]
    counts: list[int]
    total: float = 0.0

    @classmethod
    def over(cls, bounds: Sequence[float]) -> _Buckets:
        return cls(bounds, [0] * (len(bounds) + 1))  # the last one is +Inf

    def add(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def write(self, child: Histogram) -> None:
        # prometheus_client has no bulk observe; these are the values observe() increments
        # (test_metrics checks that the exposition matches one observe() per value).
        child._sum.inc(self.total)
        for bucket, count in zip(child._buckets, self.counts, strict=True):
            if count:
                bucket.inc(count)


@dataclass
class _Tally:
    """The requests of one (model, status) since the last write."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft: _Buckets = field(default_factory=lambda: _Buckets.over(TTFT_BUCKETS))
    duration: _Buckets = field(default_factory=lambda: _Buckets.over(DURATION_BUCKETS))


_tallies: dict[tuple[str, int], _Tally] = {}
# The loop that will write the tally (None: no write is due). A loop that closes before its
# write came due (a test's) must not stop every later loop from scheduling one.
_writer_loop: asyncio.AbstractEventLoop | None = None


def observe_request(
    model: str,
    status: int,
    *,
    prompt_tokens: int,
    completion_tokens: int,
    ttft_s: float | None,
    duration_s: float,
) -> None:
    """One finished /v1 request (call once, where its usage row is recorded).

    ``ttft_s`` is None when no byte of an answer was relayed (errors before the first byte).
    On an event loop this only adds to the tally, which the loop writes within
    ``FLUSH_EVERY_S``; anywhere else (commands, tests) it is written at once.
    """
    global _writer_loop
    tally = _tallies.get((model, status))
    if tally is None:
        tally = _tallies[(model, status)] = _Tally()
    tally.requests += 1
    if prompt_tokens > 0:
        tally.prompt_tokens += prompt_tokens
    if completion_tokens > 0:
        tally.completion_tokens += completion_tokens
    if ttft_s is not None:
        tally.ttft.add(max(0.0, ttft_s))
    tally.duration.add(max(0.0, duration_s))
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        write_tallies()
        return
    if _writer_loop is not loop:
        loop.call_later(FLUSH_EVERY_S, write_tallies)
        _writer_loop = loop


def write_tallies() -> None:
    """Write the request tally to the shared files. Only the thread that observes calls this
    (the event loop, or a caller without one), so no update can slip between read and reset."""
    global _tallies, _writer_loop
    tallies, _tallies, _writer_loop = _tallies, {}, None
    for (model, status), tally in tallies.items():
        labels = (_model(model), str(status))
        REQUESTS.labels(*labels).inc(tally.requests)
        if tally.prompt_tokens:
            TOKENS.labels(labels[0], "prompt").inc(tally.prompt_tokens)
        if tally.completion_tokens:
            TOKENS.labels(labels[0], "completion").inc(tally.completion_tokens)
        if any(tally.ttft.counts):
            tally.ttft.write(TTFT.labels(*labels))
        tally.duration.write(DURATION.labels(*labels))


# A clean exit writes what is still tallied (the event loop has stopped by then).
atexit.register(write_tallies)


def observe_upstream_error(model: str, reason: str) -> None:
    """One failed attempt at an upstream. ``reason`` is a short fixed word: ``connect``,
    ``timeout``, ``status_429``, ``status_5xx``, ``after_first_byte``, ``idle_timeout``."""
    UPSTREAM_ERRORS.labels(_model(model), reason).inc()


def observe_retry(model: str, reason: str) -> None:
    """One attempt retried on another upstream (the reason of the attempt that failed)."""
    RETRIES.labels(_model(model), reason).inc()


def observe_activation_wait(model: str, seconds: float, outcome: str) -> None:
    """A request that had to wait for a cold model, once it stops waiting. ``outcome``:
    ``ready`` (it went on), ``timeout`` (503 after the activation bound), ``rejected`` (the
    queue was full: 429/503 at once), ``disconnected`` (the client left)."""
    ACTIVATION_WAIT.labels(_model(model), outcome).observe(max(0.0, seconds))


@contextlib.contextmanager
def waiting_for_activation(model: str) -> Iterator[None]:
    """Count a request in ``llmgw_activation_waiting`` while the block runs."""
    gauge = WAITING.labels(_model(model))
    gauge.inc()
    try:
        yield
    finally:
        gauge.dec()


def observe_cold_start(model: str, seconds: float) -> None:
    """A replica reported ready for the first time, ``seconds`` after it was placed."""
    COLD_START.labels(_model(model)).observe(max(0.0, seconds))


# --------------------------------------------------------------------------- the files


_LIVE_FILE = re.compile(r"gauge_live\w+?_(\d+)\.db$")


def multiprocess_dir() -> Path:
    return Path(os.environ["PROMETHEUS_MULTIPROC_DIR"])


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, as another user
    return True


def forget_dead_processes(path: Path | None = None) -> list[int]:
    """Drop the live gauges of processes that no longer exist (killed, crashed, restarted).

    The directory belongs to one machine's web processes, so "does the pid exist here" is the
    right question. Counters and histograms stay: their sums must never go backwards.
    """
    path = path or multiprocess_dir()
    dead: set[int] = set()
    for name in glob.glob(str(path / "gauge_live*_*.db")):
        match = _LIVE_FILE.search(name)
        if match and not _pid_alive(int(match.group(1))):
            dead.add(int(match.group(1)))
    for pid in dead:
        mark_process_dead(pid, str(path))  # type: ignore[no-untyped-call]
    return sorted(dead)


def reset_multiprocess_dir(path: Path | None = None) -> None:
    """Empty the directory. Call once when the whole web tier starts (before any web process),
    so the sums restart with the service instead of carrying files of an earlier run."""
    path = path or multiprocess_dir()
    path.mkdir(parents=True, exist_ok=True)
    for name in glob.glob(str(path / "*.db")):
        with contextlib.suppress(FileNotFoundError):
            os.remove(name)


# --------------------------------------------------------------------------- the fleet


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

        election = leases.election_enabled()
        yield _gauge(
            "llmgw_leader_election_enabled",
            "1 if leader election is on; off means the single control plane leads.",
            1.0 if election else 0.0,
        )
        view = leases.read() if election else None
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


def scrape(accept: str = "") -> tuple[bytes, str]:
    """The exposition and its content type: every process's samples summed, plus the fleet
    from the store. The format follows the scraper's Accept header (Prometheus text 0.0.4
    when it names none; OpenMetrics when asked), as prometheus_client's own handlers do."""
    forget_dead_processes()
    registry = CollectorRegistry()
    MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    registry.register(FleetCollector())
    encoder, content_type = choose_encoder(accept)
    return bytes(encoder(registry)), content_type


# --------------------------------------------------------------------------- the endpoint


def _authorized(request: HttpRequest, token: str) -> bool:
    header = request.headers.get("Authorization", "")
    scheme, _, presented = header.partition(" ")
    if scheme.lower() != "bearer" or not presented:
        return False
    # Constant time, so the response time says nothing about how much of a guess was right.
    return hmac.compare_digest(presented.strip().encode(), token.encode())


def metrics_view(request: HttpRequest) -> HttpResponse:
    """``GET /metrics`` for Prometheus, with ``Authorization: Bearer $LLMGW_METRICS_TOKEN``."""
    token = str(settings.LLMGW_METRICS_TOKEN)
    if not token:
        return JsonResponse(
            {"error": "metrics are off; set LLMGW_METRICS_TOKEN to turn them on"}, status=404
        )
    if not _authorized(request, token):
        response = JsonResponse({"error": "a valid bearer token is required"}, status=401)
        response["WWW-Authenticate"] = 'Bearer realm="llmgw metrics"'
        return response
    body, content_type = scrape(request.headers.get("Accept", ""))
    return HttpResponse(body, content_type=content_type)
