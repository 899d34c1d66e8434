"""The traffic half of the ``/admin/`` dashboard: the last hour of usage per model and minute.

The page polls every few seconds, so the cost must not grow with traffic: the usage rows are
aggregated by the database per model and minute (minutes that are over once per minute,
through the cache; the current one each poll), and the time to first token percentiles come
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
SETTLED_CACHE_S = 120
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
