"""Which upstream takes a request: where its prompt's prefix is cached, bounded by load.

A pure function over plain data (the candidates, their outstanding counts, prefill waits and
ejections, what the mirrors predict is cached where, the request's keys), tested by table.

The order of preference:

1. **affinity** -- a client that names a session (``prompt_cache_key``, ``user``, an
   ``x-session-id`` header) keeps its requests on one upstream: the first of the candidates
   ranked by rendezvous hashing of the session's key;
2. **cached** -- else, where the prompt's prefix is predicted cached for at least
   ``CACHE_WORTH`` of it, the upstream predicted to hold the longest prefix (among equals the
   less loaded, passing over one whose queued prefill -- the prefix's first computation still
   running there, say -- would bring the first token later than another by more than
   ``HOLDER_WAIT_SLACK_S``);
3. **cold** -- else (nobody is known to hold it, or only a small part of it, say a short
   preamble that many different prompts open with), where its first token would come soonest:
   the upstreams where the prefill queued ahead of it plus its own uncached part would take
   least (``gateway.routing.loads``: a prompt's prefill waits behind the others', one at a
   time), of those the ones within a slack of the fewest outstanding, and of those the first of
   the candidates ranked by rendezvous hashing of its first block: every web process ranks them
   alike without talking to the others, so where their loads look alike (an idle fleet,
   processes on different hosts sending one conversation's turns one after the other) the
   requests that share a prefix gather on one upstream from the first one on, whichever
   process takes each;
4. **least loaded** -- a request without a prompt block (embeddings, rerank, a prompt shorter
   than one block) goes where the fewest requests are outstanding.

Load bounds affinity and the cache (consistent hashing with bounded loads): an upstream may
take a request only while its outstanding requests are under ``ceil(factor × (total + 1) × its
share of the weight)`` or under a slack, so a hot prefix or a busy session overflows to the
next upstream in its order -- the same next one in every process -- rather than queueing
behind itself; such a request's outcome is **spilled**. Some upstream is always under the
bound, since not all can be over the mean. The slack says what moving costs: a cool prefix
(less of what is in flight than one upstream's share) stays where it is cached up to a large
slack, since moving it costs a prefill elsewhere and cache the others need; a hot one
(``Placement.hot``) is bounded by the mean alone, since no single upstream can serve it, and
of the upstreams under the bound goes where its first token comes more than
``HOLDER_WAIT_SLACK_S`` sooner, if one would: a replica still computing it, with requests
queued behind that, may be slower than an idle one computing it afresh.
The counts are the host's: this process's own and its host's other web processes'
(``gateway.routing.board``).
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

from gateway.routing.table import Upstream, choose

AFFINITY = "affinity"
CACHED = "cached"
COLD = "cold"
SPILLED = "spilled"
LEAST_LOADED = "least_loaded"
OUTCOMES = (AFFINITY, CACHED, COLD, SPILLED, LEAST_LOADED)
# A prefix predicted cached for at least this share of the prompt keeps it where it is cached
# (bounded by load); a smaller one (a preamble many prompts share) is worth its prefill time
# saved and no more, weighed against the queues: piled onto one upstream for it, the prompts
# behind wait longer than the prefill it saves.
CACHE_WORTH = 0.5
# Of the upstreams predicted to hold the longest prefix alike, one where the prompt's first
# token would come more than this much later than at another goes after the others, however
# lightly loaded: a replica just given a hot prefix is computing it (a full prefill), and a
# request sent there waits for all of it while another holder answers at once. Small
# differences (a decode step, a short prompt's prefill) leave the less loaded first.
HOLDER_WAIT_SLACK_S = 0.010

_MASK = (1 << 64) - 1
_NOTHING: Mapping[str, int] = MappingProxyType({})


@dataclass(frozen=True)
class Bounds:
    """How far affinity may load an upstream past the mean (settings ``LLMGW_ROUTING_*``), and
    how far a new prefix's agreed place may be from the least loaded."""

    factor: float = 1.25
    slack: int = 32  # what a cool prefix's upstream may hold before the mean bounds it
    cold_slack: int = 1  # how many more than the least loaded a new prefix's upstream may hold
    hot_slack: int = 1  # a prefix hotter than one upstream's share: bounded by the mean alone


class Placement(NamedTuple):
    """What one request brings to the choice (a tuple: one is made for every request)."""

    lead: int | None = None  # its prompt's first block key (None: no full block)
    affinity: int | None = None  # the key of the session it names, if any
    matches: Mapping[str, int] = _NOTHING  # upstream id → blocks predicted
    # Its prefix (or session) is more of what is in flight than one upstream's fair share
    # (``gateway.routing.loads``): it is spread at the mean, not kept where it is cached.
    hot: bool = False
    share: float = 1.0  # of the prompt's bytes, the longest predicted prefix's share


