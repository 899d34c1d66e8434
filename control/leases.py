"""The leadership lease: who may run the reconciler, and the fence around its writes.

The lease is a row with an expiry, not a lock held by a connection, so it survives a leader
that is powered off, works behind poolers and on both backends. Taking and renewing are one
statement (an upsert guarded by "I own it or it expired"), so two racers cannot both win and
renewing cannot disagree with taking. A holder whose claim was answered past its renew
deadline renews no more (it only takes an expired lease), so a store slow for one host lets
the lease expire for a standby instead of keeping it alive for a holder that never acts. The
decision is made on the database's clock (``llmgw_clock_ms()``, see ``control.dbclock``); this
process's own clock only bounds how long it keeps acting on a claim it could not confirm (the
renew deadline, on a monotonic clock).

Every write the reconciler makes happens inside :func:`fenced`, which re-checks owner and epoch
in the same transaction while holding the lease row, so a deposed leader's writes change nothing.

On SQLite, where every writer queues for one write lock, the lease path waits for that lock no
longer than the holder could act on what it gets: a renew at most its renew deadline, a fenced
block at most what is left of it. A lock still held then is "database is locked", a store error
like any other: the renew counts as "store unreachable this round", the fenced block as a tick
aborted, and the next tick tries again (other writers keep waiting the busy timeout,
``LLMGW_SQLITE_BUSY_TIMEOUT``, as they should: their work is not on a deadline).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

from django.conf import settings
from django.db import DatabaseError, connection, transaction

logger = logging.getLogger(__name__)

RECONCILER = "reconciler"

Clock = Callable[[], float]

# The same SQL text on SQLite (3.35+) and PostgreSQL. In DO UPDATE, column references on the
# right-hand side read the existing row, so the epoch rises exactly when the owner changes.
# The last parameter says whether the holder may renew (see Leadership.may_renew): without it
# the statement takes an expired lease and nothing else.
CLAIM_SQL = """
INSERT INTO control_lease (name, owner, epoch, expires_at_ms)
VALUES (%s, %s, 1, llmgw_clock_ms() + %s)
ON CONFLICT (name) DO UPDATE SET
    epoch = CASE WHEN control_lease.owner = excluded.owner
                 THEN control_lease.epoch ELSE control_lease.epoch + 1 END,
    owner = excluded.owner,
    expires_at_ms = excluded.expires_at_ms
WHERE (control_lease.owner = excluded.owner AND %s)
   OR control_lease.expires_at_ms <= llmgw_clock_ms()
RETURNING epoch, expires_at_ms
"""

# Clearing the owner makes the next claimer, whoever it is, start a new epoch at once.
RELEASE_SQL = """
UPDATE control_lease SET owner = '', expires_at_ms = 0
WHERE name = %s AND owner = %s AND epoch = %s
"""

# A no-op update that succeeds only for the live holder. It also locks the row until commit
# (PostgreSQL row lock; SQLite's IMMEDIATE transaction holds the database write lock), so no
# claim can take the lease between this check and the fenced writes' commit.
FENCE_SQL = """
UPDATE control_lease SET epoch = epoch
WHERE name = %s AND owner = %s AND epoch = %s AND expires_at_ms > llmgw_clock_ms()
"""

# Move the live holder's epoch up (never down) without a change of owner: an agent has seen a
# higher epoch than this store's, from a store since restored or reset.
ADVANCE_SQL = """
UPDATE control_lease SET epoch = %s
WHERE name = %s AND owner = %s AND epoch = %s AND epoch < %s
  AND expires_at_ms > llmgw_clock_ms()
