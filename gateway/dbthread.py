"""Where ``/v1`` does its database work, and what it knows of whether the store answers.

``/v1`` never queries on the event loop. Its store work runs in two lanes, each one long-lived
thread, so that neither queues behind the other:

- :func:`for_request`: work a request waits for (a key not in the cache, limit counters kept
  in the store, a place among a cold model's waiters, ``/v1/usage``);
- :func:`in_background`: work no request waits for (the routing table, demand and in-flight
  reports, usage rows, reloads of the keys in use, journal sweeps).

Before, both ran in ``sync_to_async``'s one thread: with the store cut, each call there waited
out the pool's timeout, and a request whose key had aged out of the cache queued behind the
routing refresh, the usage writer and the key reloads (docs/scenarios.md, L6).

And it keeps the store's state as the calls find it (:class:`Outage`): a call that cannot reach
the store begins an outage, any call that reaches it ends one. During an outage a request's
call is refused at once (:class:`StoreUnavailable`, which callers answer as they answer any
store error: a cached key, 503 with Retry-After); the background lane keeps trying, and a
refused request has it try once more now and then, so no request waits to find out whether the
store is back. A request's call that has run for
``LLMGW_STORE_WAIT`` seconds (a store that stopped answering mid-call), or that is still
waiting when another call finds the store unreachable, is given up on: the request is
answered, and what the call does if it still completes is undone where it must be
(``undo``).

The background lane keeps its connection (Django's ``close_old_connections()`` would close it
on every call under ``CONN_MAX_AGE=0``, a reconnect each time: docs/decisions.md, 'the
database thread's connection') and
drops it only once it has failed; a broken connection then fails the next call at once, which
is how an outage is noticed within a refresh interval. The request lane, rarely used, gives
its connection back to the pool after each call where there is a pool, so the two lanes hold
no more of it than the one thread did.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Final, TypeVar, TypeVarTuple

from django.conf import settings
from django.db import InterfaceError, OperationalError, connection, connections

logger = logging.getLogger(__name__)

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

# The errors that mean "the store is not there" (down, unreachable, a pool without a free
# connection, SQLite's file gone or locked): every call would fail alike.
UNREACHABLE: Final = (OperationalError, InterfaceError)
# During an outage, a refused request has the background lane try the store at most this often.
PROBE_EVERY_S: Final = 1.0
# A waiting request looks this often whether its call was given up on.
_POLL_S: Final = 0.05


class StoreUnavailable(OperationalError):
    """The store cannot be reached now: refused at once during an outage, or given up on."""


class Outage:
    """Whether the store answers, as this process's calls last found it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self.since: float | None = None  # when the current outage began
        self._probe_at = 0.0

    @property
    def down(self) -> bool:
        return self.since is not None

    def failed(self, error: BaseException) -> None:
        with self._lock:
            if self.since is None:
                self.since = self._clock()
                logger.warning("the store is unreachable (%s)", type(error).__name__)
            self._probe_at = self._clock() + PROBE_EVERY_S

    def answered(self) -> None:
        with self._lock:
            if self.since is not None:
                logger.warning(
                    "the store answers again (unreachable for %.1fs)", self._clock() - self.since
                )
            self.since = None

    def probe_due(self) -> bool:
        """During an outage, True once every ``PROBE_EVERY_S``: time to try the store again."""
        with self._lock:
            if self.since is None or self._clock() < self._probe_at:
                return False
            self._probe_at = self._clock() + PROBE_EVERY_S
            return True


outage = Outage()


def store_down() -> bool:
    """The store did not answer this process's last call (and none has reached it since)."""
    return outage.down


def ready() -> None:
    """Call before database work in a lane's thread (the lanes call it themselves)."""
    if connection.connection is None:
        return
    if connection.errors_occurred:
        # The last statement failed: keep the connection only if it still answers.
        if connection.is_usable():
            connection.errors_occurred = False
        else:
            connection.close()


def _pooled() -> bool:
    return bool(connection.settings_dict.get("OPTIONS", {}).get("pool"))


class _Call:
    """One request's call on its way through the request lane."""

    def __init__(self) -> None:
        self.started: float | None = None
        self.given_up = False
        self.lock = threading.Lock()


# Made at import (their threads start with their first call), so that a lane asked for from
# another lane's thread is never made twice.
_lanes: Final = {
    name: ThreadPoolExecutor(1, thread_name_prefix=f"llmgw-store-{name}")
    for name in ("request", "background")
}


def _lane(name: str) -> ThreadPoolExecutor:
    return _lanes[name]


def _run(func: Callable[[*Ts], T], *args: *Ts) -> T:
    """``func`` in a lane's thread, its outcome noted in the outage state."""
    ready()
    try:
        result = func(*args)
    except UNREACHABLE as exc:
        outage.failed(exc)
        raise
    outage.answered()
    return result


async def in_background(func: Callable[[*Ts], T], *args: *Ts) -> T:
    """Run ``func`` in the background lane; nothing is refused or given up on there."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_lane("background"), lambda: _run(func, *args))


async def for_request(
    func: Callable[[*Ts], T], *args: *Ts, undo: Callable[[T], None] | None = None
) -> T:
    """Run ``func`` in the request lane for a request that waits for it. Raises
    :class:`StoreUnavailable` at once during an outage, and once the call has run for
    ``LLMGW_STORE_WAIT`` seconds; ``undo(result)`` then runs in the background lane if the call
    still completes (a reservation the request that asked for it never got)."""
    if outage.down:
        if outage.probe_due():
            _lane("background").submit(_run, _probe)
        raise StoreUnavailable("the store is unreachable")
    call = _Call()

    def in_lane() -> T:
        with call.lock:
            if call.given_up:  # the request left while this call queued
                raise StoreUnavailable("given up before it ran")
            call.started = time.monotonic()
        try:
            return _run(func, *args)
        finally:
            if _pooled():
                connection.close()  # back to the pool: this lane keeps none

    future = asyncio.get_running_loop().run_in_executor(_lane("request"), in_lane)

    def give_up() -> None:
        with call.lock:
            call.given_up = True
        # Whenever the call ends (it may have just now), what it took is given back.
        future.add_done_callback(partial(_undo_if_completed, undo))

    bound = float(settings.LLMGW_STORE_WAIT)
    while True:
        try:
            done, _ = await asyncio.wait({future}, timeout=_POLL_S)
        except asyncio.CancelledError:
            give_up()  # the request left (its client hung up): nobody has what it takes
            raise
        if done:
            return future.result()
        with call.lock:
            started = call.started
        overdue = started is not None and time.monotonic() - started >= bound
        # Another call found the store unreachable meanwhile (this one may be queued behind
        # it, or waiting for a connection the pool cannot make): no use waiting on.
        if overdue or outage.down:
            give_up()
            if overdue:
                outage.failed(TimeoutError(f"no answer within {bound:g}s"))
            raise StoreUnavailable("the store did not answer in time")


def _undo_if_completed(undo: Callable[[Any], None] | None, future: asyncio.Future[Any]) -> None:
    """A given-up call's outcome: undone in the background lane if it took something, else
    nobody's (retrieved, so asyncio does not log it)."""
    if future.cancelled():
        return
    if future.exception() is None and undo is not None:
        _lane("background").submit(_run, undo, future.result())


def _probe() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")


def close() -> None:
    """Close each lane's connection (tests: a database is dropped only once nobody holds it)."""
    for lane in list(_lanes.values()):
        with contextlib.suppress(Exception):
            lane.submit(connections.close_all).result(30)
