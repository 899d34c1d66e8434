"""Allowances: what a key, a user or a team may use and has used, as the pages show it, and the
rule that a self-service key can only narrow its owner's.

The request path enforces limits through ``gateway.identity.keys`` (a key's scopes) and
``gateway.identity.limits`` (counters shared by every key of a user or team). This module serves
the pages: what ``/account/`` and the admin show (spend against budget per key, user and team),
the spend the budget counters are put right from (``gateway.identity.budgets``), and the checks
a self-made key passes. Changes to people and their limits are ``gateway.identity.people``'s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime

from django.contrib.auth.models import AbstractBaseUser

from gateway.identity import limits
from gateway.ledger import rollups
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
