"""Budget counters put right from the usage records.

A budget is enforced by a counter (``gateway.identity.counters``): in Redis when it is
configured, in the store otherwise. Counters are fast, but one can be lost (a Redis restarted
without persistence, a key evicted under memory pressure, a flushed database), and a lost
counter starts its period again at zero: the holder could spend its whole budget a second time.
So the leader periodically reads what each budget holder spent this period from the records
(rollups plus the recent raw rows, as ``/account/`` and the admin show it) and lifts the
holder's counter to at least that. It never lowers one: a counter also holds the reservations of
requests still running, which no record shows yet.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from gateway.identity import allowances, counters, limits
from gateway.ledger import rollups
from gateway.models import ApiKey, TeamLimits, UserLimits


def budget_holders() -> Iterator[tuple[str, int, str, rollups.Selector]]:
    """(scope, budget, period, whose usage) of every key, user and team with a budget; the
    scope names are those of ``gateway.identity.keys`` (a key by its prefix)."""
    keys = ApiKey.objects.filter(token_budget__isnull=False, revoked_at__isnull=True)
    for key_id, prefix, budget, period in keys.values_list(
        "pk", "prefix", "token_budget", "budget_period"
    ):
        yield f"key:{prefix}", int(budget or 0), period, rollups.Selector(key_id=key_id)
    users = UserLimits.objects.filter(token_budget__isnull=False)
    for user_id, budget, period in users.values_list("user_id", "token_budget", "budget_period"):
        yield f"user:{user_id}", int(budget or 0), period, rollups.Selector(user_id=user_id)
    teams = TeamLimits.objects.filter(token_budget__isnull=False)
    for team_id, budget, period in teams.values_list("team_id", "token_budget", "budget_period"):
        yield f"team:{team_id}", int(budget or 0), period, rollups.Selector(team_id=team_id)


def refresh(now: float | None = None) -> int:
    """Lift every budget counter of the current period to what the records say was spent;
    returns how many were below (each one a counter that had lost spend)."""
    now = time.time() if now is None else now
    floors = []
    for scope, budget, period, whose in budget_holders():
        spent = allowances.spent(whose, allowances.period_start(period, now))
        if spent > 0:
            floors.append(limits.budget_counter(scope, budget, period, spent, now))
    return counters.raise_counters(floors)
