"""Usage that stays fast at volume: hourly rollups, raw-row retention, and reading both.

A Celery beat task (``gateway.tasks.roll_up_usage``, leader-gated by a lease of its own)
sums the raw rows of every hour that is over into ``UsageRollup`` (per hour, key, user, model
and status) and moves the mark (``RollupMark``) to the end of the last hour summed. Each run
replaces the rollups of the hours it covers in one transaction, so running it twice, or two
runs racing, leaves the same rows. The last ``REROLL_HOURS`` hours before the mark are summed
again every run: rows that reach the store late (a journal replayed after a crash) are
counted. Raw rows older than ``LLMGW_USAGE_RETENTION_DAYS`` (and already rolled up) are
deleted in batches of ``DELETE_BATCH``, a few batches per run, so no run holds a long lock.

Readers (budgets, ``/account/``, ``/v1/keys/{prefix}/usage``, ``usage_report``) take the
rollups for hours before the mark and the raw rows from the mark on: ``totals`` and
``summary``. Both are one indexed query per table.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any, TypeVar

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connection, transaction
from django.db.models import Count, Q, QuerySet, Sum
from django.db.models.functions import Coalesce, TruncDate
from django.utils import timezone

from gateway.models import ApiKey, RollupMark, UsageRecord, UsageRollup

_Row = TypeVar("_Row", UsageRecord, UsageRollup)
logger = logging.getLogger(__name__)

MARK = "usage"
REROLL_HOURS = 3
# At most this many hours are summed in one run: a first run over months of rows catches up
# over a few runs instead of holding one long transaction.
MAX_HOURS_PER_RUN = 24 * 7
DELETE_BATCH = 5000
MAX_DELETE_BATCHES = 20


def hour_of(moment: datetime) -> datetime:
    return moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def mark() -> datetime | None:
    """The end of the last hour rolled up (None: nothing yet, read raw rows only)."""
    return RollupMark.objects.filter(name=MARK).values_list("rolled_through", flat=True).first()


@dataclass(frozen=True)
class RollupRun:
    first_hour: datetime | None
    rolled_through: datetime | None
    rollups: int
    deleted: int


def roll_up(now: datetime | None = None) -> RollupRun:
    """Sum the hours that are over (and the last few again), then expire old raw rows."""
    now = now or timezone.now()
    end = hour_of(now)
    current = mark()
    if current is None:
        oldest = UsageRecord.objects.order_by("started_at").values_list("started_at", flat=True)
        first_row = oldest.first()
        if first_row is None:
            return RollupRun(None, None, 0, expire_raw(now))
        start = hour_of(first_row)
    else:
        start = min(current, end) - timedelta(hours=REROLL_HOURS)
    end = min(end, start + timedelta(hours=MAX_HOURS_PER_RUN))
    written = 0
    if start < end:
        written = _replace_hours(start, end, advance_to=end)
    return RollupRun(start, end, written, expire_raw(now))


# One statement, summed by the database: no row passes through Python, so a first run over
# months of rows costs what the aggregate costs. The table and column names are constants.
_ROLLUP_SQL = (
    "INSERT INTO gateway_usagerollup (hour, key_id, user_id, model, status, requests,"
    " prompt_tokens, completion_tokens, cached_tokens)"
    " SELECT {hour}, COALESCE(api_key_id, 0), COALESCE(user_id, 0), model, status, COUNT(*),"
    " SUM(prompt_tokens), SUM(completion_tokens), SUM(cached_tokens)"
    " FROM gateway_usagerecord WHERE started_at >= %s AND started_at < %s"
    " GROUP BY {hour}, COALESCE(api_key_id, 0), COALESCE(user_id, 0), model, status"
)
_HOUR = {
    "postgresql": "date_trunc('hour', started_at)",
    # Django keeps SQLite datetimes as UTC text; the hour is the same text, minutes zeroed.
    "sqlite": "strftime('%%Y-%%m-%%d %%H:00:00', started_at)",
}


def _replace_hours(start: datetime, end: datetime, *, advance_to: datetime) -> int:
    adapt = connection.ops.adapt_datetimefield_value
    with transaction.atomic():
        UsageRollup.objects.filter(hour__gte=start, hour__lt=end).delete()
        with connection.cursor() as cursor:
            cursor.execute(
                _ROLLUP_SQL.format(hour=_HOUR[connection.vendor]), [adapt(start), adapt(end)]
            )
            written = int(cursor.rowcount)
        # Never moves back: a slow run that started earlier cannot undo a later one's mark.
        updated = RollupMark.objects.filter(name=MARK, rolled_through__lt=advance_to).update(
            rolled_through=advance_to
        )
        if not updated and not RollupMark.objects.filter(name=MARK).exists():
            RollupMark.objects.create(name=MARK, rolled_through=advance_to)
    return written


def expire_raw(now: datetime) -> int:
    """Delete raw rows past retention that are rolled up, a batch at a time. Returns how many."""
    cutoff = now - timedelta(days=int(settings.LLMGW_USAGE_RETENTION_DAYS))
    rolled = mark()
    if rolled is None:
        return 0
    cutoff = min(cutoff, rolled)
    deleted = 0
    for _ in range(MAX_DELETE_BATCHES):
        ids = list(
            UsageRecord.objects.filter(started_at__lt=cutoff)
            .order_by()
            .values_list("id", flat=True)[:DELETE_BATCH]
        )
        if not ids:
            break
        with transaction.atomic():
            deleted += UsageRecord.objects.filter(id__in=ids).delete()[0]
    if deleted:
        logger.info("usage retention: %d raw rows deleted", deleted)
    return deleted


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class Selector:
    """Whose usage: one key, one user, or the members of one team (none: everyone)."""

    key_id: int | None = None
    user_id: int | None = None
    team_id: int | None = None
    model: str | None = None
    username: str | None = None
    key_prefix: str | None = None

    def _user_ids(self) -> list[int] | None:
        if self.team_id is not None:
            return list(
                get_user_model()
                .objects.filter(groups__id=self.team_id)
                .values_list("id", flat=True)
            )
        if self.username is not None:
            return list(
                get_user_model().objects.filter(username=self.username).values_list("id", flat=True)
            )
        return None

    def _key_ids(self) -> list[int] | None:
        if self.key_prefix is not None:
            return list(ApiKey.objects.filter(prefix=self.key_prefix).values_list("id", flat=True))
        return None

    def raw(self, rows: QuerySet[UsageRecord]) -> QuerySet[UsageRecord]:
        return self._narrow(rows, key_field="api_key_id")

    def rolled(self, rows: QuerySet[UsageRollup]) -> QuerySet[UsageRollup]:
        return self._narrow(rows, key_field="key_id")

    def _narrow(self, rows: QuerySet[_Row], *, key_field: str) -> QuerySet[_Row]:
        """The rows this scope covers; raw rows and rollups name the key's column apart."""
        if self.key_id is not None:
            rows = rows.filter(**{key_field: self.key_id})
        if self.user_id is not None:
            rows = rows.filter(user_id=self.user_id)
        users, keys = self._user_ids(), self._key_ids()
        if users is not None:
            rows = rows.filter(user_id__in=users)
        if keys is not None:
            rows = rows.filter(**{f"{key_field}__in": keys})
        if self.model is not None:
            rows = rows.filter(model=self.model)
        return rows


