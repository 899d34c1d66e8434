"""The live routing table of this web process, and the bookkeeping around it.

The table is loaded from the store by a background task and swapped whole, so a request reads
a consistent snapshot with no query. It reloads every ``LLMGW_ROUTING_REFRESH`` seconds, at
once when this process saves a routing row (Django signals), and four times as often while a
request waits for a cold model. Other processes see a change within one refresh interval; a
request for a model the table does not name waits for a load that began after it came
(``resolve``), so a model just added through another process answers at once.

Routing by the cache is ``gateway.routing.placing``'s; this holds a request at its upstream
(``take``: chosen and held in one step). Outstanding-request counts and ejections are per
process: each web process counts the requests it holds (``gateway.routing.loads``), and the
web processes of one host share theirs on the host's board (``gateway.routing.board``), so
routing by the cache judges the host's load. What the
control plane needs of them is reported off the request path by the same background task:
requests in flight per replica (as a heartbeat, whenever the set of busy replicas changed since
the last report, and at once when a replica idle for a while goes busy) and when each replica
last finished one, so a replica is never scaled down under a request. A report alone does not
reload the table: at one request at a time, every request flips its replica busy and idle, and
reloading on each flip cost more CPU than the request itself (docs/decisions.md, 'routing table
reloads').
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import math
import time
from datetime import datetime
from functools import partial
from typing import Any

from django.conf import settings
from django.db import DatabaseError
from django.db.models.signals import post_delete, post_save
from django.utils import timezone
from redis.exceptions import RedisError

from control import serving
from gateway import dbthread
from gateway.errors import ApiError
from gateway.models import Endpoint
from gateway.routing import prefix
from gateway.routing.choice import LEAST_LOADED, Choice
from gateway.routing.loading import load_table
from gateway.routing.loads import Hold
from gateway.routing.placing import Placer, routing_settings
from gateway.routing.table import (
    Route,
    Table,
    Upstream,
    choose,
)

logger = logging.getLogger(__name__)

# A replica going busy after an idle spell is reported this long after (see _report_shortly).
BUSY_REPORT_DELAY_S = 0.05
# A model the table does not name has its request wait for a table load that began after the
# request came (the model may have been added moments ago, through another process); such
# loads begin at most this often, so names nobody serves cost a load per interval, not one per
# request...
MISS_RELOAD_EVERY_S = 0.1
# ...and a request waits at most this long for one (the store may be slow or away).
MISS_WAIT_S = 1.0
# The refresh task wakes at least this often: it keeps this process's slot on the host's board
# alive (gateway.routing.board), however long the table's refresh interval is.
HEARTBEAT_S = 1.0


class Upstreams:
    """This process's routing table plus outstanding counts, ejections and demand stamps."""

    def __init__(self) -> None:
        self.table = Table()
        self.loaded = False
        # Routing by the cache: what this process knows of each upstream's cache and load and
        # of its host's other web processes (the requests it holds at each are its loads).
        self.placer = Placer()
        self.loads = self.placer.loads
        self.outstanding = self.loads.outstanding
        self.ejected_until: dict[str, float] = {}
        self.waiting: dict[int, int] = {}
        self._rotation = itertools.count()
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._first_load: asyncio.Future[None] | None = None
        self._stamped: dict[tuple[object, ...], float] = {}
        self._pending_last_request: set[tuple[str, int]] = set()
        self._pending_demand: set[int] = set()
        self._pending_profile_demand: set[tuple[int, str]] = set()
        self._finished: dict[int, datetime] = {}
        self._reported_busy: frozenset[int] | None = None
        self._reported_at = -math.inf
        self._background: set[asyncio.Task[Any]] = set()
        self._versions = itertools.count(1)
        self._refreshed: asyncio.Event | None = None
        self._reload_wanted = True
        self._miss_wanted = False  # a request found no route for its model: load again soon
        self._load_began = -math.inf  # when the load of the current table began (monotonic)
        self._tried_at = -math.inf  # when the refresh task last began a load (it may have failed)
        self._active_at: dict[str, float] = {}  # replica upstream id -> last finish, monotonic

    # --- the table ------------------------------------------------------------------------

    async def ready(self) -> Table:
        """The current table; the first call in a process waits for the first load. Raises
        503 while no table could ever be loaded (the store is down since this process began):
        an empty table would answer every model with a misleading 404."""
        if not self.loaded:
            await self.start()
            if not self.loaded:
                raise ApiError(
                    503,
                    "The gateway cannot read its routing table yet.",
                    "routing_unavailable",
                    retry_after=5,
                )
        return self.table

    async def start(self) -> None:
        """Start keeping the table (and this host's board) in this process, if not started on
        this loop, and wait for its first load (which may have failed: ``loaded`` says)."""
        loop = asyncio.get_running_loop()
        if self._task is None or self._loop is not loop:
            self._loop = loop
            self._wake = asyncio.Event()
            self._first_load = loop.create_future()
            self._task = loop.create_task(self._run(), name="llmgw-routing-refresh")
            if self._cache_aware() and settings.LLMGW_ROUTING_SHARE:
                self.placer.share(loop, settings.VAR_DIR / "routing-peers")
        assert self._first_load is not None
        await asyncio.shield(self._first_load)

    async def resolve(self, name: str) -> Route | None:
        """The route for the model ``name``, from the table ``ready`` gives (so the first call
        waits for the first load, and raises 503 as it does). Where the table has none, what a
        table load that began after this call says (waited for up to ``MISS_WAIT_S``; not while
        the store is down): a model added through another process is served at once, not after
        that process's next refresh here."""
        route = (await self.ready()).resolve(name)
        if route is not None or dbthread.store_down():
            return route  # with the store away, no load would say more
        asked = time.monotonic()
        until = asked + MISS_WAIT_S
        while self._load_began < asked:
            now = time.monotonic()
            if now >= until:
                break
            self._miss_wanted = True
            if self._wake is not None:
                self._wake.set()
            await self._changed(until - now)
        return self.table.resolve(name)

    async def refresh(self) -> None:
        began = time.monotonic()
        table = await dbthread.in_background(load_table, next(self._versions))
        self.table = table
        self.loaded = True
        self._load_began = began
        # What routing by the cache keeps of each upstream goes with those the table dropped.
        self.placer.remember(table)
        # Wake everyone waiting for a change, and give later waiters a fresh event.
        refreshed, self._refreshed = self._refreshed, asyncio.Event()
        if refreshed is not None:
            refreshed.set()

    @staticmethod
    def _cache_aware() -> bool:
        return routing_settings().cache_aware

    async def _changed(self, within: float) -> None:
        """Wait until the next table load, or ``within`` seconds."""
        if self._refreshed is None:
            self._refreshed = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, within)):
                await self._refreshed.wait()

    async def wait_for_upstream(self, route: Route, wanted: str, *, until: float) -> Route | None:
        """What ``wanted`` resolves to once that has an upstream, or None at ``until`` (on the
        ``time.monotonic()`` clock). Each table load is looked at as it lands, and before each
        wait demand for ``route`` is noted, so the reconciler places a replica (and goes on
        wanting it) for as long as a request waits."""
        while True:
            current = self.table.resolve(wanted)
            if current is not None and current.upstreams:
                return current
            now = time.monotonic()
            if now >= until:
                return None
            self.note_demand(route)
            await self._changed(until - now)

    async def _run(self) -> None:
        assert self._wake is not None and self._first_load is not None
        reload_at = -math.inf
        while True:
            # First: a slow store must not make this process look gone to its peers.
            self.loads.heartbeat(time.monotonic())
            try:
                now = time.monotonic()
                if self._reload_wanted or now >= min(reload_at, self._miss_reload_at()):
                    self._reload_wanted = self._miss_wanted = False
                    self._tried_at = now
                    reload_at = now + float(settings.LLMGW_ROUTING_REFRESH)
                    await self.refresh()
                await self._write_stamps()
                await self._report_in_flight()
            except (DatabaseError, RedisError) as exc:
                # Keep routing on the last table; the store (or Redis, which keeps the in-flight
                # counts where it is set) may come back.
                logger.warning("routing table refresh failed: %s", exc)
            except Exception:
                logger.exception("routing table refresh failed")
            if not self._first_load.done():
                self._first_load.set_result(None)
                # Everything the process keeps is imported and loaded by now. Freezing it takes
                # it out of the cyclic collector's scans: unfrozen, a full collection stalls
                # every request in flight; frozen, collections only scan what requests allocate
                # (docs/decisions.md, 'the heap frozen out of the cyclic collector').
                gc.freeze()
            if any(self.waiting.values()):
                reload_at = min(
                    reload_at, time.monotonic() + float(settings.LLMGW_ROUTING_REFRESH) / 4
                )
            with contextlib.suppress(TimeoutError):
                due = min(reload_at, self._miss_reload_at())
                wake_in = min(HEARTBEAT_S, due - time.monotonic())
                async with asyncio.timeout(max(0.0, wake_in)):
                    await self._wake.wait()
            self._wake.clear()

    def _miss_reload_at(self) -> float:
        """When a load for a request that found no route may begin (never, if none asked)."""
        return self._tried_at + MISS_RELOAD_EVERY_S if self._miss_wanted else math.inf

    def request_refresh(self) -> None:
        """Reload soon; safe from any thread (signal handlers run in the database thread)."""
        self._reload_wanted = True
        self.request_report()

    def _report_shortly(self) -> None:
        """Write stamps and in-flight counts ``BUSY_REPORT_DELAY_S`` from now (on the loop).
        Not at once: the request that made the replica busy is opening its upstream then, and
        the report's queries hold the GIL in the database thread while its first bytes arrive,
        delaying the first token after an idle spell (docs/decisions.md, 'busy report delay').
        A little later they overlap the engine's own work instead."""
        loop, wake = self._loop, self._wake
        if loop is None or wake is None or loop.is_closed():
            return
        loop.call_later(BUSY_REPORT_DELAY_S, wake.set)

    def request_report(self) -> None:
        """Write stamps and in-flight counts soon (the table only if a reload is wanted)."""
        loop, wake = self._loop, self._wake
        if loop is None or wake is None or loop.is_closed():
            return
        loop.call_soon_threadsafe(wake.set)

    # --- choosing and accounting ---------------------------------------------------------

    def choose(
        self,
        route: Route,
        exclude: set[str] | frozenset[str] = frozenset(),
        *,
        blocks: prefix.PromptBlocks = prefix.NO_BLOCKS,
        affinity: int | None = None,
        now: float | None = None,
    ) -> Choice | None:
        """The upstream for one attempt: by the cache (``Placer.choose``), or by outstanding
        requests alone under the ``least_outstanding`` policy and where there is no choice."""
        if now is None:
            now = time.monotonic()
        if not self._cache_aware() or len(route.upstreams) < 2:
            upstream = choose(
                route.upstreams,
                self.outstanding,
                self.ejected_until,
                now,
                exclude=exclude,
                offset=next(self._rotation),
            )
            return None if upstream is None else Choice(upstream, LEAST_LOADED, 0)
        return self.placer.choose(
            route,
            exclude,
            blocks=blocks,
            affinity=affinity,
            ejected_until=self.ejected_until,
            now=now,
            offset=next(self._rotation),
        )

    def take(
        self,
        route: Route,
        exclude: set[str] | frozenset[str] = frozenset(),
        *,
        blocks: prefix.PromptBlocks = prefix.NO_BLOCKS,
        affinity: int | None = None,
        key: int | None = None,
    ) -> tuple[Choice, Hold] | None:
        """Choose the upstream for one attempt and hold the request there (``acquire``) in one
        step. A prompt nobody on this host is known to hold is placed under the board's lock
        (``gateway.routing.board``): the host's loads read, the choice made and its prefill
        counted there before any other process of the host reads them, so two processes
        placing new prompts at the same instant do not both take the upstream that looked
        least loaded to each."""
        board = self.loads.board
        if (
            board is not None
            and self._cache_aware()
            and self.placer.new_to_host(route, blocks, affinity)
        ):
            with board.locked():
                return self._take(route, exclude, blocks, affinity, key)
        return self._take(route, exclude, blocks, affinity, key)

    def _take(
        self,
        route: Route,
        exclude: set[str] | frozenset[str],
        blocks: prefix.PromptBlocks,
        affinity: int | None,
        key: int | None,
    ) -> tuple[Choice, Hold] | None:
        now = time.monotonic()
        choice = self.choose(route, exclude, blocks=blocks, affinity=affinity, now=now)
        if choice is None:
            return None
        # What its engine will prefill: the prompt less what the choice expected cached there
        # (an estimate in written-out bytes; 0 for a request without a prompt).
        prefill = blocks.uncached(choice.predicted)
        return choice, self.acquire(choice.upstream, prefill, key, now=now)

    def acquire(
        self,
        upstream: Upstream,
        prefill: int = 0,
        key: int | None = None,
        *,
        now: float | None = None,
    ) -> Hold:
        """A request is sent to ``upstream``, bringing ``prefill`` prompt bytes for its engine
        to prefill (as the choice expected), of the prefix (or session) ``key``: held there
        until ``release``."""
        if now is None:
            now = time.monotonic()
        hold = self.loads.acquire(upstream.id, prefill, now, key)
        if self.outstanding[upstream.id] == 1 and upstream.id.startswith("replica:"):
            last_finished = self._active_at.get(upstream.id, -math.inf)
            if now - last_finished >= serving.STAMP_EVERY_S:
                # A replica idle for a while going busy is reported within moments, not at the
                # next cycle: until then the reconciler could take it for idle. One that
                # finished a request within the stamp interval is recent use in the store
                # already (its finish time is written by then), and the next cycle reports it.
                self._report_shortly()
        return hold

    def answered(self, hold: Hold) -> None:
        """A held request had its first byte: its prefill is done."""
        self.loads.answered(hold, time.monotonic())

    def release(self, hold: Hold) -> None:
        """A held request ended, answered or not."""
        self.loads.release(hold)
        uid = hold.upstream_id
        if uid.startswith("replica:"):
            self._finished[int(uid[8:])] = timezone.now()
            self._active_at[uid] = time.monotonic()
        # A replica going idle is reported by the next cycle (within a refresh interval): it
        # may then be scaled down, which is not urgent.

    def busy_replicas(self) -> dict[int, int]:
        """Requests this process has in flight, per replica."""
        return {
            int(uid[8:]): n
            for uid, n in self.outstanding.items()
            if uid.startswith("replica:") and n > 0
        }

    def eject(self, upstream: Upstream, seconds: float | None = None) -> None:
        cool_down = float(settings.LLMGW_EJECT_SECONDS) if seconds is None else seconds
        self.ejected_until[upstream.id] = time.monotonic() + cool_down
        logger.warning("upstream %s ejected for %.1fs", upstream.id, cool_down)

    # --- stamps for the reconciler (coalesced, written by the refresh task) ---------------

    def note_request(self, route: Route, upstream: Upstream | None) -> None:
        # A request for model@profile is use of that profile's replicas, told through their
        # finish times and in-flight counts; the model's own stamp is its default profile's.
        if route.catalog_id is not None and route.default_profile:
            self._pending_last_request.add(("model", route.catalog_id))
        if upstream is not None and upstream.id.startswith("replica:"):
            self._pending_last_request.add(("replica", int(upstream.id[8:])))

    def note_demand(self, route: Route) -> None:
        """A request found no ready replica; the reconciler places one on its next tick."""
        if route.catalog_id is None:
            return
        if route.default_profile or route.profile is None:
            self._pending_demand.add(route.catalog_id)
        else:
            self._pending_profile_demand.add((route.catalog_id, route.profile))
        # Demand is what starts a cold model: write it now, not at the next refresh.
        self.request_report()

    async def _write_stamps(self) -> None:
        now = time.monotonic()
        due_demand = {m for m in self._pending_demand if self._due(("demand", m), now)}
        due_profiles = {
            (m, p) for m, p in self._pending_profile_demand if self._due(("demand", m, p), now)
        }
        self._pending_profile_demand -= due_profiles
        due_last = {k for k in self._pending_last_request if self._due(k, now)}
        due_finished = {
            r: at for r, at in self._finished.items() if self._due(("finished", r), now)
        }
        self._pending_demand -= due_demand
        self._pending_last_request -= due_last
        for replica_id in due_finished:
            del self._finished[replica_id]
        if due_demand or due_last or due_finished or due_profiles:
            await dbthread.in_background(
                write_stamps, due_demand, due_last, due_finished, due_profiles
            )

    async def _report_in_flight(self) -> None:
        """Tell the control plane what is in flight here, when the set of busy replicas
        changed and at least every ``CONFIRM_EVERY_S`` (the heartbeat that keeps these
        counts, and this process's activation waiters, from going stale)."""
        busy = self.busy_replicas()
        now = time.monotonic()
        self._active_at = {
            uid: at for uid, at in self._active_at.items() if now - at < serving.STAMP_EVERY_S
        }
        if (
            frozenset(busy) == self._reported_busy
            and now - self._reported_at < serving.CONFIRM_EVERY_S
        ):
            return
        await dbthread.in_background(serving.report_in_flight, busy)
        self._reported_busy = frozenset(busy)
        self._reported_at = now

    # --- activation waiters, counted across processes -------------------------------------

    async def take_waiting_slot(self, catalog_id: int, limit: int) -> bool:
        """Room for one more request waiting for this model, across every web process? A slot
        the request was answered 503 for before the count answered is given back."""
        taken = await dbthread.for_request(
            serving.take_waiting_slot, catalog_id, limit, undo=partial(_give_back, catalog_id)
        )
        if not taken:
            return False
        self.waiting[catalog_id] = self.waiting.get(catalog_id, 0) + 1
        return True

    def leave_waiting_slot(self, catalog_id: int) -> None:
        """Give the slot back, off the caller's path (it may be a cancelled request)."""
        left = self.waiting.get(catalog_id, 1) - 1
        if left <= 0:
            self.waiting.pop(catalog_id, None)
        else:
            self.waiting[catalog_id] = left
        task = asyncio.get_running_loop().create_task(self._leave(catalog_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _leave(self, catalog_id: int) -> None:
        try:
            await dbthread.in_background(serving.leave_waiting_slot, catalog_id)
        except Exception as exc:
            # The slot's row goes stale with this process's next missed heartbeat at worst.
            logger.warning("could not give back a waiting slot: %s", type(exc).__name__)

    def _due(self, key: tuple[object, ...], now: float) -> bool:
        # The control plane keeps stamps to this precision; writing more often is wasted.
        every = serving.STAMP_EVERY_S
        if now - self._stamped.get(key, -every) < every:
            return False
        self._stamped[key] = now
        return True


def _give_back(catalog_id: int, taken: bool) -> None:
    if taken:
        serving.leave_waiting_slot(catalog_id)


def write_stamps(
    demand: set[int],
    last_request: set[tuple[str, int]],
    finished: dict[int, datetime] | None = None,
    profile_demand: set[tuple[int, str]] | None = None,
) -> None:
    """Report demand and last requests to the control plane (which writes them only where its
    stamp is older than ``serving.STAMP_EVERY_S``, so processes do not pile up writes)."""
    serving.record_demand(demand)
    if profile_demand:
        serving.record_profile_demand(profile_demand)
    serving.record_requests(
        [i for kind, i in last_request if kind == "model"],
        [i for kind, i in last_request if kind == "replica"],
    )
    if finished:
        serving.record_finished(finished)


upstreams = Upstreams()


def _endpoint_changed(sender: Any, **kwargs: Any) -> None:
    upstreams.request_refresh()


serving.on_routing_change(upstreams.request_refresh)
post_save.connect(_endpoint_changed, sender=Endpoint, dispatch_uid="llmgw-route-endpoint")
post_delete.connect(_endpoint_changed, sender=Endpoint, dispatch_uid="llmgw-route-d-endpoint")
