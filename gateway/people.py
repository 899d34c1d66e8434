"""Limits that belong to people: a user's and a team's limits, what they have spent, and the
rule that a self-service key can only narrow them.

The request path enforces these through ``gateway.keys`` (a key's scopes) and
``gateway.limits`` (counters shared by every key of a user or team). This module serves the
pages: what ``/account/`` and the admin show (spend against budget per key, user and team)
and the checks a self-made key passes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser, Group
from django.db import transaction

from control import serving
from gateway import limits, rollups
from gateway.models import ApiKey, TeamLimits, UserLimits


@dataclass(frozen=True)
class LimitView:
    """One holder's limits as a page shows them, with the budget's spend and what is left."""

    holder: str  # "your account", "team 'ml'", "key llmgw-abc…"
    models: list[str]  # empty: every model
    rpm_limit: int | None
    tpm_limit: int | None
    token_budget: int | None
    budget_period: str
    spent: int  # tokens in the current budget period
    period_start: datetime

    @property
    def left(self) -> int | None:
        return None if self.token_budget is None else max(0, self.token_budget - self.spent)


def period_start(period: str, now: float | None = None) -> datetime:
    start, _ = limits.period_bounds(period, time.time() if now is None else now)
    return datetime.fromtimestamp(start, tz=UTC)


def spent(selector: rollups.Selector, since: datetime) -> int:
    """Tokens (prompt + completion) recorded since ``since``: rollups, then recent raw rows."""
    return rollups.totals(selector, since).tokens


def user_limits(user_id: int) -> UserLimits | None:
    return UserLimits.objects.filter(user_id=user_id).first()


def self_service_allowed(user_id: int) -> bool:
    own = user_limits(user_id)
    return own is None or own.self_service


def views_for_user(user: AbstractBaseUser) -> list[LimitView]:
    """The user's own limits and those of each of their teams, with spend and what is left."""
    out = []
    own = user_limits(int(user.pk))
    if own is not None:
        since = period_start(own.budget_period)
        out.append(
            _view("your account", own, spent(rollups.Selector(user_id=int(user.pk)), since), since)
        )
    for team in TeamLimits.objects.filter(team__user__id=user.pk).select_related("team"):
        since = period_start(team.budget_period)
        used = spent(rollups.Selector(team_id=team.team_id), since)
        out.append(_view(f"team '{team.team.name}'", team, used, since))
    return out


def _view(
    holder: str, row: UserLimits | TeamLimits | ApiKey, used: int, since: datetime
) -> LimitView:
    return LimitView(
        holder,
        list(row.allowed_models or []),
        row.rpm_limit,
        row.tpm_limit,
        row.token_budget,
        row.budget_period,
        used,
        since,
    )


def key_view(key: ApiKey) -> LimitView:
    since = period_start(key.budget_period)
    return _view(f"key {key.prefix}…", key, spent(rollups.Selector(key_id=key.pk), since), since)


def user_spend(limits_row: UserLimits) -> int:
    return spent(
        rollups.Selector(user_id=limits_row.user_id), period_start(limits_row.budget_period)
    )


def team_spend(limits_row: TeamLimits) -> int:
    return spent(
        rollups.Selector(team_id=limits_row.team_id), period_start(limits_row.budget_period)
    )


def narrowing_problems(
    views: list[LimitView],
    *,
    models: list[str],
    rpm: int | None,
    tpm: int | None,
    budget: int | None,
) -> list[str]:
    """Why a self-made key's limits would not narrow its owner's (pure): every model must be
    one the owner may use, and no limit may be above the owner's. Empty: fine."""
    problems = []
    for view in views:
        if view.models and models:  # no list of its own: the key inherits the owner's
            outside = sorted(set(models) - set(view.models))
            if outside:
                problems.append(
                    f"{view.holder} may use only {', '.join(view.models)}; not {', '.join(outside)}"
                )
        for label, asked, limit in (
            ("requests per minute", rpm, view.rpm_limit),
            ("tokens per minute", tpm, view.tpm_limit),
            ("token budget", budget, view.token_budget),
        ):
            if limit is not None and asked is not None and asked > limit:
                problems.append(f"{label} {asked} is above {view.holder}'s {limit}")
    return problems


# --------------------------------------------------------------------------- changes

# What a user's or team's limits row holds (a user's also ``self_service``).
LIMIT_FIELDS = ("allowed_models", "rpm_limit", "tpm_limit", "token_budget", "budget_period")
_PERIODS = frozenset(ApiKey.BudgetPeriod.values)