@dataclass(frozen=True)
class Totals:
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of the prompt tokens, those the engine found in its prefix cache

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def __add__(self, other: Totals) -> Totals:
        return Totals(
            self.requests + other.requests,
            self.errors + other.errors,
            self.prompt_tokens + other.prompt_tokens,
            self.completion_tokens + other.completion_tokens,
            self.cached_tokens + other.cached_tokens,
        )


@dataclass(frozen=True)
class _Plan:
    """Which hours a read takes from rollups, and which raw rows cover the rest."""

    rolled: tuple[datetime, datetime] | None  # [from, until) of whole hours before the mark
    raw: Q


def _plan(since: datetime | None, until: datetime | None) -> _Plan:
    """Rollups for the whole hours of [since, until) before the mark; raw rows for the part
    of an hour at the start, and for everything from the mark (or the last whole hour) on."""
    rolled = mark()
    everything = Q()
    if since is not None:
        everything &= Q(started_at__gte=since)
    if until is not None:
        everything &= Q(started_at__lt=until)
    if rolled is None:
        return _Plan(None, everything)
    first = datetime.min.replace(tzinfo=UTC) if since is None else hour_of(since)
    if since is not None and first < since:
        first += timedelta(hours=1)
    last = rolled if until is None else min(rolled, hour_of(until))
    if last <= first:
        return _Plan(None, everything)
    raw = Q(started_at__gte=last) & (Q() if until is None else Q(started_at__lt=until))
    if since is not None and since < first:
        raw |= Q(started_at__gte=since, started_at__lt=first)
    return _Plan((first, last), raw)