class Choice(NamedTuple):
    upstream: Upstream
    outcome: str
    predicted: int  # blocks of the prompt the mirror expects the upstream to hold
    # It placed a prefix nobody was known to hold: where this host now expects it (its home).
    placed: bool = False


def session_key(value: str) -> int:
    """A session's name as a rendezvous key, the same in every process."""
    return zlib.crc32(value.encode("utf-8", "surrogatepass"))


def affinity_of(data: Mapping[str, object], session: str | None) -> int | None:
    """The session a request names, as a rendezvous key: OpenAI's ``prompt_cache_key`` (what
    the official client sends for this), else an ``x-session-id`` header, else the older
    ``user`` field. None when it names none (an empty or non-string value names none)."""
    for value in (data.get("prompt_cache_key"), session, data.get("user")):
        if isinstance(value, str) and value:
            return session_key(value)
    return None


@functools.lru_cache(maxsize=4096)
def _id_hash(upstream_id: str) -> int:
    return _mix(zlib.crc32(upstream_id.encode()))


def _mix(x: int) -> int:
    """SplitMix64's finalizer: every bit of the key moves every bit of the score."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def rendezvous(key: int, upstreams: Iterable[Upstream]) -> list[Upstream]:
    """Upstreams in their rendezvous order for ``key`` (highest random weight first, each
    upstream's chance to lead in proportion to its weight), the same in every process."""
    pool = list(upstreams)
    if all(u.weight == pool[0].weight for u in pool):  # replicas: the hash alone orders them
        return sorted(pool, key=lambda u: _mix((key ^ _id_hash(u.id)) & _MASK), reverse=True)

    def score(upstream: Upstream) -> float:
        unit = (_mix((key ^ _id_hash(upstream.id)) & _MASK) + 1) / (_MASK + 2)
        return -upstream.weight / math.log(unit)

    return sorted(pool, key=score, reverse=True)


def bound_of(upstream: Upstream, total: int, weight: int, slack: int, factor: float) -> int:
    """The outstanding requests ``upstream`` may have before it takes no more by affinity."""
    share = math.ceil(factor * (total + 1) * upstream.weight / weight)
    return max(slack, share)


def choose_cached(
    upstreams: Sequence[Upstream],
    outstanding: Mapping[str, int],
    ejected_until: Mapping[str, float],
    now: float,
    *,
    placement: Placement,
    bounds: Bounds,
    exclude: Iterable[str] = (),
    offset: int = 0,
    starts: Mapping[str, float] | Callable[[], Mapping[str, float]] | None = None,
) -> Choice | None:
    """The upstream for one request (module docstring), or None when there is no candidate.
    ``starts``: how long the prompt's first token would take at each upstream, the prefill
    queued ahead of it and its own uncached part (all alike where not given), or a function
    that works them out (called only where the cold rule needs them).

    Ejected upstreams are skipped while any other remains (then all are candidates: one that
    may have recovered beats a certain error); ``exclude`` holds the ones already tried.
    """
    skip = set(exclude)
    candidates = [u for u in upstreams if u.id not in skip] if skip else upstreams
    if not candidates:
        return None
    pool = candidates
    if ejected_until:
        pool = [u for u in candidates if ejected_until.get(u.id, 0.0) <= now] or candidates
    matches = placement.matches
    held = bool(matches) and any(matches.get(u.id, 0) for u in pool)
    if placement.affinity is not None:
        order, outcome = rendezvous(placement.affinity, pool), AFFINITY
    elif held and placement.share >= CACHE_WORTH:
        sole = _sole_holder(pool, matches, outstanding, bounds, hot=placement.hot)
        if sole is not None:
            return Choice(sole, CACHED, matches[sole.id])
        # The longest prefix first, the less loaded among equals; the table's own order (by
        # id, the same in every process) breaks what is left.
        order = sorted(pool, key=lambda u: (-matches.get(u.id, 0), outstanding.get(u.id, 0)))
        if len(order) > 1 and matches.get(order[1].id, 0) == matches.get(order[0].id, 0):
            starts = _read(starts)  # worked out once: the hot rule below reads them too
            order = _sooner_holders_first(order, matches, starts)
        outcome = CACHED
    elif placement.lead is not None:
        order, outcome = rendezvous(placement.lead, pool), COLD
    else:
        least = choose(pool, outstanding, {}, now, offset=offset)
        assert least is not None
        return Choice(least, LEAST_LOADED, 0)
    if outcome == COLD:
        # Little or nothing is cached to lose, so load decides. A prompt waits first behind
        # the prefill queued where it goes (one at a time), then for its own uncached part, so
        # among the upstreams where its first token would come soonest, and of those within
        # ``cold_slack`` of the fewest outstanding (what it would decode beside), the first in
        # the rendezvous order. Processes that see alike loads (an idle fleet) agree without
        # talking; the host's processes share one view of the loads, and where one places a
        # new prefix the others follow (its home on the board, then the placement itself in
        # their mirrors), so the next request of the prefix finds it cached.
        soon = _read(starts)
        soonest = min(soon.get(u.id, 0.0) for u in pool)
        level = [u for u in pool if soon.get(u.id, 0.0) <= soonest]
        fewest = min(outstanding.get(u.id, 0) for u in level)
        for rank, upstream in enumerate(order):
            if soon.get(upstream.id, 0.0) <= soonest and (
                outstanding.get(upstream.id, 0) <= fewest + bounds.cold_slack
            ):
                predicted = matches.get(upstream.id, 0)
                if predicted:
                    return Choice(upstream, CACHED, predicted)
                return Choice(upstream, COLD if rank == 0 else SPILLED, 0, placed=not held)
    counts = [outstanding.get(u.id, 0) for u in order]
    total = sum(counts)
    weight = sum([u.weight for u in order])
    slack = bounds.hot_slack if placement.hot else bounds.slack
    under = (
        r
        for r, u in enumerate(order)
        if counts[r] < bound_of(u, total, weight, slack, bounds.factor)
    )
    first = next(under, None)
    if first is not None:
        taken = first
        if placement.hot and outcome == CACHED:
            # No one upstream can serve a hot prefix: of those under the bound, where its first
            # token comes much sooner (not behind a replica still computing it, say).
            taken = _much_sooner(order, [first, *under], _read(starts))
        upstream = order[taken]
        return Choice(upstream, outcome if taken == 0 else SPILLED, matches.get(upstream.id, 0))
    # Only with weights that make every share round up past the mean: the least loaded.
    least = choose(pool, outstanding, {}, now, offset=offset)
    assert least is not None
    return Choice(least, SPILLED, matches.get(least.id, 0))


def _sole_holder(
    pool: Sequence[Upstream],
    matches: Mapping[str, int],
    outstanding: Mapping[str, int],
    bounds: Bounds,
    *,
    hot: bool,
) -> Upstream | None:
    """The upstream the cached rule takes at once, where it is plain: the only one predicted to
    hold the longest prefix, under its load bound, the prefix not hot. None where the rule has
    more to weigh (holders alike, a bound reached, a hot prefix). Most requests that find their
    prefix cached end here, so it skips the ordering of all candidates the full rule builds."""
    if hot:
        return None
    best: Upstream | None = None
    longest = tied = total = weight = 0
    for upstream in pool:
        depth = matches.get(upstream.id, 0)
        if depth > longest:
            best, longest, tied = upstream, depth, 0
        elif depth == longest:
            tied += 1
        total += outstanding.get(upstream.id, 0)
        weight += upstream.weight
    if best is None or tied:
        return None
    bound = bound_of(best, total, weight, bounds.slack, bounds.factor)
    return best if outstanding.get(best.id, 0) < bound else None


def _read(
    starts: Mapping[str, float] | Callable[[], Mapping[str, float]] | None,
) -> Mapping[str, float]:
    """The first-token waits given (worked out now where given as a function)."""
    return (starts() if callable(starts) else starts) or {}


def _much_sooner(order: Sequence[Upstream], ranks: list[int], soon: Mapping[str, float]) -> int:
    """The first of ``ranks`` (into ``order``), unless the prompt's first token would come more
    than ``HOLDER_WAIT_SLACK_S`` sooner at another of them: then the soonest."""
    if len(ranks) < 2 or not soon:
        return ranks[0]
    first = soon.get(order[ranks[0]].id, 0.0)
    soonest = min(ranks, key=lambda r: soon.get(order[r].id, 0.0))
    if first - soon.get(order[soonest].id, 0.0) > HOLDER_WAIT_SLACK_S:
        return soonest
    return ranks[0]


def _sooner_holders_first(
    order: list[Upstream], matches: Mapping[str, int], soon: Mapping[str, float]
) -> list[Upstream]:
    """``order`` (the longest prefix first, the less loaded among equals) with those of its
    leading upstreams that hold the longest prefix alike but where the prompt's first token
    would come more than ``HOLDER_WAIT_SLACK_S`` after the soonest of them (``soon``: the
    waits) moved behind the other holders (each group still in its order)."""
    if not soon:
        return order
    longest = matches.get(order[0].id, 0)
    holders = 0
    while holders < len(order) and matches.get(order[holders].id, 0) == longest:
        holders += 1
    waits = [soon.get(u.id, 0.0) for u in order[:holders]]
    latest = min(waits) + HOLDER_WAIT_SLACK_S
    if max(waits) <= latest:
        return order
    tied = order[:holders]
    sooner = [u for u, wait in zip(tied, waits, strict=True) if wait <= latest]
    later = [u for u, wait in zip(tied, waits, strict=True) if wait > latest]
    return sooner + later + order[holders:]