class LimitsInvalid(ValueError):
    """A limit value no holder can have; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _checked(changes: dict[str, object], allowed: frozenset[str]) -> dict[str, object]:
    """The changes, normalised (a model list sorted and without repeats), or LimitsInvalid.
    Every edge (the admin's form, the admin API) has already checked its own input; this is the
    last word, so a shell or a future edge cannot store a limit the request path misreads."""
    out: dict[str, object] = {}
    for name, given in changes.items():
        value = given
        if name not in allowed:
            raise LimitsInvalid(name, f"{name} is not a limit")
        if name == "allowed_models":
            if not isinstance(value, list) or not all(isinstance(m, str) and m for m in value):
                raise LimitsInvalid(name, "a list of model names; empty: every model")
            value = sorted(set(value))
        elif name == "budget_period":
            if value not in _PERIODS:
                raise LimitsInvalid(name, f"one of {', '.join(sorted(_PERIODS))}")
        elif name == "self_service":
            if not isinstance(value, bool):
                raise LimitsInvalid(name, "true or false")
        elif value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise LimitsInvalid(name, "a whole number, or null for no limit")
        elif value is not None and value < 0:
            raise LimitsInvalid(name, "zero or more, or null for no limit")
        out[name] = value
    return out


def _describe(changes: dict[str, dict[str, object]]) -> str:
    def shown(value: object) -> str:
        if isinstance(value, list):
            return ",".join(value) or "all"
        return "none" if value is None else str(value)

    return ", ".join(
        f"{name} {shown(change['from'])} → {shown(change['to'])}"
        for name, change in changes.items()
    )


def _set(
    row_model: type[UserLimits] | type[TeamLimits],
    holder: dict[str, Any],
    subject: str,
    actor: str,
    values: dict[str, object],
) -> UserLimits | TeamLimits:
    """Make or change one holder's limits row, and say so in the audit trail (who, and each
    field's old and new value) when anything changed."""
    with transaction.atomic():
        row, created = row_model.objects.select_for_update().get_or_create(**holder)
        diff = {
            name: {"from": getattr(row, name), "to": value}
            for name, value in values.items()
            if getattr(row, name) != value
        }
        for name, change in diff.items():
            setattr(row, name, change["to"])
        if diff:
            row.save()
        if diff or created:
            verb = "set" if created else "changed"
            serving.record_operator_event(
                subject,
                f"limits {verb} by {actor}" + (f": {_describe(diff)}" if diff else ""),
                {"actor": actor, "changes": diff},
            )
    return row


def set_user_limits(user_id: int, *, actor: str, **changes: object) -> UserLimits:
    """Set the given limits (and ``self_service``) of one user, making their limits row if
    they have none; fields not given keep their value. Keys take the change up within the
    key cache's TTL. The one function the admin's user limits pages, ``manage.py set_limits``
    and the admin API call; ``actor`` says who, for the audit trail."""
    values = _checked(changes, frozenset({*LIMIT_FIELDS, "self_service"}))
    row = _set(UserLimits, {"user_id": user_id}, f"user/{_username(user_id)}", actor, values)
    assert isinstance(row, UserLimits)
    return row


def set_team_limits(team_id: int, *, actor: str, **changes: object) -> TeamLimits:
    """Set the given limits of one team (a Django group), making its limits row if it has
    none; fields not given keep their value. See :func:`set_user_limits`."""
    values = _checked(changes, frozenset(LIMIT_FIELDS))
    row = _set(TeamLimits, {"team_id": team_id}, f"team/{_team_name(team_id)}", actor, values)
    assert isinstance(row, TeamLimits)
    return row


def clear_user_limits(user_id: int, *, actor: str) -> bool:
    """No limits of the user's own any more (their keys' and teams' still apply), and
    self-service back on. True if there were any."""
    with transaction.atomic():
        deleted, _ = UserLimits.objects.filter(user_id=user_id).delete()
        if deleted:
            serving.record_operator_event(
                f"user/{_username(user_id)}", f"limits removed by {actor}", {"actor": actor}
            )
    return bool(deleted)


def clear_team_limits(team_id: int, *, actor: str) -> bool:
    """No limits of the team's any more. True if there were any."""
    with transaction.atomic():
        deleted, _ = TeamLimits.objects.filter(team_id=team_id).delete()
        if deleted:
            serving.record_operator_event(
                f"team/{_team_name(team_id)}", f"limits removed by {actor}", {"actor": actor}
            )
    return bool(deleted)


def _username(user_id: int) -> str:
    name = get_user_model().objects.filter(pk=user_id).values_list("username", flat=True).first()
    return str(name) if name is not None else f"#{user_id}"


def _team_name(team_id: int) -> str:
    name = Group.objects.filter(pk=team_id).values_list("name", flat=True).first()
    return str(name) if name is not None else f"#{team_id}"
