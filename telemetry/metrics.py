"""Prometheus metrics: what the request path and the control plane count, and the exposition.

Several web processes serve one port, so a scrape lands on any one of them. Counters and
histograms therefore live in prometheus_client's *multiprocess* mode: every process writes its
samples to memory-mapped files under ``PROMETHEUS_MULTIPROC_DIR`` (set by the settings module,
before anything imports prometheus_client) and the scrape sums the files of all of them. A
process that died keeps its counters in the sum (counters must not go backwards); its *live*
gauges are dropped at the next scrape (:func:`forget_dead_processes`).

This module imports nothing of ours, so the request path and the control plane can both count
without pulling in each other. What is read from the store at scrape time (the fleet gauges,
``control.gauges``) is handed to :func:`exposition` by the ``/metrics`` view
(``llmgw_site.views``).

The request path calls the ``observe_*`` functions below. Model labels must be catalog names
(or ``UNKNOWN_MODEL``), never a string a client sent, so a client cannot grow the label set.
``observe_request``, called once per request, only adds to an in-memory tally; the event loop
writes the tally to the shared files about once a second (writing them per request cost more
CPU than the rest of the count: docs/decisions.md, 'request counters tallied in memory'). A
process killed with ``kill -9`` loses at most that last second
of request counts, never a usage row (those are journaled, see ``gateway.ledger.usage``).
"""

from __future__ import annotations

