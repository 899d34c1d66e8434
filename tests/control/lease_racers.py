"""Bodies of the processes that race for the lease in ``test_lease_race.py``.

Each runs in its own interpreter (multiprocessing "spawn"), so it has its own connection, its
own owner id and its own clocks, exactly like separate control planes on one store.
"""

from __future__ import annotations

import os
import time
from typing import Any


def setup_django(database_url: str) -> None:
    os.environ["DATABASE_URL"] = database_url
    os.environ.setdefault("SECRET_KEY", "llmgw-checks-only-not-a-secret")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
    import django

    django.setup()


def race_rounds(index: int, database_url: str, rounds: int, barrier: Any, results: Any) -> None:
    """All racers claim at once each round; racer 0 then expires the lease for the next round."""
    setup_django(database_url)
    from django.db import connection

    from control import leases

    owner = leases.owner_id()
    for round_number in range(rounds):
        barrier.wait()
        result = leases.claim("race", owner=owner, ttl=60)
        results.put((round_number, owner, result.is_leader, result.epoch))
        barrier.wait()
        if index == 0:
            with connection.cursor() as cursor:
                cursor.execute("UPDATE control_lease SET expires_at_ms = 0 WHERE name = 'race'")
        barrier.wait()
    connection.close()


def contend(
    index: int, database_url: str, seconds: float, skew: float, start: Any, results: Any
) -> None:
    """Claim in a loop with a short TTL; whenever this racer believes it leads, make a fenced
    write stamped with its owner and epoch. A racer with ``skew`` runs on clocks that are off
    by that many seconds: its monotonic clock and its wall clock (which, on SQLite, is what
    ``llmgw_clock_ms()`` reads in this process: a database clock that jumped)."""
    if skew:
        real_time, real_time_ns, real_monotonic = time.time, time.time_ns, time.monotonic
        time.time = lambda: real_time() + skew
        time.time_ns = lambda: real_time_ns() + int(skew * 1e9)
        time.monotonic = lambda: real_monotonic() + skew
    setup_django(database_url)
    from django.db import connection

    from control import leases
    from control.models import Event

    owner = leases.owner_id()
    start.wait()
    deadline = time.monotonic() + seconds
    current: leases.Leadership | None = None
    claims = writes = 0
    while time.monotonic() < deadline:
        current = leases.claim(
            "contended", owner=owner, previous=current, ttl=0.3, renew_deadline=0.2
        )
        claims += 1
        if current.may_act():
            try:
                with leases.fenced(current):
                    Event.objects.create(
                        kind=Event.Kind.LEADERSHIP,
                        subject="race",
                        message=owner,
                        epoch=current.epoch,
                        data={"owner": owner, "epoch": current.epoch},
                    )
                writes += 1
            except leases.LeadershipLost:
                pass
            if writes % 5 == 0:
                # Hand over now and then, so the lease changes hands many times.
                leases.release(current)
                time.sleep(0.05)
        time.sleep(0.01 * (index + 1))
    results.put((owner, claims))
    connection.close()


def report_owner_id(database_url: str, results: Any) -> None:
    setup_django(database_url)
    from control import leases

    results.put(leases.owner_id())
