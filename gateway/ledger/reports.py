"""Usage reports: filtering usage rows, summing them by model/user/team/key/day, and CSV.

Used by the admin's CSV export, the account page, ``manage.py usage_report`` and the admin
API's ``/usage``. Sums are computed by the database, so a report over millions of rows loads no
rows into Python; the row-by-row CSV streams with ``iterator()`` for the same reason.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, Literal, Protocol

from django.contrib.auth import get_user_model
from django.db.models import Count, F, Q, QuerySet, Sum
from django.db.models.functions import Coalesce, TruncDate
from django.utils import timezone

from gateway.ledger import rollups
from gateway.models import ApiKey, UsageRecord

GroupBy = Literal["model", "user", "key", "day"]
GROUPS: tuple[GroupBy, ...] = ("model", "user", "key", "day")
# Raw rows also sum by team (the admin API's ``by=team``). Rollups keep users, not teams, so the
# reports read from them (and ``usage_report``) offer the groups above.
RawGroupBy = Literal["model", "user", "team", "key", "day"]

_GROUP_EXPRESSIONS: dict[RawGroupBy, Any] = {
    "model": F("model"),
    "user": F("user__username"),
    # A user's teams now, not when the request was made; a user in two teams counts in both.
    "team": F("user__groups__name"),
    "key": F("api_key__prefix"),
    "day": TruncDate("started_at"),
}
# The name of the group of rows without one: "(none)" (no user, no key), but "(no team)".
_NO_GROUP: dict[RawGroupBy, str] = {"team": "(no team)"}

# CSV column -> the lookup that fills it, in column order: the one list of what an export holds.
ROW_COLUMNS = {
    "request_id": "request_id",
    "started_at": "started_at",
    "user": "user__username",
    "api_key": "api_key__prefix",
    "model": "model",
    "endpoint": "endpoint",
    "upstream": "upstream",
    "status": "status",
    "stream": "stream",
    "prompt_tokens": "prompt_tokens",
    "completion_tokens": "completion_tokens",
    "cached_tokens": "cached_tokens",
    "ttft_ms": "ttft_ms",
    "duration_ms": "duration_ms",
    "finish_reason": "finish_reason",
}
SUMMARY_FIELDS = (
    "group",
    "requests",
    "errors",
    "prompt_tokens",
    "completion_tokens",
    "total_tokens",
    "cached_tokens",
)


@dataclass(frozen=True)
class UsageFilter:
    since: datetime | None = None
    until: datetime | None = None
    user_id: int | None = None
    username: str | None = None
    api_key_id: int | None = None
    key_prefix: str | None = None
    model: str | None = None


def usage(filter: UsageFilter) -> QuerySet[UsageRecord]:
    rows = UsageRecord.objects.all()
    if filter.since is not None:
        rows = rows.filter(started_at__gte=filter.since)
    if filter.until is not None:
        rows = rows.filter(started_at__lt=filter.until)
    if filter.user_id is not None:
        rows = rows.filter(user_id=filter.user_id)
    if filter.username is not None:
        rows = rows.filter(user__username=filter.username)
    if filter.api_key_id is not None:
        rows = rows.filter(api_key_id=filter.api_key_id)
    if filter.key_prefix is not None:
        rows = rows.filter(api_key__prefix=filter.key_prefix)
    if filter.model is not None:
        rows = rows.filter(model=filter.model)
    return rows


@dataclass(frozen=True)
class SummaryRow:
    group: str
    requests: int
    errors: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of the prompt tokens, those the engines had in their prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in SUMMARY_FIELDS}


def summarize(rows: QuerySet[UsageRecord], by: RawGroupBy) -> list[SummaryRow]:
    """Requests, errors and tokens per group, largest token use first (days: oldest first)."""
    grouped = (
        rows.annotate(group=_GROUP_EXPRESSIONS[by])
        .values("group")
        .annotate(
            requests=Count("id"),
            errors=Count("id", filter=Q(status__gte=400)),
            prompt=Coalesce(Sum("prompt_tokens"), 0),
            completion=Coalesce(Sum("completion_tokens"), 0),
            cached=Coalesce(Sum("cached_tokens"), 0),
        )
        .order_by()
    )
    out = [
        SummaryRow(
            group=_NO_GROUP.get(by, "(none)") if row["group"] is None else str(row["group"]),
            requests=row["requests"],
            errors=row["errors"],
            prompt_tokens=row["prompt"],
            completion_tokens=row["completion"],
            cached_tokens=row["cached"],
        )
        for row in grouped
    ]
    if by == "day":
        return sorted(out, key=lambda r: r.group)
    return sorted(out, key=lambda r: (-r.total_tokens, -r.requests, r.group))


def daily(rows: QuerySet[UsageRecord], days: int, now: datetime | None = None) -> list[SummaryRow]:
    """One row per day of the last ``days`` days (UTC), zeros included, oldest first."""
    today = timezone.localdate(now or timezone.now())
    first = today - timedelta(days=days - 1)
    start = timezone.make_aware(datetime.combine(first, datetime.min.time()))
    found = {r.group: r for r in summarize(rows.filter(started_at__gte=start), "day")}
    out = []
    for offset in range(days):
        day = (first + timedelta(days=offset)).isoformat()
        out.append(found.get(day) or SummaryRow(day, 0, 0, 0, 0))
    return out


# --------------------------------------------------------------------------- from rollups


def _row(group: str, totals: rollups.Totals) -> SummaryRow:
    return SummaryRow(
        group,
        totals.requests,
        totals.errors,
        totals.prompt_tokens,
        totals.completion_tokens,
        totals.cached_tokens,
    )


def _selector(filter: UsageFilter) -> rollups.Selector:
    return rollups.Selector(
        key_id=filter.api_key_id,
        user_id=filter.user_id,
        model=filter.model,
        username=filter.username,
        key_prefix=filter.key_prefix,
    )


def summary_rows(filter: UsageFilter, by: GroupBy) -> list[SummaryRow]:
    """``summarize`` over rollups plus recent raw rows: what reports read at volume. Windows
    that start or end off the hour are read from raw rows (a rollup cannot be split)."""
    found = rollups.summary(_selector(filter), by, filter.since, filter.until)
    names: dict[Any, str] = {}
    if by == "user":
        names = {
            pk: name
            for pk, name in get_user_model()
            .objects.filter(pk__in=[g for g in found if g])
            .values_list("pk", "username")
        }
    elif by == "key":
        names = dict(
            ApiKey.objects.filter(pk__in=[g for g in found if g]).values_list("pk", "prefix")
        )
    out = []
    for group, totals in found.items():
        if group is None:
            label = "(none)"
        elif by in ("user", "key"):
            label = names.get(group, f"(deleted #{group})")
        else:
            label = str(group)
        out.append(_row(label, totals))
    if by == "day":
        return sorted(out, key=lambda r: r.group)
    return sorted(out, key=lambda r: (-r.total_tokens, -r.requests, r.group))


def daily_rows(filter: UsageFilter, days: int, now: datetime | None = None) -> list[SummaryRow]:
    """``daily`` over rollups plus recent raw rows."""
    today = timezone.localdate(now or timezone.now())
    first = today - timedelta(days=days - 1)
    start = timezone.make_aware(datetime.combine(first, datetime.min.time()))
    found = {r.group: r for r in summary_rows(replace(filter, since=start), "day")}
    out = []
    for offset in range(days):
        day = (first + timedelta(days=offset)).isoformat()
        out.append(found.get(day) or SummaryRow(day, 0, 0, 0, 0))
    return out


# --------------------------------------------------------------------------- CSV


class _Writable(Protocol):
    def write(self, text: str, /) -> Any: ...


def _safe(value: object) -> object:
    """Spreadsheet-safe: a text cell starting with = + - @ would run as a formula when the file
    is opened, and model names and key names come from users."""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


def _cell(value: object) -> object:
    """One value as the export writes it: times in ISO 8601, milliseconds to 0.1, no None."""
    if value is None:
        return ""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, float):
        return round(value, 1)
    return _safe(value)


def _row_values(record: Mapping[str, Any]) -> list[object]:
    return [_cell(record[lookup]) for lookup in ROW_COLUMNS.values()]


class _Line:
    """A file-like that hands back what csv.writer wrote, for streaming responses."""

    def write(self, text: str) -> str:
        return text


def csv_lines(rows: QuerySet[UsageRecord]) -> Iterator[str]:
    """The rows as CSV, header first, one line at a time (for a streaming response)."""
    writer = csv.writer(_Line())
    yield writer.writerow(ROW_COLUMNS)
    values = rows.order_by("started_at", "id").values(*ROW_COLUMNS.values())
    for record in values.iterator(chunk_size=2000):
        yield writer.writerow(_row_values(record))


def write_summary_csv(rows: Iterable[SummaryRow], out: _Writable) -> None:
    writer = csv.writer(out)
    writer.writerow(SUMMARY_FIELDS)
    for row in rows:
        writer.writerow([_safe(v) for v in row.as_dict().values()])