import asyncio
import atexit
import bisect
import contextlib
import glob
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector

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
USAGE_DEAD_LETTERS = Counter(
    "llmgw_usage_dead_letters",
    "Usage rows the store refused even alone, kept in the dead-letter journal instead.",
)
USAGE_JOURNAL_ERRORS = Counter(
    "llmgw_usage_journal_errors",
    "Writes, fsyncs and opens of a usage journal that failed (a full or failing disk).",
)
# livemax: 1 while any live web process cannot write its journal; its rows go straight to the
# store meanwhile, and are lost if it dies before they are stored.
USAGE_JOURNAL_UNWRITABLE = Gauge(
    "llmgw_usage_journal_unwritable",
    "1 while a web process cannot write its usage journal (rows go straight to the store).",
    multiprocess_mode="livemax",
)
USAGE_CLAMPED = Counter(
    "llmgw_usage_clamped",
    "Token counts an upstream reported outside 0..2^31-1, clamped before they were recorded.",
)
SLOW_CLIENTS_CLOSED = Counter(
    "llmgw_slow_clients_closed",
    "Connections answered 408 and closed because a request's headers or body missed its"
    " deadline (LLMGW_HEADER_TIMEOUT, LLMGW_BODY_TIMEOUT), by phase (headers, body).",
    ["phase"],
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
ROUTING_DECISIONS = Counter(
    "llmgw_routing_decisions",
    "Upstreams chosen, by model and why: cached (its prefix is there), affinity (its session's),"
    " cold (a new prefix's agreed place), spilled (the first choice was loaded past its bound),"
    " least_loaded (no prompt to place).",
    ["model", "outcome"],
)
PREFIX_CACHE_TOKENS = Counter(
    "llmgw_prefix_cache_tokens",
    "Prompt tokens the engines reported, and of them the ones they found in their prefix cache,"
    " by model and upstream (kind: prompt, cached); cached / prompt is the hit ratio.",
    ["model", "upstream", "kind"],
)
ROUTING_PREDICTIONS = Counter(
    "llmgw_routing_predictions",
    "What the engines' cached tokens said of the router's prediction, by model: agreed, denied"
    " (it had less cached than predicted: the router's mirror shrank) or surprised (more).",
    ["model", "outcome"],
)
KEYS_UNCONFIRMED = Counter(
    "llmgw_keys_unconfirmed",
    "Requests refused with 503 because the store could not confirm their API key within"
    " LLMGW_KEY_CACHE_TTL, by whether this process had loaded the key before (known) or not"
    " (unknown).",
    ["key"],
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
# Routing's counts since the last write: (model, outcome) → decisions, (model, outcome) →
# predictions judged, (model, upstream) → [prompt tokens, cached tokens].
_routes: dict[tuple[str, str], int] = {}
_predictions: dict[tuple[str, str], int] = {}
_cached: dict[tuple[str, str], list[int]] = {}
# Requests refused for a key the store could not confirm: "known" / "unknown" → refusals.
_unconfirmed: dict[str, int] = {}
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
    _write_soon()


def observe_route(model: str, outcome: str) -> None:
    """One upstream chosen (``gateway.routing.choice``'s outcomes), tallied like requests."""
    key = (model, outcome)
    _routes[key] = _routes.get(key, 0) + 1
    _write_soon()


def observe_prefix_cache(
    model: str, upstream: str, *, prompt_tokens: int, cached_tokens: int, prediction: str | None
) -> None:
    """What an engine reported of its prefix cache for one request, and what that said of the
    router's prediction (``agreed``, ``denied``, ``surprised``; None: nothing was predicted,
    the prompt had no full block)."""
    counts = _cached.get((model, upstream))
    if counts is None:
        counts = _cached[(model, upstream)] = [0, 0]
    counts[0] += max(0, prompt_tokens)
    counts[1] += max(0, cached_tokens)
    if prediction is not None:
        key = (model, prediction)
        _predictions[key] = _predictions.get(key, 0) + 1
    _write_soon()


def observe_key_unconfirmed(*, known: bool) -> None:
    """One request refused because the store could not confirm its API key in time (the key
    had been loaded before, or never), tallied like requests: an outage refuses at the rate
    requests arrive."""
    key = "known" if known else "unknown"
    _unconfirmed[key] = _unconfirmed.get(key, 0) + 1
    _write_soon()


def _write_soon() -> None:
    """Schedule the write of the tallies within ``FLUSH_EVERY_S`` on this event loop (or write
    them now where there is none: commands, tests)."""
    global _writer_loop
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
    global _tallies, _routes, _predictions, _cached, _unconfirmed, _writer_loop
    tallies, _tallies, _writer_loop = _tallies, {}, None
    routes, predictions, cached, unconfirmed = _routes, _predictions, _cached, _unconfirmed
    _routes, _predictions, _cached, _unconfirmed = {}, {}, {}, {}
    for known, count in unconfirmed.items():
        KEYS_UNCONFIRMED.labels(known).inc(count)
    for (model, outcome), count in routes.items():
        ROUTING_DECISIONS.labels(_model(model), outcome).inc(count)
    for (model, outcome), count in predictions.items():
        ROUTING_PREDICTIONS.labels(_model(model), outcome).inc(count)
    for (model, upstream), (prompt, hits) in cached.items():
        PREFIX_CACHE_TOKENS.labels(_model(model), upstream[:_MAX_LABEL], "prompt").inc(prompt)
        if hits:
            PREFIX_CACHE_TOKENS.labels(_model(model), upstream[:_MAX_LABEL], "cached").inc(hits)
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
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    for name in glob.glob(str(path / "*.db")):
        with contextlib.suppress(FileNotFoundError):
            os.remove(name)


# --------------------------------------------------------------------------- the exposition


def exposition(accept: str = "", collectors: Iterable[Collector] = ()) -> tuple[bytes, str]:
    """The exposition and its content type: every process's samples summed, plus what the
    given collectors read at scrape time. The format follows the scraper's Accept header
    (Prometheus text 0.0.4 when it names none; OpenMetrics when asked), as prometheus_client's
    own handlers do."""
    forget_dead_processes()
    registry = CollectorRegistry()
    MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    for collector in collectors:
        registry.register(collector)
    encoder, content_type = choose_encoder(accept)
    return bytes(encoder(registry)), content_type
