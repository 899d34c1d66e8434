"""What each upstream is doing, as this process and its host's other web processes see it: the
requests outstanding there and the prefill queued there, which the load bounds and the cold
rule of ``gateway.routing.choice`` read.

Per upstream this process keeps its outstanding requests, those of them still awaiting a first
byte, the prompt bytes those bring for the engine to prefill (the prompt less what the choice
expected cached there) and when each was sent; and per prefix (or session) its requests in
flight, which say whether it is **hot**: more than one upstream can serve. Where the host's
board is open (``gateway.routing.board``) each change is written to this process's slot on it
as it happens, and the host's counts are read from it, so every process of the host judges
every upstream by all the host's requests there, as they are now; without the board they are
this process's own.

**The prefill queue.** An engine computes a prompt's uncached tokens before its first token,
compute-bound, one prefill after another: a new prompt waits behind the prefill queued ahead of
it. That queue, the **backlog**, is the prompt bytes awaiting a first byte at the upstream, less
what the engine has prefilled of them: at the rate it prefills, since it began on the oldest
of them (when that was sent, or when the prefill before it ended, its first byte, whichever
came later). The rate is learned from the upstream's own first bytes (``PrefillRate``): each
request's prefill bytes and the backlog ahead of it when it was sent, over its time to first
byte. Until an upstream has answered any, the backlog is the bytes queued, with none done.

**Hot prefixes.** A prefix (or session) whose requests in flight are more than one upstream's
fair share of all in flight cannot be served by one upstream however the rest is placed, so
routing spreads it at the mean load (``gateway.routing.choice``); a cooler one is kept where
its cache is until its upstream is loaded well past the mean, since moving it costs a prefill
elsewhere and cache the others need. Only a share past the fair one by more than chance
explains counts (``HOT_DEVIATIONS``): among a burst's first requests some prefix is a large
share by luck alone, and spreading it then computes it on several upstreams for nothing.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TypeVar

from gateway.routing.board import Board, HostCounts

logger = logging.getLogger(__name__)

K = TypeVar("K", str, int)

# Each first byte's sample weighs this much against what was learned before it.
RATE_DECAY = 0.98
# A first byte later than this says nothing of the prefill (a stall, a retry's wait)...
MAX_SAMPLE_S = 60.0
# ...and no engine prefills faster than this many bytes a second (a rate past it is noise).
MAX_RATE = 1e9
# Samples tell a slope where their sizes spread by this much (a standard deviation of about
# 250 tokens: a difference in prefill that jitter in the fixed costs does not hide)...
RATE_SPREAD_BYTES = 1024.0
# ...else their bytes over their times are the rate only if they are this large (about a
# thousand tokens: a prefill of tens of milliseconds at least), not a few words whose first
# byte is all fixed costs.
RATE_ALONE_BYTES = 4096.0
# A prefix is hot where its requests in flight pass one upstream's fair share by more than this
# many standard deviations of chance (about the square root of the fair share).
HOT_DEVIATIONS = 3.0
# The other web processes' counts read from the board are used again for this long: requests
# are chosen for at every turn of a busy loop; the others' change is seen a moment later (the
# process's own, at once).
PEERS_FRESH_S = 0.002
# Bytes of prompt prefilled a second where no upstream has answered yet: only the order of the
# upstreams' waits matters then, and every upstream gets the same rate.
DEFAULT_PREFILL_RATE = 50_000.0


class PrefillRate:
    """Bytes of prompt an upstream prefills a second, as its first bytes tell.

    A time to first byte is a fixed part (the network, the engine's parsing and first decoding
    step, ours) plus the prefill, in proportion to the bytes prefilled: a straight line through
    the samples, fitted by least squares over sums that decay with each sample, has the rate as
    its inverse slope. A short prompt's first byte is mostly the fixed part; taken as a rate it
    would say the engine is slow. Where the samples do not yet tell a slope (all of one size),
    their bytes over their times are the rate if they are large enough for the fixed part to
    matter little (``RATE_ALONE_BYTES``), else it is not known yet."""

    __slots__ = ("_n", "_x", "_xx", "_xy", "_y", "value")

    def __init__(self) -> None:
        self._n = self._x = self._y = self._xx = self._xy = 0.0
        self.value: float | None = None  # worked out once a sample, read on every request

    def learn(self, prefilled: float, seconds: float) -> None:
        if prefilled <= 0 or not 0 < seconds < MAX_SAMPLE_S:
            return
        decay = RATE_DECAY
        self._n = self._n * decay + 1.0
        self._x = self._x * decay + prefilled
        self._y = self._y * decay + seconds
        self._xx = self._xx * decay + prefilled * prefilled
        self._xy = self._xy * decay + prefilled * seconds
        self.value = self._fit()

    def _fit(self) -> float | None:
        n, x, y = self._n, self._x, self._y
        if n <= 0 or y <= 0:
            return None
        spread = n * self._xx - x * x  # n² times the variance of the sizes
        if spread > (n * RATE_SPREAD_BYTES) ** 2:  # sizes differ enough to tell a slope
            slope = (n * self._xy - x * y) / spread
            if slope > 0:
                return min(MAX_RATE, 1.0 / slope)
        if x / n < RATE_ALONE_BYTES:
            return None
        return min(MAX_RATE, x / y)


class Hold:
    """One request held at an upstream, from its send to its end."""

    __slots__ = ("ahead", "answered", "key", "prefill", "sent", "upstream_id")

    def __init__(
        self, upstream_id: str, prefill: int, sent: float, ahead: float, key: int | None
    ) -> None:
        self.upstream_id = upstream_id
        self.key = key  # its prefix's (or session's) key, counted in flight
        self.prefill = prefill  # prompt bytes it brings to be prefilled (an estimate)
        self.sent = sent
        self.ahead = ahead  # the backlog it was sent behind (an estimate)
        self.answered = False


class Loads:
    """This process's requests at each upstream, written to the host's board where it has one."""

    def __init__(self) -> None:
        self.outstanding: dict[str, int] = {}
        self.awaiting: dict[str, int] = {}  # of those, not answered a first byte yet
        self.pending: dict[str, int] = {}  # and the prompt bytes those bring to prefill
        self._queued: dict[str, dict[Hold, None]] = {}  # awaiting, oldest first
        self._answered_at: dict[str, float] = {}  # each upstream's last first byte
        self.rates: dict[str, PrefillRate] = {}
        self._mean_rate: float | None = None  # of the upstreams whose rate is known...
        self._rate_sum = 0.0  # ...their sum...
        self._rates_known = 0  # ...and how many
        self._peers_view: tuple[float, tuple[str, ...], HostCounts] | None = None
        self.in_flight: dict[int, int] = {}  # requests held per prefix (or session) key
        self.flying = 0  # requests held with a key
        self.board: Board | None = None
        self._columns: dict[str, int] = {}

    # --- the board ----------------------------------------------------------------------

    def share(self, board: Board) -> None:
        self.board = board

    def unshare(self) -> None:
        board, self.board = self.board, None
        self._columns = {}
        if board is not None:
            board.close()

    def remember(self, upstreams: Mapping[str, int], now: float) -> None:
        """The upstreams routed to now (id → generation): their columns on the board, kept in
        use there. A replica that restarted is a new upstream there (its id and generation),
        so what the board held of it before (its homes) is not read for it."""
        board = self.board
        if board is None:
            return
        names = {f"{uid}@{generation}": uid for uid, generation in upstreams.items()}
        columns = board.columns(list(names), now)
        self._columns = {names[name]: c for name, c in columns.items() if c >= 0}

    def keep(self, upstream_ids: Iterable[str]) -> None:
        """What is learned of each upstream is kept for the ones routed to (``upstream_ids``)
        and those holding requests: replicas come and go, and a process runs for months."""
        keep = set(upstream_ids) | set(self.outstanding)
        for learned in (self.rates, self._answered_at):
            for uid in [u for u in learned if u not in keep]:
                del learned[uid]
        known = [v for r in self.rates.values() if (v := r.value) is not None]
        self._rate_sum, self._rates_known = sum(known), len(known)
        self._mean_rate = self._rate_sum / self._rates_known if known else None

    def column(self, upstream_id: str) -> int | None:
        """Where ``upstream_id`` is counted on the board (None: not on it)."""
        return self._columns.get(upstream_id)

    def columns_by_upstream(self) -> dict[int, str]:
        """The upstreams routed to now, by their columns on the board."""
        return {column: uid for uid, column in self._columns.items()}

    def heartbeat(self, now: float) -> None:
        """About once a second: this process is alive; where it had to take a slot anew
        (silent for too long, another process took it over) its counts are written again."""
        board = self.board
        if board is None:
            return
        try:
            had = board.owns_slot()
            board.heartbeat(now)
        except OSError as error:
            logger.warning("routing loads are no longer shared: %s", error)
            self.unshare()
            return
        if not had:
            for uid in self._columns:
                self._write(uid)

    def _write(self, uid: str) -> None:
        board = self.board
        column = self._columns.get(uid)
        if board is None or column is None:
            return
        queued = self._queued.get(uid)
        board.write(
            column,
            self.outstanding.get(uid, 0),
            self.awaiting.get(uid, 0),
            self.pending.get(uid, 0),
            (next(iter(queued)).sent if queued else 0.0, self._answered_at.get(uid, 0.0)),
        )

    # --- one request --------------------------------------------------------------------

    def acquire(self, upstream_id: str, prefill: int, now: float, key: int | None = None) -> Hold:
        """A request sent to ``upstream_id`` bringing ``prefill`` prompt bytes to prefill; of
        the prefix (or session) ``key``, if it has one. It is queued behind the host's backlog
        there, which its first byte's time tells the prefill rate by; one that brings nothing
        to prefill (no prompt routing knows of) tells nothing of it, and reads no backlog."""
        prefill = max(0, prefill)
        ahead = self.backlog(upstream_id, now) if prefill else 0.0
        hold = Hold(upstream_id, prefill, now, ahead, key)
        if key is not None:
            self.in_flight[key] = self.in_flight.get(key, 0) + 1
            self.flying += 1
        self.outstanding[upstream_id] = self.outstanding.get(upstream_id, 0) + 1
        self.awaiting[upstream_id] = self.awaiting.get(upstream_id, 0) + 1
        self.pending[upstream_id] = self.pending.get(upstream_id, 0) + hold.prefill
        self._queued.setdefault(upstream_id, {})[hold] = None
        self._write(upstream_id)
        return hold

    def answered(self, hold: Hold, now: float) -> None:
        """Its first byte: its prefill is done, and says how fast the upstream prefills."""
        if hold.answered:
            return
        self._dequeue(hold)
        rate = self.rates.get(hold.upstream_id)
        if rate is None:
            rate = self.rates[hold.upstream_id] = PrefillRate()
        was = rate.value
        rate.learn(hold.prefill + hold.ahead, now - hold.sent)
        if rate.value != was:
            self._rate_sum += (rate.value or 0.0) - (was or 0.0)
            self._rates_known += (rate.value is not None) - (was is not None)
            self._mean_rate = self._rate_sum / self._rates_known if self._rates_known else None
        self._answered_at[hold.upstream_id] = now
        self._write(hold.upstream_id)

    def release(self, hold: Hold) -> None:
        """It ended, answered or not."""
        uid = hold.upstream_id
        if not hold.answered:
            self._dequeue(hold)
        _decrement(self.outstanding, uid, 1)
        if hold.key is not None:
            _decrement(self.in_flight, hold.key, 1)
            self.flying -= 1
            hold.key = None
        self._write(uid)

    def _dequeue(self, hold: Hold) -> None:
        hold.answered = True
        uid = hold.upstream_id
        _decrement(self.awaiting, uid, 1)
        _decrement(self.pending, uid, hold.prefill)
        queued = self._queued.get(uid)
        if queued is not None:
            queued.pop(hold, None)
            if not queued:
                del self._queued[uid]

    # --- what the choice reads ------------------------------------------------------------

    def hot(self, key: int, upstreams: int) -> bool:
        """Would one more request of ``key`` make it more of what is in flight than one of
        ``upstreams`` upstreams' fair share, by more than chance explains?"""
        count = self.in_flight.get(key, 0) + 1
        fair = (self.flying + 1) / max(1, upstreams)
        return count - fair > HOT_DEVIATIONS * math.sqrt(fair)

    def rate(self, upstream_id: str) -> float | None:
        """How fast ``upstream_id`` prefills (bytes a second); for one not heard from yet, the
        mean of the others' (upstreams of one model are mostly alike); None before any."""
        own = self.rates.get(upstream_id)
        if own is not None and own.value is not None:
            return own.value
        return self._mean_rate

    def host_outstanding(self, upstream_ids: Sequence[str], now: float) -> Mapping[str, int]:
        """Each upstream's outstanding requests: the host's where the board is shared (this
        process's own as they are, the others' as the board showed them), else this
        process's."""
        own = self.outstanding
        peers = self._peers(upstream_ids, now)
        if peers is None:
            return own
        return {
            uid: own.get(uid, 0) + theirs
            for uid, theirs in zip(upstream_ids, peers.outstanding, strict=True)
        }

    def first_tokens(
        self,
        upstream_ids: Sequence[str],
        now: float,
        size: int,
        cached: Mapping[str, int] | None = None,
    ) -> dict[str, float]:
        """How long a prompt of ``size`` bytes, of which ``cached`` bytes are predicted cached
        at each upstream, would take to its first token there: the host's prefill queued
        ahead of it and its own uncached part (seconds). The cold rule's reading."""
        held = cached or {}
        peers = self._peers(upstream_ids, now)
        # Each upstream's queue drains at its own rate; the prompt's own part is priced at one
        # rate for all (their mean), so only what is cached where sets it apart: learned rates
        # differ a little by chance, and at an idle fleet that must not outweigh the order
        # every process agrees on.
        mean = self._mean_rate or DEFAULT_PREFILL_RATE
        first_tokens: dict[str, float] = {}
        for i, uid in enumerate(upstream_ids):
            rate = self.rate(uid) or mean
            left = self._backlog(uid, now, rate, peers, i)
            first_tokens[uid] = left / rate + max(0, size - held.get(uid, 0)) / mean
        return first_tokens

    def backlog(self, upstream_id: str, now: float) -> float:
        """The host's prefill queued at ``upstream_id`` and not yet done, in bytes: what a
        request sent there now waits behind (the others' counts as the choice just read them,
        where it did)."""
        rate = self.rate(upstream_id) or DEFAULT_PREFILL_RATE
        board = self.board
        if board is None:
            return self._backlog(upstream_id, now, rate, None, -1)
        fresh = self._fresh_view(now)
        if fresh is not None:
            ids, counts = fresh
            with contextlib.suppress(ValueError):  # not among the upstreams last read
                return self._backlog(upstream_id, now, rate, counts, ids.index(upstream_id))
        counts = board.host([self._columns.get(upstream_id, -1)], now, others=True)
        return self._backlog(upstream_id, now, rate, counts, 0)

    def _backlog(
        self, uid: str, now: float, rate: float, peers: HostCounts | None, at: int
    ) -> float:
        """``uid``'s prefill still ahead (bytes): this process's queue there and, in
        ``peers`` at index ``at``, the host's other processes', less what the engine has done
        of it since it began on the oldest (its send, or the last first byte if later)."""
        pending = self.pending.get(uid, 0)
        queued = self._queued.get(uid)
        oldest = next(iter(queued)).sent if queued else 0.0
        answered = self._answered_at.get(uid, 0.0)
        if peers is not None:
            pending += peers.pending[at]
            theirs = peers.oldest[at]
            if theirs and (not oldest or theirs < oldest):
                oldest = theirs
            answered = max(answered, peers.answered[at])
        if not pending:
            return 0.0
        return self._left(pending, max(oldest, answered), now, rate)

    def _peers(self, upstream_ids: Sequence[str], now: float) -> HostCounts | None:
        """The host's other web processes' counts for ``upstream_ids`` from the board (None
        without one), as read within the last PEERS_FRESH_S: a request is chosen for at every
        turn of a busy loop, and reading the others' slots each time costs more than the
        choice itself. Under the board's lock (a new prompt's placement) always read now."""
        board = self.board
        if board is None:
            return None
        key = tuple(upstream_ids)
        fresh = self._fresh_view(now)
        if fresh is not None and fresh[0] == key:
            return fresh[1]
        columns = [self._columns.get(uid, -1) for uid in upstream_ids]
        counts = board.host(columns, now, others=True)
        self._peers_view = (now, key, counts)
        return counts

    def _fresh_view(self, now: float) -> tuple[tuple[str, ...], HostCounts] | None:
        """The others' counts last read (for which upstreams, and the counts) if they may be
        used again now: read within PEERS_FRESH_S, and not under the board's lock."""
        view = self._peers_view
        board = self.board
        if view is None or board is None or board.is_locked():
            return None
        if not 0.0 <= now - view[0] < PEERS_FRESH_S:
            return None
        return view[1], view[2]

    @staticmethod
    def _left(pending: int, started: float, now: float, rate: float) -> float:
        """The bytes of prefill still ahead: what is queued, less what the engine has done of
        it since it began on the oldest of it (``started``), at ``rate`` bytes a second."""
        if not pending or not started:
            return float(pending)
        return max(0.0, pending - rate * (now - started))


def _decrement(counts: dict[K, int], key: K, by: int) -> None:
    left = counts.get(key, 0) - by
    if left <= 0:
        counts.pop(key, None)
    else:
        counts[key] = left
