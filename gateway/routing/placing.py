"""Routing by the cache in one web process: what it knows of each upstream's cache and load and
of its host's other web processes, and the choice it makes from them for one request.

The decisions are pure and live apart (``prefix``: a prompt's blocks, ``mirrors``: what each
upstream is expected to hold, ``choice``: where a request goes); this holds their state for the
process and feeds them: the mirrors, corrected by what engines report (``learn``, ``measure``);
the loads, its own requests and the host's on the board (``loads``, ``board``); what it tells
its host's other processes of its placements and hears of theirs (``peers``); and new
prefixes' homes, so two processes do not place one prefix twice. ``gateway.routing.upstreams``
(the live table, holding requests at upstreams, the control plane's stamps) calls it.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.signals import setting_changed

from gateway.routing import prefix
from gateway.routing.board import Board
from gateway.routing.choice import CACHED, Bounds, Choice, Placement, choose_cached
from gateway.routing.loads import Loads
from gateway.routing.mirrors import Learned, Mirrors
from gateway.routing.peers import Peers
from gateway.routing.table import Route, Table, Upstream


@dataclass(frozen=True)
class RoutingSettings:
    """The ``LLMGW_ROUTING_*`` settings each request reads, read from Django's settings once
    (each read there costs a microsecond or more), again when one changes (tests)."""

    cache_aware: bool
    bounds: Bounds
    block_bytes: int
    max_blocks: int


@functools.cache
def routing_settings() -> RoutingSettings:
    return RoutingSettings(
        cache_aware=settings.LLMGW_ROUTING_POLICY == "cache_aware",
        bounds=Bounds(
            float(settings.LLMGW_ROUTING_LOAD_FACTOR),
            int(settings.LLMGW_ROUTING_LOAD_SLACK),
            int(settings.LLMGW_ROUTING_COLD_SLACK),
        ),
        block_bytes=int(settings.LLMGW_ROUTING_BLOCK_BYTES),
        max_blocks=int(settings.LLMGW_ROUTING_MAX_BLOCKS),
    )


def _routing_setting_changed(setting: str, **kwargs: Any) -> None:
    if setting.startswith("LLMGW_ROUTING_"):
        routing_settings.cache_clear()


setting_changed.connect(_routing_setting_changed, dispatch_uid="llmgw-routing-settings")


class Placer:
    """This process's routing by the cache (module docstring)."""

    def __init__(self) -> None:
        knobs = routing_settings()
        # What each upstream's prefix cache is expected to hold.
        self.mirrors = Mirrors(
            int(settings.LLMGW_ROUTING_MIRROR_BYTES), knobs.block_bytes, knobs.max_blocks
        )
        self.loads = Loads()  # the requests held at each upstream, this process's and the host's
        self.peers: Peers | None = None  # this host's other web processes, told each placement
        self._routed_ids: frozenset[str] = frozenset()  # the upstreams the table routes to
        self._by_column: dict[int, str] = {}  # the board's columns of those upstreams

    def share(self, loop: asyncio.AbstractEventLoop, folder: Path) -> None:
        """Share loads and new prefixes' homes with this host's other web processes on its
        board in ``folder`` (``gateway.routing.board``), and tell them placements
        (``gateway.routing.peers``)."""
        if self.peers:
            return
        if self.loads.board is None:
            board = Board.open(folder, time.monotonic())
            if board is not None:
                self.loads.share(board)
                atexit.register(self.loads.unshare)
        peers = Peers(folder, self._held_by_peer)
        if peers.start(loop):
            self.peers = peers
            atexit.register(peers.close)

    def _held_by_peer(self, upstream_id: str, keys: tuple[int, ...]) -> None:
        """A peer routed a prompt to ``upstream_id``; held if this process routes there too."""
        if upstream_id in self._routed_ids:
            self.mirrors.hold(upstream_id, keys)

    def remember(self, table: Table) -> None:
        """Keep what was learned of the caches of the upstreams ``table`` routes to, each
        bounded by its cache's size where its engine reported one: a replica that restarted,
        drained or left takes what was learned of its cache along."""
        size = self.mirrors.token_bytes
        self._routed_ids = frozenset(table.upstreams())
        self.loads.keep(self._routed_ids)
        if self.loads.board is not None:
            routed = {uid: u.generation for uid, u in table.upstreams().items()}
            self.loads.remember(routed, time.monotonic())
            self._by_column = self.loads.columns_by_upstream()
        self.mirrors.retain(
            {
                uid: (
                    u.generation,
                    None if u.cache_tokens is None else size.bytes(u.cache_tokens),
                )
                for uid, u in table.upstreams().items()
            }
        )

    def choose(
        self,
        route: Route,
        exclude: set[str] | frozenset[str],
        *,
        blocks: prefix.PromptBlocks,
        affinity: int | None,
        ejected_until: dict[str, float],
        now: float,
        offset: int,
    ) -> Choice | None:
        """The upstream for one attempt (``gateway.routing.choice``), its prompt's blocks then
        expected there and told to the host's other processes."""
        lead = blocks.lead
        key = affinity if affinity is not None else lead
        # Hotter than one upstream's fair share: no one upstream can serve it, spread it.
        hot = key is not None and self.loads.hot(key, len(route.upstreams))
        ids = _ids(route)
        seen = matches = self.mirrors.matches(ids, blocks.keys)
        if lead is not None and affinity is None and not any(seen.values()):
            matches = self._home_of(blocks, now) or seen
        # The longest prefix predicted cached, as a share of what the prompt's blocks cover
        # (the tail past the last full block is unknown everywhere).
        keyed = blocks.bytes_through(len(blocks.keys))
        longest = max(matches.values(), default=0)
        share = blocks.bytes_through(longest) / keyed if keyed else 0.0
        loads = self.loads

        def first_tokens() -> dict[str, float]:
            # Read only by the cold rule (most requests find their prefix cached): the prompt
            # bytes predicted cached where, and so what its prefill leaves to compute there.
            cached = {uid: blocks.bytes_through(n) for uid, n in matches.items() if n}
            return loads.first_tokens(ids, now, blocks.size, cached)

        choice = choose_cached(
            route.upstreams,
            loads.host_outstanding(ids, now),
            ejected_until,
            now,
            starts=first_tokens,
            placement=Placement(lead, affinity, matches, hot, share),
            bounds=routing_settings().bounds,
            exclude=exclude,
            offset=offset,
        )
        if choice is not None and choice.placed and lead is not None:
            choice = self._claim_home(route, choice, blocks, exclude=exclude, now=now)
        if choice is not None:
            self.mirrors.hold(choice.upstream.id, blocks.keys, seen.get(choice.upstream.id, 0))
            if self.peers is not None:
                self.peers.tell(choice.upstream.id, blocks.keys)
        return choice

    def new_to_host(self, route: Route, blocks: prefix.PromptBlocks, affinity: int | None) -> bool:
        """Would the choice place a prompt nobody is known to hold (its first block in no
        mirror of the route's upstreams)?"""
        lead = blocks.lead
        if lead is None or affinity is not None:
            return False
        mirrors = self.mirrors.by_upstream
        return not any(lead in m for u in route.upstreams if (m := mirrors.get(u.id)) is not None)

    def _home_of(self, blocks: prefix.PromptBlocks, now: float) -> dict[str, int] | None:
        """Where another process of this host placed this prompt's prefix moments ago (its
        home on the board), as far as their blocks agree: it has not told this one yet, and
        placing the prefix a second time would compute it twice."""
        board = self.loads.board
        found = board.home(blocks.keys, now) if board is not None else None
        if found is None:
            return None
        column, depth = found
        uid = self._by_column.get(column)
        return {uid: depth} if uid is not None else None

    def _claim_home(
        self,
        route: Route,
        choice: Choice,
        blocks: prefix.PromptBlocks,
        *,
        exclude: set[str] | frozenset[str],
        now: float,
    ) -> Choice:
        """Make the new prefix's upstream its home on the host's board; where another process
        placed it at the same instant, follow that one's choice instead."""
        board = self.loads.board
        column = self.loads.column(choice.upstream.id)
        if board is None or column is None:
            return choice
        home = board.claim_home(blocks.keys, column, now)
        if home == column:
            return choice
        uid = self._by_column.get(home)
        followed = self._home_of(blocks, now) or {}
        for upstream in route.upstreams:
            if upstream.id == uid and uid not in exclude:
                return Choice(upstream, CACHED, followed.get(uid, 1))
        return choice

    def learn(
        self,
        upstream: Upstream,
        blocks: prefix.PromptBlocks,
        predicted: int,
        cached: int,
        prompt: int,
    ) -> Learned:
        """What the engine reported it had cached of a prompt routed to it: the truth its
        mirror is corrected by."""
        confirmed = prefix.covering(blocks, cached, prompt)
        return self.mirrors.learn(upstream.id, predicted, confirmed)

    def measure(self, blocks: prefix.PromptBlocks, prompt_tokens: int) -> None:
        """An engine counted a prompt's tokens: how many bytes a token is, by which a cache
        size in tokens becomes a mirror's ceiling in blocks (at the next table load)."""
        self.mirrors.token_bytes.learn(blocks.size, prompt_tokens)


def _ids(route: Route) -> list[str]:
    return [u.id for u in route.upstreams]
