"""Hourly usage rollups: summed once however often they run, read together with the recent
raw rows, and raw rows expired in batches while the rollups stay."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from control import leases
from control.reconciler.runner import process_reconciler
from gateway import tasks
from gateway.ledger import reports, rollups
from gateway.models import RollupMark, UsageRecord, UsageRollup
from tests.harness.factories import make_key, make_usage

pytestmark = pytest.mark.django_db

NOW = datetime(2026, 3, 18, 12, 30, tzinfo=UTC)


@pytest.fixture
def history() -> tuple[Any, Any]:
    """Rows over the last three days for two keys of two users, some failed."""
    _, first = make_key("alice")
    _, second = make_key("bob")
    for hours_ago in range(0, 72, 5):
        at = NOW - timedelta(hours=hours_ago, minutes=7)
        make_usage(model="a", api_key=first, started_at=at, prompt_tokens=10, completion_tokens=5,
                   cached_tokens=4)  # fmt: skip
        make_usage(model="b", api_key=second, started_at=at, status=503, completion_tokens=0)
    return first, second


def raw_totals(**filters: Any) -> rollups.Totals:
    rows = UsageRecord.objects.filter(**filters)
    return rollups.Totals(
        rows.count(),
        rows.filter(status__gte=400).count(),
        sum(r.prompt_tokens for r in rows),
        sum(r.completion_tokens for r in rows),
        sum(r.cached_tokens for r in rows),
    )


def test_rollups_sum_the_hours_that_are_over_and_running_twice_changes_nothing(
    history: tuple[Any, Any],
) -> None:
    first, _ = history
    run = rollups.roll_up(NOW)
    assert run.rolled_through == NOW.replace(minute=0)
    assert rollups.mark() == NOW.replace(minute=0)
    snapshot = sorted(
        UsageRollup.objects.values_list("hour", "key_id", "model", "status", "requests")
    )
    assert rollups.roll_up(NOW).rollups >= 0
    again = sorted(UsageRollup.objects.values_list("hour", "key_id", "model", "status", "requests"))
    assert again == snapshot
    rolled = UsageRollup.objects.filter(key_id=first.pk)
    assert (
        sum(r.requests for r in rolled)
        == UsageRecord.objects.filter(api_key=first, started_at__lt=NOW.replace(minute=0)).count()
    )


def test_readers_add_the_rollups_and_the_recent_raw_rows(history: tuple[Any, Any]) -> None:
    first, second = history
    before = rollups.totals(rollups.Selector(key_id=first.pk))
    rollups.roll_up(NOW)
    # The current hour's row is raw, the rest rolled up: the sum is the same.
    assert rollups.totals(rollups.Selector(key_id=first.pk)) == before == raw_totals(api_key=first)
    since = NOW - timedelta(hours=30, minutes=20)  # off the hour: a raw head, then rollups
    assert rollups.totals(rollups.Selector(user_id=second.user_id), since) == raw_totals(
        user_id=second.user_id, started_at__gte=since
    )
    by_model = {r.group: r for r in reports.summary_rows(reports.UsageFilter(), "model")}
    assert by_model["a"].requests == raw_totals(model="a").requests
    assert by_model["b"].errors == raw_totals(model="b").errors
    by_key = {r.group for r in reports.summary_rows(reports.UsageFilter(), "key")}
    assert by_key == {first.prefix, second.prefix}
    by_day = {r.group: r.requests for r in reports.summary_rows(reports.UsageFilter(), "day")}
    raw_days: dict[str, int] = {}
    for row in UsageRecord.objects.all():
        day = row.started_at.astimezone(UTC).date().isoformat()
        raw_days[day] = raw_days.get(day, 0) + 1
    assert by_day == raw_days


def test_a_row_that_arrives_late_for_a_recent_hour_is_counted(history: tuple[Any, Any]) -> None:
    first, _ = history
    rollups.roll_up(NOW)
    late = make_usage(
        model="a", api_key=first, started_at=NOW - timedelta(hours=2), completion_tokens=100
    )
    rollups.roll_up(NOW)
    hour = rollups.hour_of(late.started_at)
    rolled = UsageRollup.objects.filter(hour=hour, key_id=first.pk)
    assert sum(r.completion_tokens for r in rolled) == 100


def test_raw_rows_past_retention_are_deleted_in_batches_and_the_rollups_stay(
    history: tuple[Any, Any], settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, _ = history
    settings.LLMGW_USAGE_RETENTION_DAYS = 1
    monkeypatch.setattr(rollups, "DELETE_BATCH", 3)
    whole = rollups.totals(rollups.Selector(key_id=first.pk))
    old = UsageRecord.objects.filter(started_at__lt=NOW - timedelta(days=1)).count()
    assert old > 3
    rollups.roll_up(NOW)
    assert not UsageRecord.objects.filter(started_at__lt=NOW - timedelta(days=1)).exists()
    assert UsageRecord.objects.filter(started_at__gte=NOW - timedelta(days=1)).exists()
    assert rollups.totals(rollups.Selector(key_id=first.pk)) == whole


def test_nothing_is_deleted_that_is_not_rolled_up(history: tuple[Any, Any], settings: Any) -> None:
    settings.LLMGW_USAGE_RETENTION_DAYS = 1
    count = UsageRecord.objects.count()
    assert rollups.expire_raw(NOW) == 0  # no mark yet
    assert UsageRecord.objects.count() == count


def test_the_beat_task_acts_only_on_the_leader(
    history: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    reconciler = process_reconciler()
    monkeypatch.setattr(reconciler, "leadership", None)
    tasks.roll_up_usage()
    assert not RollupMark.objects.exists()
    monkeypatch.setattr(reconciler, "leadership", leases.claim())
    assert reconciler.leadership is not None and reconciler.leadership.may_act()
    tasks.roll_up_usage()
    assert RollupMark.objects.exists() and UsageRollup.objects.exists()
