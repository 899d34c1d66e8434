"""How fast passwords may be tried for one account, from all addresses together.

django-axes locks a pair (account, address) and an address after the failure limit
(``llmgw_site.signin``). Neither bounds one account guessed from many addresses, each below its
own limit; locking the account itself would hand anybody a lockout of its owner. So the account
is *paced* instead: a burst of attempts, then one attempt per interval, whoever makes them. Its
owner waits at most one interval after an attacker's last attempt, never for good.

The pace is the generic cell rate algorithm: one time per account, when its next attempt is due
(``SignInPace.due_at``). An attempt may go ahead while that time is at most ``burst - 1``
intervals away, and moves it one interval on. The time is taken by compare-and-set, so attempts
racing in from many addresses at once take one slot each, never the same one; a refused attempt
takes nothing, so hammering a paced account does not push its owner's turn further away.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import IntegrityError, transaction

from gateway.models import SignInPace

# A claim lost to racers this many times in a row is refused: many attempts at that moment.
RACES = 5
_NOTHING = timedelta(0)


@dataclass(frozen=True)
class Pace:
    """``burst`` attempts at once, then one per ``interval``."""

    interval: timedelta
    burst: int


def decide(due_at: datetime | None, now: datetime, pace: Pace) -> tuple[datetime | None, timedelta]:
    """(when the next attempt is due after this one, zero) if an attempt may go ahead at
    ``now``; (None, how long until one may) if not. ``due_at`` None: no attempt lately."""
    due = now if due_at is None or due_at < now else due_at
    wait = due - pace.interval * (pace.burst - 1) - now
    if wait > _NOTHING:
        return None, wait
    return due + pace.interval, _NOTHING


def claim(username: str, now: datetime, pace: Pace) -> timedelta:
    """Take one attempt for ``username`` at ``now``: zero when it may go ahead (it counts,
    whatever its outcome), else how long until an attempt may."""
    # A time already past means what no row means: the table holds only accounts tried lately.
    SignInPace.objects.filter(due_at__lt=now).delete()
    for _ in range(RACES):
        current = (
            SignInPace.objects.filter(username=username).values_list("due_at", flat=True).first()
        )
        due, wait = decide(current, now, pace)
        if due is None:
            return wait
        if current is None:
            try:
                with transaction.atomic():
                    SignInPace.objects.create(username=username, due_at=due)
                return _NOTHING
            except IntegrityError:
                continue  # a racer made the row since it was read: read it again
        # Zero rows: a racer moved the time since it was read; read it again.
        if SignInPace.objects.filter(username=username, due_at=current).update(due_at=due):
            return _NOTHING
    return pace.interval
