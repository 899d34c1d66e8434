"""The traffic half of the ``/admin/`` dashboard: the last hour of usage per model and minute.

The page polls every few seconds, so the cost must not grow with traffic: the usage rows are
aggregated by the database per model and minute (a minute that is over once, kept in the
cache; the current one each poll), and the time to first token percentiles come
from counts per latency bucket (as Prometheus' ``histogram_quantile`` does) rather than from
loading every row. Percentiles are therefore estimates within one bucket's width, which is what
a glance at a chart needs. The fleet half is ``control.dashboard``; the dashboard view
(``llmgw_site.views``) puts the two together.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any, cast

from django.core.cache import cache
from django.db.models import Count, F, Q, Sum
from django.db.models.functions import TruncMinute

from gateway.models import UsageRecord

WINDOW_MINUTES = 60
USAGE_SETTLE = timedelta(seconds=15)
MINUTE = timedelta(minutes=1)
GENERATION_KEY = "llmgw:dashboard:generation"
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
            prompt=Sum("prompt_tokens"),
            cached=Sum("cached_tokens"),
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
    """The minutes in [start, settled_until), which are over: each aggregated once, when it
    ends, and kept in the cache for as long as it is in the window.

    Every open dashboard polls every few seconds, and an hour's aggregate grows with traffic:
    redone whenever the window moved, it was a slow poll twice a minute (docs/decisions.md,
    'traffic aggregated per finished minute'). Now a poll aggregates only the minutes it finds
    no entry for: the one that just ended, or the whole hour in a process that has not seen it
    yet. Rows replayed late from a usage journal start a new generation of entries
    (:func:`forget_settled`).
    """
    generation = cache.get(GENERATION_KEY, 0)
    minutes = [start + MINUTE * i for i in range((settled_until - start) // MINUTE)]
    keys = {m: f"llmgw:dashboard:minute:{generation}:{m.isoformat()}" for m in minutes}
    cached: dict[str, list[dict[str, Any]]] = cache.get_many(list(keys.values()))
    rows = [row for key in keys.values() for row in cached.get(key, ())]
    missing = [minute for minute in minutes if keys[minute] not in cached]
    if missing:
        fresh: dict[datetime, list[dict[str, Any]]] = {minute: [] for minute in missing}
        for row in _minute_rows(missing[0], missing[-1] + MINUTE):
            if row["minute"] in fresh:
                fresh[row["minute"]].append(row)
        cache.set_many({keys[m]: fresh[m] for m in missing}, WINDOW_MINUTES * 60 + 60)
        rows += [row for minute_rows in fresh.values() for row in minute_rows]
    return rows


def forget_settled() -> None:
    """Rows for minutes that were over have been written (a journal replayed): the next poll
    aggregates the window afresh."""
    try:
        cache.incr(GENERATION_KEY)
    except ValueError:  # no generation yet
        cache.add(GENERATION_KEY, 1, None)


def traffic(now: datetime, minutes: int = WINDOW_MINUTES) -> dict[str, Any]:
    """Per model and minute over the window: requests/s, tokens/s, errors, TTFT p50/p95, and
    the share of prompt tokens the engines found in their prefix cache (per minute, and over
    the window as ``prefix_hit_ratio``)."""
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

    series: dict[str, dict[str, Any]] = {}
    prompts: dict[str, list[int]] = {}  # model -> [prompt tokens, cached tokens] in the window
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
                "prefix_hit_ratio_per_minute": [None] * minutes,
                "prefix_hit_ratio": None,
            },
        )
        model["requests_per_s"][i] = round(row["requests"] / spans[i], 3)
        model["tokens_per_s"][i] = round((row["tokens"] or 0) / spans[i], 1)
        model["errors"][i] = float(row["errors"])
        # Minutes kept in the cache by an older process may lack the two sums.
        prompt, cached = row.get("prompt") or 0, row.get("cached") or 0
        if prompt:
            model["prefix_hit_ratio_per_minute"][i] = round(cached / prompt, 3)
            total = prompts.setdefault(row["model"], [0, 0])
            total[0] += prompt
            total[1] += cached
        cumulative = [row[f"le{j}"] for j in range(len(TTFT_BOUNDS_MS))]
        for name, q in (("ttft_p50_ms", 0.5), ("ttft_p95_ms", 0.95)):
            value = quantile(q, TTFT_BOUNDS_MS, cumulative, row["timed"])
            model[name][i] = None if value is None else round(value, 1)
    for name, (prompt, cached) in prompts.items():
        series[name]["prefix_hit_ratio"] = round(cached / prompt, 3)
    return {
        "start": start.isoformat(),
        "bucket_s": 60,
        "minutes": [bucket.isoformat() for bucket in buckets],
        "models": dict(sorted(series.items())),
    }