"""

# PostgreSQL only, inside the fence's transaction: a holder that stops between two statements
# (SIGSTOP, a stalled VM, a debugger) keeps the lease row locked, and every standby's claim
# would wait on that lock for as long as the holder is frozen, however long ago its lease
# expired. The server ends such a session once it has sat idle in the transaction for a TTL:
# its writes roll back, the lock goes, and the standby's claim goes through.
IDLE_LIMIT_SQL = "SELECT set_config('idle_in_transaction_session_timeout', %s, true)"

READ_SQL = """
SELECT owner, epoch, expires_at_ms, llmgw_clock_ms() FROM control_lease WHERE name = %s
"""


@contextmanager
def _lock_wait_at_most(seconds: float) -> Iterator[None]:
    """On SQLite, wait at most ``seconds`` for its write lock inside the block (then
    OperationalError "database is locked"), instead of the busy timeout."""
    if connection.vendor != "sqlite":
        yield
        return
    usual = float(connection.settings_dict.get("OPTIONS", {}).get("timeout", 5.0))
    _set_lock_wait(min(usual, max(0.0, seconds)))
    try:
        yield
    finally:
        try:
            _set_lock_wait(usual)
        except DatabaseError:
            # Not left short for the other writers of this process: a new connection gets
            # the busy timeout it was opened with.
            with contextlib.suppress(DatabaseError):
                connection.close()


def _set_lock_wait(seconds: float) -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"PRAGMA busy_timeout = {int(seconds * 1000)}")


class LeadershipLost(Exception):
    """A fenced block ran without the lease; none of its writes were kept."""


_owner: tuple[int, str] | None = None


def _forget_owner() -> None:
    global _owner
    _owner = None


os.register_at_fork(after_in_child=_forget_owner)


def owner_id() -> str:
    """This process's owner id: random, made after fork, never reused by a restarted process.

    The host and pid are only there to help a human reading ``manage.py lease``.
    """
    global _owner
    pid = os.getpid()
    if _owner is None or _owner[0] != pid:
        _owner = (pid, f"{socket.gethostname()}:{pid}:{secrets.token_hex(8)}")
    return _owner[1]


@dataclass(frozen=True)
class Leadership:
    """The outcome of one claim: whether this process leads, and until when it may act."""

    name: str
    owner: str
    epoch: int
    is_leader: bool
    # On this process's monotonic clock: the holder must not act after this instant unless
    # a later claim confirms the lease again.
    act_until: float
    store_error: str = ""
    # Whether this process's next claim may renew the row it holds. False once a claim came
    # back past its renew deadline, until one is answered in time: every statement to a store
    # that slow still lands within the TTL, so its renewals would keep the row alive for ever
    # while this process, never confirmed in time, never acts, and no standby could take over.
    may_renew: bool = True

    def may_act(self, clock: Clock = time.monotonic) -> bool:
        return self.is_leader and clock() < self.act_until


def claim(
    name: str = RECONCILER,
    *,
    previous: Leadership | None = None,
    owner: str | None = None,
    ttl: float | None = None,
    renew_deadline: float | None = None,
    clock: Clock = time.monotonic,
) -> Leadership:
    """Take the lease or renew it, in one statement. Call once per tick, outside a transaction.

    ``previous`` is this process's last result: when the store cannot be reached (or is locked)
    the claim is kept, unchanged, until its own deadline passes; an unreachable store is not
    evidence that somebody else leads. A claim answered past the renew deadline leads to no
    action, and the next claims only take the lease once it has expired (``may_renew``).
    """
    owner = owner or owner_id()
    ttl = settings.LLMGW_LEASE_TTL if ttl is None else ttl
    renew_deadline = (
        settings.LLMGW_LEASE_RENEW_DEADLINE if renew_deadline is None else renew_deadline
    )
    # Measured before the statement is sent: the row's expiry is at least this late on the
    # database's clock, so stopping at sent_at + renew_deadline (< ttl) is always in time.
    sent_at = clock()
    mine = previous if previous is not None and previous.owner == owner else None
    may_renew = mine is None or mine.may_renew
    try:
        # A renew that takes SQLite's write lock after its deadline could not be acted on.
        with _lock_wait_at_most(renew_deadline), connection.cursor() as cursor:
            cursor.execute(CLAIM_SQL, [name, owner, int(ttl * 1000), may_renew])
            row = cursor.fetchone()
    except DatabaseError as exc:
        connection.close_if_unusable_or_obsolete()
        kept = mine
        if kept is not None and kept.is_leader:
            logger.warning(
                "lease %s: store unreachable (%s); keeping epoch %s for %.1fs more",
                name,
                type(exc).__name__,
                kept.epoch,
                max(0.0, kept.act_until - clock()),
            )
            return replace(kept, store_error=str(exc))
        logger.warning("lease %s: store unreachable (%s)", name, type(exc).__name__)
        return Leadership(
            name,
            owner,
            epoch=0,
            is_leader=False,
            act_until=0.0,
            store_error=str(exc),
            may_renew=may_renew,
        )

    if row is None:
        result = Leadership(name, owner, 0, is_leader=False, act_until=0.0, may_renew=may_renew)
    else:
        act_until = sent_at + renew_deadline
        in_time = clock() < act_until
        if not in_time:
            logger.warning(
                "lease %s: epoch %s confirmed %.1fs past the renew deadline; not acting, and "
                "not renewing until a claim is answered in time",
                name,
                int(row[0]),
                clock() - act_until,
            )
        result = Leadership(
            name, owner, int(row[0]), is_leader=True, act_until=act_until, may_renew=in_time
        )
    _log_transition(previous, result)
    return result


def _log_transition(previous: Leadership | None, current: Leadership) -> None:
    was_leader = previous is not None and previous.is_leader and previous.epoch == current.epoch
    if current.is_leader and not was_leader:
        logger.info(
            "lease %s: this process (%s) leads, epoch %s",
            current.name,
            current.owner,
            current.epoch,
        )
    elif not current.is_leader and previous is not None and previous.is_leader:
        logger.warning("lease %s: leadership lost (was epoch %s)", current.name, previous.epoch)


def release(leadership: Leadership) -> bool:
    """Give the lease up (graceful shutdown), so a standby need not wait out the TTL."""
    if not leadership.is_leader:
        return False
    try:
        with connection.cursor() as cursor:
            cursor.execute(RELEASE_SQL, [leadership.name, leadership.owner, leadership.epoch])
            released: bool = cursor.rowcount == 1
    except DatabaseError as exc:
        logger.warning("lease %s: could not release (%s)", leadership.name, type(exc).__name__)
        return False
    if released:
        logger.info("lease %s: released epoch %s", leadership.name, leadership.epoch)
    return released


def advance_epoch(leadership: Leadership, above: int) -> Leadership:
    """Move the held lease to an epoch above ``above`` when it is below it.

    Agents refuse desired state stamped lower than the highest epoch they have seen, so a
    leader on a restored or reset store (its epoch counting from 1 again) would be refused
    for ever; it jumps past what the agents report instead. Returns the leadership to act
    with: unchanged when already above, not leading when the row says it no longer holds.
    """
    if not leadership.is_leader or leadership.epoch >= above:
        return leadership
    target = above + 1
    with connection.cursor() as cursor:
        cursor.execute(
            ADVANCE_SQL, [target, leadership.name, leadership.owner, leadership.epoch, target]
        )
        moved = cursor.rowcount == 1
    if not moved:
        logger.warning(
            "lease %s: could not move epoch %s above %s: no longer held",
            leadership.name,
            leadership.epoch,
            above,
        )
        return replace(leadership, is_leader=False, act_until=0.0)
    logger.warning(
        "lease %s: an agent has seen epoch %s; this leader moved from epoch %s to %s",
        leadership.name,
        above,
        leadership.epoch,
        target,
    )
    return replace(leadership, epoch=target)


@dataclass(frozen=True)
class LeaseView:
    """Who holds a lease, read on the database's clock."""

    name: str
    owner: str
    epoch: int
    expires_in: float  # seconds; zero or less means expired

    @property
    def held(self) -> bool:
        return bool(self.owner) and self.expires_in > 0