def totals(
    selector: Selector, since: datetime | None = None, until: datetime | None = None
) -> Totals:
    """Requests, errors and tokens in [since, until): rollups up to the mark, raw rows after."""
    plan = _plan(since, until)
    out = Totals()
    if plan.rolled is not None:
        rolled = selector.rolled(
            UsageRollup.objects.filter(hour__gte=plan.rolled[0], hour__lt=plan.rolled[1])
        )
        got = rolled.aggregate(
            n=Coalesce(Sum("requests"), 0),
            e=Coalesce(Sum("requests", filter=Q(status__gte=400)), 0),
            p=Coalesce(Sum("prompt_tokens"), 0),
            c=Coalesce(Sum("completion_tokens"), 0),
            k=Coalesce(Sum("cached_tokens"), 0),
        )
        out += Totals(got["n"], got["e"], got["p"], got["c"], got["k"])
    raw = selector.raw(UsageRecord.objects.filter(plan.raw))
    got = raw.aggregate(
        requests=Count("id"),
        errors=Count("id", filter=Q(status__gte=400)),
        prompt=Coalesce(Sum("prompt_tokens"), 0),
        completion=Coalesce(Sum("completion_tokens"), 0),
        cached=Coalesce(Sum("cached_tokens"), 0),
    )
    return out + Totals(
        got["requests"], got["errors"], got["prompt"], got["completion"], got["cached"]
    )


_RAW_GROUP = {"model": "model", "user": "user_id", "key": "api_key_id", "day": "day"}
_ROLLED_GROUP = {"model": "model", "user": "user_id", "key": "key_id", "day": "day"}


def summary(
    selector: Selector, by: str, since: datetime | None = None, until: datetime | None = None
) -> dict[Any, Totals]:
    """Totals per model, user id, key id or day (a ``date``) in [since, until)."""
    plan = _plan(since, until)
    out: dict[Any, Totals] = {}
    if plan.rolled is not None:
        rolled = selector.rolled(
            UsageRollup.objects.filter(hour__gte=plan.rolled[0], hour__lt=plan.rolled[1])
        )
        if by == "day":
            rolled = rolled.annotate(day=TruncDate("hour"))
        for row in (
            rolled.values(_ROLLED_GROUP[by])
            .annotate(
                r=Sum("requests"),
                e=Coalesce(Sum("requests", filter=Q(status__gte=400)), 0),
                p=Sum("prompt_tokens"),
                c=Sum("completion_tokens"),
                k=Sum("cached_tokens"),
            )
            .order_by()
        ):
            group = _normal(row[_ROLLED_GROUP[by]], by)
            counted = Totals(row["r"], row["e"], row["p"], row["c"], row["k"])
            out[group] = out.get(group, Totals()) + counted
    raw = selector.raw(UsageRecord.objects.filter(plan.raw))
    if by == "day":
        raw = raw.annotate(day=TruncDate("started_at"))
    for row in (
        raw.values(_RAW_GROUP[by])
        .annotate(
            r=Count("id"),
            e=Count("id", filter=Q(status__gte=400)),
            p=Coalesce(Sum("prompt_tokens"), 0),
            c=Coalesce(Sum("completion_tokens"), 0),
            k=Coalesce(Sum("cached_tokens"), 0),
        )
        .order_by()
    ):
        group = _normal(row[_RAW_GROUP[by]], by)
        counted = Totals(row["r"], row["e"], row["p"], row["c"], row["k"])
        out[group] = out.get(group, Totals()) + counted
    return out


def _normal(group: Any, by: str) -> Any:
    if by in ("user", "key"):
        return group or None  # 0 in a rollup, NULL in a raw row: nobody
    if by == "day" and isinstance(group, datetime):
        return group.date()
    if by == "day" and isinstance(group, str):
        return date.fromisoformat(group[:10])
    return group
