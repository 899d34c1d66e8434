"""Running the reconciler: :class:`Reconciler` keeps this process's claim on the lease between
ticks and runs a tick only while it leads (moving its epoch above any an agent has seen first),
one tick at a time on a host; :func:`process_reconciler` is the one of this process (the Celery
task's state between ticks); :func:`run_loop` ticks until told to stop (``manage.py reconcile
--loop``). A lease lost mid-tick or a store error ends that tick, never the process; once a
claim reaches the store again after one that could not, nodes' silence is counted from then
(no heartbeat could be written meanwhile).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime

from django.conf import settings
from django.db import DatabaseError, close_old_connections, connection
from django.db.models import Max
from django.utils import timezone
from redis.exceptions import RedisError

from control import leases, nudges
from control.leases import Leadership, LeadershipLost
from control.models import Node
from control.reconciler.tick import TickResult, tick

logger = logging.getLogger(__name__)


def highest_agent_epoch() -> int:
    """The highest leader epoch any agent reported having seen (0: none reported one)."""
    return int(Node.objects.aggregate(highest=Max("agent_epoch"))["highest"] or 0)


class Reconciler:
    """Keeps this process's claim between ticks and runs one tick at a time on this host."""

    def __init__(self) -> None:
        self.leadership: Leadership | None = None
        self.resume_after: int | None = None
        # When a claim reached the store again after one that could not: heartbeats written
        # by the web processes could not reach it either until then.
        self.store_back_at: datetime | None = None
        self._store_lost = False

    def run_once(self) -> TickResult:
        with _one_tick_at_a_time() as got_it:
            if not got_it:
                logger.info("a tick is already running on this host; skipping")
                return TickResult(acted=False)
            close_old_connections()
            started = time.monotonic()
            self.leadership = leases.claim(previous=self.leadership)
            self._note_store(self.leadership)
            if not self.leadership.may_act():
                logger.debug("tick: follower (epoch %s)", self.leadership.epoch)
                return TickResult(acted=False, epoch=self.leadership.epoch)
            try:
                self.leadership = leases.advance_epoch(self.leadership, highest_agent_epoch())
                with nudges.batched():
                    result = tick(
                        self.leadership,
                        budget=settings.LLMGW_RECONCILE_TICK_BUDGET,
                        resume_after=self.resume_after,
                        heard_from=self.store_back_at,
                    )
                self.resume_after = result.resume_after
                logger.debug(
                    "tick: leader epoch %s, %s placed, %s changed, %.0f ms",
                    result.epoch,
                    result.placed,
                    result.changed,
                    (time.monotonic() - started) * 1000,
                )
                return result
            except LeadershipLost as exc:
                logger.warning("lost leadership mid-tick; remaining writes dropped: %s", exc)
                return TickResult(acted=True, epoch=self.leadership.epoch, lost_leadership=True)
            except DatabaseError as exc:
                logger.warning("tick aborted, store error: %s", type(exc).__name__)
                connection.close_if_unusable_or_obsolete()
                return TickResult(acted=False, epoch=self.leadership.epoch)
            except RedisError as exc:
                # The gateway's in-flight counts cannot be read: nothing is scaled down, evicted
                # or drained on a guess; the next tick reads them again.
                logger.warning("tick aborted, Redis error: %s", type(exc).__name__)
                return TickResult(acted=False, epoch=self.leadership.epoch)

    def _note_store(self, claimed: Leadership) -> None:
        if claimed.store_error:
            self._store_lost = True
        elif self._store_lost:
            self._store_lost = False
            self.store_back_at = timezone.now()

    def shutdown(self) -> None:
        """Graceful stop: give the lease back so a standby takes over at once."""
        if self.leadership is not None:
            leases.release(self.leadership)
            self.leadership = None


@contextmanager
def _one_tick_at_a_time() -> Iterator[bool]:
    """A host-wide lock (a worker with several processes, or a `reconcile --loop` beside it)."""
    path = settings.VAR_DIR / "reconciler.lock"
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


_process_reconciler: Reconciler | None = None


def process_reconciler() -> Reconciler:
    """The one Reconciler of this process (the Celery task's state between ticks)."""
    global _process_reconciler
    if _process_reconciler is None:
        _process_reconciler = Reconciler()
    return _process_reconciler


def run_loop(interval: float, stop: threading.Event) -> None:
    """`manage.py reconcile --loop`: tick every ``interval`` seconds until ``stop`` is set."""
    reconciler = process_reconciler()
    try:
        while not stop.is_set():
            started = time.monotonic()
            result = reconciler.run_once()
            if not result.more_to_place:
                stop.wait(max(0.0, interval - (time.monotonic() - started)))
    finally:
        reconciler.shutdown()