def read(name: str = RECONCILER) -> LeaseView | None:
    """The lease row as it is now, or None when nobody ever claimed it."""
    with connection.cursor() as cursor:
        cursor.execute(READ_SQL, [name])
        row = cursor.fetchone()
    if row is None:
        return None
    owner, epoch, expires_at_ms, now_ms = row
    return LeaseView(name, str(owner), int(epoch), (int(expires_at_ms) - int(now_ms)) / 1000)


@contextmanager
def fenced(leadership: Leadership, *, clock: Clock = time.monotonic) -> Iterator[None]:
    """Run a block of writes only while ``leadership`` still holds; otherwise keep none of them.

    Raises :class:`LeadershipLost` before the block when the claim is past its deadline or the
    row shows another owner or epoch; the whole transaction (the block's writes included) is then
    rolled back. On PostgreSQL a block that sits idle for a lease TTL (its process frozen) is
    ended by the server, so a frozen holder cannot keep a standby from taking over.
    """
    if not leadership.may_act(clock):
        raise LeadershipLost(
            f"lease {leadership.name}: epoch {leadership.epoch} is past its deadline"
        )
    with _lock_wait_at_most(leadership.act_until - clock()), transaction.atomic():
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute(IDLE_LIMIT_SQL, [str(int(settings.LLMGW_LEASE_TTL * 1000))])
            cursor.execute(FENCE_SQL, [leadership.name, leadership.owner, leadership.epoch])
            if cursor.rowcount != 1:
                raise LeadershipLost(
                    f"lease {leadership.name}: epoch {leadership.epoch} is no longer held by "
                    "this process"
                )
        yield
